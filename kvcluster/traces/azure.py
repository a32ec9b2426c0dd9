"""Azure LLM inference traces 2023 (Splitwise): CSV of TIMESTAMP, ContextTokens, GeneratedTokens.

For arrival processes and lengths only. There are no prefix hashes and no text,
so each request gets ceil(ContextTokens / block_size) blocks of its own (a
namespace per request: the CSV line) and never shares one; its hit rate is 0 by
construction. Block size defaults to 16 tokens. Times are seconds since the
earliest row.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from ..block_types import BlockType, TransitionType
from ..keys import KeySpace
from .base import Trace, TraceRequest
from .records import Problems, head_text, require_file

DEFAULT_BLOCK_SIZE = 16
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class AzureLoader:
    format = "azure"

    def sniff(self, path: str) -> bool:
        p = Path(path)
        header = head_text(p, 4096).partition("\n")[0] if p.is_file() else ""
        return all(c in header for c in COLUMNS)

    def load(self, path: str, *, block_size: int | None = None, strict: bool = False,
             max_records: int | None = None) -> Trace:
        p = require_file(path, self.format)
        bs = block_size or DEFAULT_BLOCK_SIZE
        problems = Problems(strict)
        space = KeySpace(model=f"trace:{self.format}")
        rows = []
        with open(p, newline="", encoding="utf-8", errors="replace") as f:
            for line, row in enumerate(csv.DictReader(f), start=2):
                if max_records is not None and len(rows) >= max_records:
                    break
                try:
                    when = datetime.fromisoformat(row["TIMESTAMP"].strip())
                    ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                    if ctx < 0 or gen < 0:
                        raise ValueError("negative token count")
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    problems.report(f"{p}:{line}", f"needs TIMESTAMP, ContextTokens, GeneratedTokens ({exc})")
                    continue
                rows.append((when, line, ctx, gen))
        start = min((r[0] for r in rows), default=None)
        requests = []
        for when, line, ctx, gen in sorted(rows, key=lambda r: r[0]):
            n = -(-ctx // bs)
            name = f"request:{line}"
            keys = tuple(space.chain_hash_ids(range(n), cache_salt=name))
            requests.append(TraceRequest((when - start).total_seconds(), name, keys, (BlockType.HISTORY,) * n,
                                         TransitionType.FIRST, ctx, gen, tenant=name))
        return Trace(p.name, self.format, bs, tuple(requests), tuple(problems.lines))
