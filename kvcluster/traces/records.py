"""Reading trace records with line numbers, and reporting bad ones."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import TraceError


@dataclass
class Problems:
    """Malformed records: skipped and listed, or fatal in strict mode."""

    strict: bool
    lines: list[str] = field(default_factory=list)

    def report(self, where: str, reason: str) -> None:
        message = f"{where}: {reason}"
        if self.strict:
            raise TraceError(message)
        self.lines.append(message)


def require_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"trace not found: {p}")
    return p


def jsonl_records(path: Path, problems: Problems) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each well-formed JSON object line; blank lines are skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
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
            yield number, obj


def first_json_line(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return obj if isinstance(obj, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return None


def int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0:
        return float(value)
    return None
