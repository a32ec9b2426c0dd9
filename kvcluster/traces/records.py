"""Reading trace records with their line numbers, and reporting the bad ones.

Every loader reports a malformed record as "path:WHERE: reason" (WHERE is the
1-based line of a jsonl/csv file, or "record N" inside a JSON document) and
skips it; in strict mode the first one raises TraceError with that message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import TraceError

HEAD_BYTES = 1 << 20  # sniffing reads at most this much of a file


@dataclass
class Problems:
    """Malformed records of one load: listed and skipped, or fatal in strict mode."""

    strict: bool
    lines: list[str] = field(default_factory=list)

    def report(self, where: str, reason: str) -> None:
        message = f"{where}: {reason}"
        if self.strict:
            raise TraceError(message)
        self.lines.append(message)


def require_path(path: str | Path) -> Path:
    """The path as a Path; TraceError if nothing is there."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"trace not found: {p}")
    return p


def require_file(path: str | Path, fmt: str) -> Path:
    """The path of a one-file trace; TraceError if missing or a directory."""
    p = require_path(path)
    if not p.is_file():
        raise TraceError(f"{p} is not a file; a {fmt} trace is one file")
    return p


def check_block_size(fmt: str, given: int | None, native: int) -> int:
    """Hash-only traces fix their block size: their hash ids are the blocks."""
    if given is not None and given != native:
        raise TraceError(f"{fmt} traces use {native}-token blocks (their hash ids); "
                         f"block_size={given} does not apply")
    return native


def jsonl_records(path: Path, problems: Problems,
                  max_records: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, object) of each JSON-object line; blank lines are ignored."""
    good = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if max_records is not None and good >= max_records:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.report(f"{path}:{number}", f"not JSON ({exc.msg})")
                continue
            if not isinstance(obj, dict):
                problems.report(f"{path}:{number}", "not a JSON object")
                continue
            good += 1
            yield number, obj


def json_records(path: Path, problems: Problems,
                 max_records: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """("path:LINE" | "path:record N", object) from a jsonl file, or from a file holding one
    JSON array of objects (as ShareGPT's own .json is)."""
    if not head_text(path, 64).lstrip().startswith("["):
        for line, obj in jsonl_records(path, problems, max_records):
            yield f"{path}:{line}", obj
        return
    doc = read_json(path, problems)
    if doc is None:
        return
    if not isinstance(doc, list):
        problems.report(f"{path}:1", "not a JSON array")
        return
    for index, obj in enumerate(doc[:max_records]):
        if isinstance(obj, dict):
            yield f"{path}:record {index}", obj
        else:
            problems.report(f"{path}:record {index}", "not a JSON object")


def read_json(path: Path, problems: Problems) -> Any:
    """A whole-file JSON document, or None (reported as "path:1") when it does not parse."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        problems.report(f"{path}:1", f"not JSON ({exc})")
        return None


def head_text(path: Path, size: int = HEAD_BYTES) -> str:
    """The first `size` bytes of a file as text ("" if unreadable): what sniffers look at."""
    try:
        with open(path, "rb") as f:
            return f.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def first_record(path: Path) -> dict[str, Any] | None:
    """The first object of a jsonl file (or of a JSON array file), if it fits the head."""
    if not path.is_file():
        return None
    head = head_text(path).lstrip()
    try:
        if head.startswith("["):
            obj, _ = json.JSONDecoder().raw_decode(head, len(head) - len(head[1:].lstrip()))
        else:
            obj = json.loads(next((line for line in head.splitlines() if line.strip()), ""))
    except (json.JSONDecodeError, StopIteration):
        return None
    return obj if isinstance(obj, dict) else None


def int_list(value: Any) -> list[int] | None:
    """The value if it is a list of ints (bools excluded), else None."""
    if isinstance(value, list) and set(map(type, value)) <= {int}:
        return value
    return None


def count(value: Any) -> int | None:
    """A non-negative token count (an int or an integral float), else None."""
    if type(value) is int and value >= 0:
        return value
    if type(value) is float and value >= 0 and value.is_integer():
        return int(value)
    return None


def seconds(value: Any) -> float | None:
    """A finite, non-negative time, else None."""
    if type(value) in (int, float) and 0 <= value < float("inf"):
        return float(value)
    return None
