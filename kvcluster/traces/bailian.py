"""Qwen/Bailian KVCache traces (alibaba-edu/qwen-bailian-usagetraces-anon): jsonl of `chat_id`,
`parent_chat_id` (-1 for a first turn), `timestamp` (s), `input_length`, `output_length`,
`type` (text/search/image/file), `turn` and `hash_ids` (16-token blocks).

Hash ids are global to the trace (one key namespace). The session of a request
is the root of its parent_chat_id chain, resolved after the whole file is read
(a parent outside the file becomes the root, so its children still share a
session). Requests are ordered by timestamp (stable).
"""

from __future__ import annotations

from pathlib import Path

from ..keys import KeySpace
from .base import Trace, TraceRequest
from .chains import HashKeyChain
from .classify import PrefixClassifier
from .records import Problems, check_block_size, count, first_record, int_list, jsonl_records, require_file, seconds

BLOCK_SIZE = 16
NO_PARENT = (None, -1, "-1", "")


def _roots(parents: dict[str, str | None]) -> dict[str, str]:
    """chat id -> root of its parent chain (memoized; a cycle ends at the chat that closes it)."""
    roots: dict[str, str] = {}
    for chat in parents:
        path, node = [], chat
        while node not in roots and parents.get(node) is not None and node not in path:
            path.append(node)
            node = parents[node]
        root = roots.get(node, node)
        for n in path:
            roots[n] = root
        roots.setdefault(chat, root)
    return roots


class BailianLoader:
    format = "bailian"

    def sniff(self, path: str) -> bool:
        obj = first_record(Path(path))
        return obj is not None and "hash_ids" in obj and "chat_id" in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None) -> Trace:
        p = require_file(path, self.format)
        bs = check_block_size(self.format, block_size, BLOCK_SIZE)
        problems = Problems(strict)
        rows, parents = [], {}
        for line, obj in jsonl_records(p, problems, max_records):
            ids, ts, chat = int_list(obj.get("hash_ids")), seconds(obj.get("timestamp")), obj.get("chat_id")
            n_in, n_out = count(obj.get("input_length", 0)), count(obj.get("output_length", 0))
            if ids is None or ts is None or n_in is None or n_out is None or chat in NO_PARENT:
                problems.report(f"{p}:{line}", "needs chat_id, timestamp >= 0 (s), input_length/output_length >= 0 "
                                "and hash_ids: [int]")
                continue
            parent = obj.get("parent_chat_id")
            parents[str(chat)] = None if parent in NO_PARENT else str(parent)
            rows.append((ts, str(chat), ids, n_in, n_out))
        roots = _roots(parents)
        rows.sort(key=lambda r: r[0])
        chain = HashKeyChain(KeySpace(model=f"trace:{self.format}"))
        classifier = PrefixClassifier(bs)
        requests = []
        for arrival, chat, ids, n_in, n_out in rows:
            session = roots[chat]
            keys = chain.keys(ids, stream=session)
            labels = classifier.label(keys, session, input_tokens=n_in, output_tokens=n_out)
            requests.append(TraceRequest(arrival, session, keys, labels.block_types, labels.transition, n_in, n_out))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
