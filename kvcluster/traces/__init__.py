"""Trace loaders: `load_trace(path, format="auto")` for every supported format."""

from __future__ import annotations

from ..errors import TraceError
from .azure import AzureLoader
from .base import Trace, TraceRequest
from .chat import LMSYSLoader, ShareGPTLoader, SWEAgentLoader
from .claude_code import ClaudeCodeLoader
from .hashed import BailianLoader, MooncakeLoader
from .records import require_file

LOADERS = {
    loader.format: loader
    for loader in (MooncakeLoader(), BailianLoader(), ClaudeCodeLoader(), ShareGPTLoader(), LMSYSLoader(),
                   SWEAgentLoader(), AzureLoader())
}
TRACE_FORMATS = ["auto", *LOADERS]


def detect_format(path: str) -> str:
    require_file(path)
    for name, loader in LOADERS.items():
        if loader.sniff(path):
            return name
    raise TraceError(f"cannot tell the format of {path}; pass --format ({', '.join(LOADERS)})")


def load_trace(path: str, format: str = "auto", block_size: int | None = None, strict: bool = False,
               max_records: int | None = None) -> Trace:
    """Load a trace file or directory; malformed records are skipped (listed in Trace.skipped)."""
    if format != "auto" and format not in LOADERS:
        raise TraceError(f"unknown trace format {format!r}; choose from {', '.join(TRACE_FORMATS)}")
    name = detect_format(path) if format == "auto" else format
    return LOADERS[name].load(path, block_size=block_size, strict=strict, max_records=max_records)


__all__ = ["LOADERS", "TRACE_FORMATS", "Trace", "TraceRequest", "detect_format", "load_trace"]
