"""Text conversation traces: ShareGPT, LMSYS-Chat-1M and SWE-agent trajectories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..keys import KeySpace
from .base import Trace
from .records import Problems, first_json_line, jsonl_records, require_file
from .text import Conversation, conversations_to_requests

DEFAULT_BLOCK_SIZE = 16


def _messages(raw: Any, role_key: str, content_key: str) -> tuple[tuple[str, str], ...] | None:
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get(content_key), str) or not isinstance(m.get(role_key), str):
            return None
        out.append((m[role_key].lower(), m[content_key]))
    return tuple(out)


class ShareGPTLoader:
    """ShareGPT jsonl: `id` and `conversations: [{from, value}]`; session = id without its `_N` part."""

    format = "sharegpt"

    def sniff(self, path: str) -> bool:
        obj = first_json_line(Path(path)) if Path(path).is_file() else None
        return bool(obj) and "conversations" in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, **_) -> Trace:
        p = require_file(path)
        problems = Problems(strict)
        convs = []
        for line, obj in jsonl_records(p, problems):
            msgs = _messages(obj.get("conversations"), "from", "value")
            if msgs is None or not isinstance(obj.get("id"), str):
                problems.report(f"{p}:{line}", "needs id and conversations: [{from, value}]")
                continue
            convs.append(Conversation(obj["id"].rsplit("_", 1)[0], msgs))
            if max_records is not None and len(convs) >= max_records:
                break
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, KeySpace(model="trace:text"))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))


class LMSYSLoader:
    """LMSYS-Chat-1M jsonl: `conversation_id`, `model`, `turn`, `conversation: [{role, content}]`."""

    format = "lmsys"

    def sniff(self, path: str) -> bool:
        obj = first_json_line(Path(path)) if Path(path).is_file() else None
        return bool(obj) and "conversation" in obj and "conversation_id" in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, **_) -> Trace:
        p = require_file(path)
        problems = Problems(strict)
        convs = []
        for line, obj in jsonl_records(p, problems):
            msgs = _messages(obj.get("conversation"), "role", "content")
            if msgs is None or obj.get("conversation_id") is None:
                problems.report(f"{p}:{line}", "needs conversation_id and conversation: [{role, content}]")
                continue
            convs.append(Conversation(str(obj["conversation_id"]), msgs))
            if max_records is not None and len(convs) >= max_records:
                break
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, KeySpace(model="trace:text"))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))


class SWEAgentLoader:
    """SWE-agent `.traj` files (a file or a directory, walked recursively): one request per
    assistant turn of `history`; user messages after the first assistant turn are tool
    observations (TOOL), earlier ones the task (HISTORY)."""

    format = "swe-agent"

    def sniff(self, path: str) -> bool:
        p = Path(path)
        return p.suffix == ".traj" or (p.is_dir() and next(p.rglob("*.traj"), None) is not None)

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, **_) -> Trace:
        p = require_file(path)
        files = sorted(p.rglob("*.traj")) if p.is_dir() else [p]
        problems = Problems(strict)
        convs = []
        for f in files:
            try:
                doc = json.loads(f.read_text(errors="replace"))
            except (OSError, json.JSONDecodeError) as exc:
                problems.report(f"{f}:1", f"not JSON ({exc})")
                continue
            msgs = _messages(doc.get("history") if isinstance(doc, dict) else None, "role", "content")
            if msgs is None:
                problems.report(f"{f}:1", "needs history: [{role, content}]")
                continue
            convs.append(Conversation(str(f.relative_to(p) if p.is_dir() else f.name), _tool_roles(msgs), agent=True))
            if max_records is not None and len(convs) >= max_records:
                break
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, KeySpace(model="trace:text"))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))


def _tool_roles(msgs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    out, acted = [], False
    for role, content in msgs:
        if role == "assistant":
            acted = True
        out.append(("observation" if role == "user" and acted else role, content))
    return tuple(out)
