"""Azure LLM inference traces (Splitwise): arrival times and token counts only.

There are no prefix hashes or text, so every request gets its own unique blocks
(ceil(ContextTokens / block size) keys in a per-request namespace): useful for
arrival processes and lengths, never for hit rates.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from ..block_types import BlockType, TransitionType
from ..keys import KeySpace
from .base import Trace, TraceRequest
from .records import Problems, require_file


class AzureLoader:
    format = "azure"
    default_block_size = 16

    def sniff(self, path: str) -> bool:
        p = Path(path)
        if not p.is_file() or p.suffix.lower() != ".csv":
            return False
        with open(p, errors="replace") as f:
            return "ContextTokens" in f.readline()

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False, **_) -> Trace:
        p = require_file(path)
        bs = block_size or self.default_block_size
        problems = Problems(strict)
        space = KeySpace(model=f"trace:{self.format}")
        requests, t0 = [], None
        with open(p, newline="", errors="replace") as f:
            reader = csv.DictReader(f)
            for line, row in enumerate(reader, start=2):
                try:
                    ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                    ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                    if ctx < 0 or gen < 0:
                        raise ValueError("negative token count")
                except (KeyError, TypeError, ValueError) as exc:
                    problems.report(f"{p}:{line}", f"bad row ({exc})")
                    continue
                t0 = ts if t0 is None else t0
                n = -(-ctx // bs)
                keys = tuple(space.chain_hash_ids([f"{line}:{j}" for j in range(n)]))
                requests.append(TraceRequest(ts - t0, str(line), keys, (BlockType.HISTORY,) * n,
                                             TransitionType.FIRST, ctx, gen))
        requests.sort(key=lambda r: r.arrival_s)
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
