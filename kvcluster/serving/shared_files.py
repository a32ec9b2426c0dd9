"""The cluster's shared filesystem as every engine reaches it: written behind, read when no node's memory has it.

Why engines touch the files themselves: a block file is named by its key alone (`PFSBackend`), written to a
temp name and renamed whole, so any number of engines on any nodes may write and read one directory with no
owner in between, and no KV byte passes through a control actor. Each block an engine stores goes there behind
the request (its saver thread), so what a node held outlives the node: a session that moves after its node died
finds its history here. A read verifies each block's checksum; a missing or corrupt file ends the run (a miss,
recomputed), never wrong bytes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..keys import BlockKey
from ..storage.pfs import PFSBackend


class SharedFiles:
    def __init__(self, backend: PFSBackend) -> None:
        self.backend = backend
        self.counters = {"written": 0, "refused": 0, "read": 0}

    def prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` are on file (one stat each, up to the first missing)."""
        n = 0
        for key in keys:
            if not self.backend.contains([key])[0]:
                break
            n += 1
        return n

    def read(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The leading run of `keys` read from file and verified (into `out[i]` where given)."""
        n = self.prefix(keys)
        if n == 0:
            return []
        got = self.backend.get_many(list(keys[:n]), None if out is None else list(out[:n]))
        run = []
        for payload in got:
            if payload is None:
                break
            run.append(payload)
        self.counters["read"] += len(run)
        return run

    def write(self, blocks: dict[bytes, np.ndarray]) -> int:
        """Put `blocks` on file (those already there cost a stat); returns how many are on file now."""
        if not blocks:
            return 0
        ok = self.backend.put_many([(key, payload) for key, payload in blocks.items()])
        self.counters["written"] += sum(ok)
        self.counters["refused"] += len(ok) - sum(ok)
        return sum(ok)

    def stats(self) -> dict:
        return {**self.counters, "used_bytes": self.backend.used_bytes, "capacity_bytes": self.backend.capacity_bytes}
