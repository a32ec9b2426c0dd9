"""ShareGPT: `id` and `conversations: [{from: human|gpt|system, value}]` per entry, one
entry per line (jsonl), or all in one JSON array as upstream's
ShareGPT_V3_unfiltered_cleaned_split.json ships (bad entries: "path:record N").

ShareGPT split long conversations into parts "{root}_0", "{root}_1", ...; the
parts of one root are consecutive pieces of one conversation (a part may start
with a gpt message that answers the previous part), so they are joined back in
file order into one session named by the root. Each gpt turn is then a request
whose prompt is everything before it (text.py). `max_records` limits the lines
read, since tokenizing all 24 MiB takes a while. The file has no times: they are
drawn, seeded, by `TraceClock` (text.py, docs/traces.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Trace
from .classify import role_type
from .records import Problems, first_record, json_records, require_file
from .text import Conversation, Message, TraceClock, conversations_to_requests

DEFAULT_BLOCK_SIZE = 16
TEMPLATE_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "assistant": "assistant", "system": "system", "tool": "tool"}


def root_id(entry_id: str) -> str:
    """'QWJhYvA_2' -> 'QWJhYvA'; an id without a numeric part suffix is its own root."""
    root, _, part = entry_id.rpartition("_")
    return root if root and part.isdigit() else entry_id


def _messages(raw: Any) -> list[Message] | None:
    if not isinstance(raw, list):
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            return None
        speaker = m["from"].lower()
        out.append(Message(TEMPLATE_ROLES.get(speaker, "user"), m["value"], role_type(speaker)))
    return out


class ShareGPTLoader:
    format = "sharegpt"
    untimed = True  # the file has no times: the loader draws them (TraceClock)

    def sniff(self, path: str) -> bool:
        obj = first_record(Path(path))
        return obj is not None and isinstance(obj.get("conversations"), list)

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None, clock: TraceClock | None = None) -> Trace:
        """`clock`: how the untimed turns are timed (default `TraceClock()`: seeded random, text.py)."""
        p = require_file(path, self.format)
        convs, problems = self.conversations(p, strict=strict, max_records=max_records)
        bs = block_size or DEFAULT_BLOCK_SIZE
        requests = conversations_to_requests(convs, bs, clock=clock)
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))

    def conversations(self, path: str | Path, *, strict: bool = False,
                      max_records: int | None = None) -> tuple[list[Conversation], Problems]:
        """The file's conversations (split parts joined), before tokenization."""
        p = require_file(path, self.format)
        problems = Problems(strict)
        sessions: dict[str, list[Message]] = {}
        for where, obj in json_records(p, problems, max_records):
            messages = _messages(obj.get("conversations"))
            if messages is None or not isinstance(obj.get("id"), str):
                problems.report(where, "needs id: str and conversations: [{from: str, value: str}]")
                continue
            sessions.setdefault(root_id(obj["id"]), []).extend(messages)
        return [Conversation(root, tuple(msgs)) for root, msgs in sessions.items()], problems
