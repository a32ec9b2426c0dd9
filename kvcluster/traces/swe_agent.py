"""SWE-agent trajectories (`.traj`, JSON): a file, or a directory walked recursively.

Each assistant message of `history` (the message list sent to the model) is one
request whose prompt is every history message before it (text.py); session = the
file's path relative to the directory. Roles: system -> SYSTEM; a user message
before the first assistant turn (the task, and demonstrations) -> HISTORY; a user
message after an assistant turn (the observation of its action) or a `tool`
message -> TOOL; assistant -> OUTPUT. Every request after a trajectory's first is
an AGENT_STEP. Malformed history messages skip the trajectory, reported as
"path:record N" (N = index in `history`). Trajectories in file order; their steps
are timed by `TraceClock` (text.py, docs/traces.md): the files carry no times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..block_types import BlockType
from .base import Trace
from .records import Problems, read_json, require_path
from .text import Conversation, Message, TraceClock, conversations_to_requests

DEFAULT_BLOCK_SIZE = 16


def _content(value: Any) -> str | None:
    """A message's text: a string, or a list of {text} parts (newer SWE-agent)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, dict) and isinstance(v.get("text"), str) for v in value):
        return "".join(v["text"] for v in value)
    return None


def _messages(f: Path, history: list, problems: Problems) -> list[Message] | None:
    out, acted = [], False
    for index, m in enumerate(history):
        role = m.get("role") if isinstance(m, dict) else None
        content = _content(m.get("content")) if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool") or content is None:
            problems.report(f"{f}:record {index}", "history message needs role system|user|assistant|tool and content")
            return None
        if role == "system":
            kind = BlockType.SYSTEM
        elif role == "assistant":
            kind, acted = BlockType.OUTPUT, True
        elif role == "tool" or acted:
            kind = BlockType.TOOL
        else:
            kind = BlockType.HISTORY
        out.append(Message(role, content, kind))
    return out


class SWEAgentLoader:
    format = "swe-agent"
    untimed = True  # the file has no times: the loader draws them (TraceClock)

    def sniff(self, path: str) -> bool:
        p = Path(path)
        return p.suffix == ".traj" if p.is_file() else p.is_dir() and next(p.rglob("*.traj"), None) is not None

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, clock: TraceClock | None = None) -> Trace:
        """`clock`: how the untimed turns are timed (default `TraceClock()`: seeded random, text.py)."""
        p = require_path(path)
        convs, problems = self.conversations(p, strict=strict, max_records=max_records)
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, agent=True, clock=clock)
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))

    def conversations(self, path: str | Path, *, strict: bool = False,
                      max_records: int | None = None) -> tuple[list[Conversation], Problems]:
        """One conversation per trajectory file (its `history`), before tokenization."""
        p = require_path(path)
        files = sorted(p.rglob("*.traj")) if p.is_dir() else [p]
        problems = Problems(strict)
        convs = []
        for f in files:
            if max_records is not None and len(convs) >= max_records:
                break
            doc = read_json(f, problems)
            if doc is None:
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("history"), list):
                problems.report(f"{f}:1", "no 'history' list")
                continue
            messages = _messages(f, doc["history"], problems)
            if messages is not None:
                convs.append(Conversation(f.relative_to(p).as_posix() if p.is_dir() else f.name, tuple(messages)))
        return convs, problems
