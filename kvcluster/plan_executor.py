"""Carry out a `StorePlan` over any data plane, in three batched rounds.

1. Read every moving block the caller does not already hold, one batch per source tier.
2. Delete every block from the tier it leaves, one batch per tier: this makes the room
   the policy counted on, so a write never meets a full tier.
3. Write every block into the tier it lands in, one batch per tier, with the digest
   the source verified (the destination stores it instead of summing the bytes again).

Between rounds 2 and 3 a moving block exists only in the executor's hands; that is
the window in which it is "in flight". A block whose source read fails or whose
write is refused is reported back, and the manager drops it: a miss, never a block
the index claims and no tier holds.

`TierIO` is the data plane: `BackendTierIO` binds storage backends in this process
(a replica's own tiers); the cluster binds tier actors (`kvcluster.actors`), whose
per-tier calls it issues concurrently.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import sys

import numpy as np

from .cache_manager import StorePlan
from .storage.base import StorageBackend, tensor_type

Held = Mapping[bytes, tuple[np.ndarray, int | None]]  # key -> (payload, verified digest or None)


class TierIO(Protocol):
    def read(self, keys: Mapping[int, list[bytes]], out: Mapping[int, list[np.ndarray]] | None = None
             ) -> dict[int, tuple[list[np.ndarray | None], list[int | None]]]:
        """Per tier: payloads (None when missing or corrupt) and the digests verified on the way;
        `out[tier][j]`, when given, is a buffer the j-th payload may be read into."""

    def delete(self, keys: Mapping[int, list[bytes]]) -> None: ...

    def write(self, items: Mapping[int, tuple[list[bytes], list[np.ndarray], list[int | None]]]
              ) -> dict[int, list[bool]]: ...


def execute(plan: StorePlan, io: TierIO, held: Held) -> list[bytes]:
    """Run `plan`; `held`: bytes the caller has (blocks it just read or computed). Returns the keys
    that did not reach their destination."""
    carried: dict[bytes, tuple[np.ndarray, int | None]] = {}
    reads = {tier: [k for k in keys if k not in held] for tier, keys in plan.by_source().items()}
    reads = {tier: keys for tier, keys in reads.items() if keys}
    if reads:
        for tier, (payloads, digests) in io.read(reads).items():
            for key, payload, digest in zip(reads[tier], payloads, digests):
                if payload is not None:
                    carried[key] = (payload, digest)
    deletes = plan.deletes()
    if deletes:
        io.delete(deletes)
    failed: list[bytes] = []
    writes: dict[int, tuple[list[bytes], list[np.ndarray], list[int | None]]] = {}
    for tier, moves in plan.writes().items():
        keys, payloads, digests = [], [], []
        for m in moves:
            got = held.get(m.key) or carried.get(m.key)
            if got is None:  # its source could not be read: it is lost, not moved
                failed.append(m.key)
                continue
            keys.append(m.key)
            payloads.append(got[0])
            digests.append(got[1])
        if keys:
            writes[tier] = (keys, payloads, digests)
    if writes:
        for tier, ok in io.write(writes).items():
            failed.extend(k for k, good in zip(writes[tier][0], ok) if not good)
    return failed


class BackendTierIO:
    """Storage backends in this process, one per tier index."""

    def __init__(self, backends: Sequence[StorageBackend]) -> None:
        self.backends = list(backends)

    def read(self, keys, out=None):
        return {tier: self._read(self.backends[tier], ks, None if out is None else out[tier])
                for tier, ks in keys.items()}

    @staticmethod
    def _read(backend: StorageBackend, keys, out):
        """A tier's verified read into `out`; device buffers a tier cannot fill (files, a peer's pool) are
        filled from its host copies, once those were verified."""
        if out is None or backend.device_buffers or not any(_on_device(b) for b in out):
            return backend.read_verified(keys, out)
        payloads, digests = backend.read_verified(keys, None)
        placed = []
        for payload, buf in zip(payloads, out):
            if payload is None:
                placed.append(None)
                continue
            if _on_device(buf):
                torch = sys.modules["torch"]  # loaded: `buf` is one of its tensors
                view = buf.reshape(-1).view(torch.uint8)[: payload.nbytes]
                view.copy_(torch.from_numpy(np.asarray(payload)))
            else:
                view = np.asarray(buf).reshape(-1)[: payload.nbytes]
                np.copyto(view, payload)
            placed.append(view)
        return placed, digests

    def delete(self, keys) -> None:
        for tier, ks in keys.items():
            self.backends[tier].delete(ks)

    def write(self, items):
        return {tier: self.backends[tier].put_many(list(zip(ks, ps)), ds) for tier, (ks, ps, ds) in items.items()}


def _on_device(buf) -> bool:
    return isinstance(buf, tensor_type()) and buf.device.type != "cpu"
