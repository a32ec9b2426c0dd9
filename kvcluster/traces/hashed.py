"""Hash-only traces: Mooncake and Qwen/Bailian jsonl (block hash ids + arrival times)."""

from __future__ import annotations

from pathlib import Path

from ..keys import KeySpace
from .base import Trace, TraceRequest
from .classify import HashTraceClassifier
from .records import Problems, first_json_line, int_list, jsonl_records, number, require_file


class MooncakeLoader:
    """Mooncake FAST'25 traces: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

    Hash ids are global to the file (512-token blocks): one key namespace, and
    sessions are inferred from prefixes (see classify.py).
    """

    format = "mooncake"
    default_block_size = 512

    def sniff(self, path: str) -> bool:
        obj = first_json_line(Path(path)) if Path(path).is_file() else None
        return bool(obj) and "hash_ids" in obj and "timestamp" in obj and "chat_id" not in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False, **_) -> Trace:
        p = require_file(path)
        bs = block_size or self.default_block_size
        problems = Problems(strict)
        space = KeySpace(model=f"trace:{self.format}")
        classifier = HashTraceClassifier(bs)
        requests = []
        for line, obj in jsonl_records(p, problems):
            ids, ts = int_list(obj.get("hash_ids")), number(obj.get("timestamp"))
            out_len = number(obj.get("output_length", 0))
            in_len = number(obj.get("input_length", 0))
            if ids is None or ts is None or out_len is None or in_len is None:
                problems.report(f"{p}:{line}", "needs timestamp >= 0, input/output_length >= 0 and hash_ids: [int]")
                continue
            keys = tuple(space.chain_hash_ids(ids))
            session, transition, types = classifier.classify(keys, None, int(out_len))
            requests.append(TraceRequest(ts / 1000.0, session, keys, types, transition, int(in_len), int(out_len)))
        requests.sort(key=lambda r: r.arrival_s)
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))


class BailianLoader:
    """Qwen/Bailian KVCache traces: `chat_id`, `parent_chat_id`, `timestamp` (s), `hash_ids` (16-token blocks).

    The session of a request is the root of its parent_chat_id chain.
    """

    format = "bailian"
    default_block_size = 16

    def sniff(self, path: str) -> bool:
        obj = first_json_line(Path(path)) if Path(path).is_file() else None
        return bool(obj) and "hash_ids" in obj and "chat_id" in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False, **_) -> Trace:
        p = require_file(path)
        bs = block_size or self.default_block_size
        problems = Problems(strict)
        space = KeySpace(model=f"trace:{self.format}")
        classifier = HashTraceClassifier(bs)
        root: dict[str, str] = {}
        rows = []
        for line, obj in jsonl_records(p, problems):
            ids, ts = int_list(obj.get("hash_ids")), number(obj.get("timestamp"))
            chat = obj.get("chat_id")
            if ids is None or ts is None or chat is None:
                problems.report(f"{p}:{line}", "needs chat_id, timestamp >= 0 and hash_ids: [int]")
                continue
            parent = obj.get("parent_chat_id")
            key = str(chat)
            root[key] = root.get(str(parent), str(parent)) if parent not in (None, -1, "", "-1") else key
            rows.append((float(ts), root[key], ids, int(obj.get("input_length") or len(ids) * bs),
                         int(obj.get("output_length") or 0)))
        rows.sort(key=lambda r: r[0])
        requests = []
        for ts, session, ids, in_len, out_len in rows:
            keys = tuple(space.chain_hash_ids(ids))
            session, transition, types = classifier.classify(keys, session, out_len)
            requests.append(TraceRequest(ts, session, keys, types, transition, in_len, out_len))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
