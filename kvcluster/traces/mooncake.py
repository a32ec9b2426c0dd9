"""Mooncake FAST'25 traces (kvcache-ai/Mooncake): jsonl of `timestamp` (ms), `input_length`,
`output_length` and `hash_ids` (512-token blocks).

Hash ids are global to the file, so all requests share one key namespace: key i
is `chain_hash_ids(hash_ids)[i]`, and equal hash-id prefixes give equal keys.
One request per line, in file order (stable-sorted by time, which the published
traces already are). There are no session ids: classify.py infers them.
"""

from __future__ import annotations

from pathlib import Path

from ..keys import KeySpace
from .base import Trace, TraceRequest
from .chains import HashKeyChain
from .classify import PrefixClassifier
from .records import Problems, check_block_size, count, first_record, int_list, jsonl_records, require_file, seconds

BLOCK_SIZE = 512


class MooncakeLoader:
    format = "mooncake"

    def sniff(self, path: str) -> bool:
        obj = first_record(Path(path))
        return obj is not None and "hash_ids" in obj and "timestamp" in obj and "chat_id" not in obj

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None) -> Trace:
        p = require_file(path, self.format)
        bs = check_block_size(self.format, block_size, BLOCK_SIZE)
        problems = Problems(strict)
        rows = []
        for line, obj in jsonl_records(p, problems, max_records):
            ids, ts = int_list(obj.get("hash_ids")), seconds(obj.get("timestamp"))
            n_in, n_out = count(obj.get("input_length", 0)), count(obj.get("output_length", 0))
            if ids is None or ts is None or n_in is None or n_out is None:
                problems.report(f"{p}:{line}", "needs timestamp >= 0 (ms), input_length/output_length >= 0 "
                                "and hash_ids: [int]")
                continue
            rows.append((ts / 1000.0, ids, n_in, n_out))
        rows.sort(key=lambda r: r[0])
        chain = HashKeyChain(KeySpace(model=f"trace:{self.format}"))
        classifier = PrefixClassifier(bs)
        requests = []
        for arrival, ids, n_in, n_out in rows:
            keys = chain.keys(ids)
            labels = classifier.label(keys, input_tokens=n_in, output_tokens=n_out)
            requests.append(TraceRequest(arrival, labels.session, keys, labels.block_types, labels.transition,
                                         n_in, n_out))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
