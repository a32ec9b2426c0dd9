"""LMSYS-Chat-1M jsonl: `conversation_id`, `model`, `turn`, `language`,
`conversation: [{role: user|assistant|system, content}]` (plus moderation fields).

Each record is one conversation (session = conversation_id); each assistant turn
is a request whose prompt is everything before it (text.py). The file has no
times: they are drawn, seeded, by `TraceClock` (text.py, docs/traces.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Trace
from .classify import role_type
from .records import Problems, first_record, json_records, require_file
from .text import Conversation, Message, TraceClock, conversations_to_requests

DEFAULT_BLOCK_SIZE = 16
TEMPLATE_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
                  "tool": "tool"}


def _messages(raw: Any) -> list[Message] | None:
    if not isinstance(raw, list):
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        role = m["role"].lower()
        out.append(Message(TEMPLATE_ROLES.get(role, "user"), m["content"], role_type(role)))
    return out


class LMSYSLoader:
    format = "lmsys"
    untimed = True  # the file has no times: the loader draws them (TraceClock)

    def sniff(self, path: str) -> bool:
        obj = first_record(Path(path))
        return obj is not None and "conversation_id" in obj and "conversation" in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, clock: TraceClock | None = None) -> Trace:
        """`clock`: how the untimed turns are timed (default `TraceClock()`: seeded random, text.py)."""
        p = require_file(path, self.format)
        problems = Problems(strict)
        convs = []
        for where, obj in json_records(p, problems, max_records):
            messages = _messages(obj.get("conversation"))
            conv_id = obj.get("conversation_id")
            if messages is None or not isinstance(conv_id, (str, int)) or isinstance(conv_id, bool):
                problems.report(where, "needs conversation_id and conversation: [{role: str, content: str}]")
                continue
            convs.append(Conversation(str(conv_id), tuple(messages)))
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, clock=clock)
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
