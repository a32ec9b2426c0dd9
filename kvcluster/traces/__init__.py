"""Trace loaders: `load_trace(path, format="auto")` for every supported format.

Each loader (one module per format) reads one format into a `Trace` of
`TraceRequest`s with prefix-chained block keys, block types and transitions
(classify.py). Malformed records are skipped and listed in `Trace.skipped`;
strict=True raises TraceError on the first.
"""

from __future__ import annotations

from ..errors import TraceError
from .azure import AzureLoader
from .bailian import BailianLoader
from .base import Trace, TraceLoader, TraceRequest
from .claude_code import ClaudeCodeLoader
from .lmsys import LMSYSLoader
from .mooncake import MooncakeLoader
from .records import require_path
from .sharegpt import ShareGPTLoader
from .swe_agent import SWEAgentLoader
from .text import TraceClock

TRACE_FORMATS: list[str] = ["mooncake", "bailian", "claude-code", "sharegpt", "swe-agent", "lmsys", "azure"]
# Sniffed in this order: the most specific markers first.
LOADERS: dict[str, TraceLoader] = {
    loader.format: loader
    for loader in (ClaudeCodeLoader(), SWEAgentLoader(), BailianLoader(), MooncakeLoader(), LMSYSLoader(),
                   ShareGPTLoader(), AzureLoader())
}
# Formats whose files carry no times: their loaders draw them (`TraceClock`).
UNTIMED_FORMATS: list[str] = [name for name in TRACE_FORMATS if getattr(LOADERS[name], "untimed", False)]


def detect_format(path: str) -> str:
    """The first format whose loader recognises the file (or directory)."""
    require_path(path)
    for name, loader in LOADERS.items():
        if loader.sniff(path):
            return name
    raise TraceError(f"cannot tell the format of {path}; pass a format: {', '.join(TRACE_FORMATS)}")


def load_trace(path: str, format: str = "auto", block_size: int | None = None, strict: bool = False,
               max_records: int | None = None, clock: TraceClock | None = None) -> Trace:
    """Load a trace file or directory. `max_records` (None = all) caps the records read
    (lines; session files for claude-code, trajectories for swe-agent). `clock` times the
    formats whose files carry no times (UNTIMED_FORMATS: sharegpt, swe-agent, lmsys); None is
    `TraceClock()`, seeded random session arrivals and think times (docs/traces.md). Other
    formats keep the file's own times and ignore it."""
    if format != "auto" and format not in LOADERS:
        raise TraceError(f"unknown trace format {format!r}; choose auto or one of {', '.join(TRACE_FORMATS)}")
    if block_size is not None and block_size <= 0:
        raise TraceError(f"block_size must be a positive number of tokens, not {block_size}")
    name = detect_format(path) if format == "auto" else format
    require_path(path)
    loader = LOADERS[name]
    timing = {"clock": clock} if getattr(loader, "untimed", False) else {}
    return loader.load(str(path), block_size=block_size, strict=strict, max_records=max_records, **timing)


__all__ = ["LOADERS", "TRACE_FORMATS", "UNTIMED_FORMATS", "Trace", "TraceClock", "TraceRequest", "detect_format",
           "load_trace"]
