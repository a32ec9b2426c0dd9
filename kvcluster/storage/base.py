"""The contract of every tier backend: batched, checksummed, misses instead of errors.

A backend stores opaque block payloads (bytes) under `BlockKey`s. Calls take and
return whole batches: the request path makes one call per tier, never one per
block. A payload that is missing, truncated or fails its checksum comes back as
None (a miss; the caller recomputes) and is dropped from the backend. A put that
cannot be stored (no space, I/O error) returns False for that key and leaves it a
miss; nothing half-written is ever served.
"""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

from ..errors import KvclusterError
from ..keys import BlockKey
from .copyhash import hash_bytes

Payload = "bytes | bytearray | memoryview | np.ndarray | torch.Tensor"  # for annotations


def tensor_type() -> type | tuple:
    """torch.Tensor once torch is loaded, else () (no isinstance matches it): no tensor exists before torch is
    imported, so a payload check need not import it. torch may be half imported by another thread (it is listed
    in sys.modules from the start of its import, its names come later): until `Tensor` is defined, no tensor
    exists either."""
    return getattr(sys.modules.get("torch"), "Tensor", ())


log = logging.getLogger("kvcluster.storage")


class StorageError(KvclusterError):
    """A backend cannot be set up (unwritable directory, no space for its slab, bad size)."""


class PeerUnavailable(StorageError):
    """A peer pool's owner cannot be reached (its node left, its actor is restarting).

    Here, not beside the NIXL backend that raises it: the control channel's client catches and raises
    it in processes that never load NIXL or torch (a file tier's actor)."""


def host_bytes(data: Payload) -> np.ndarray:
    """A payload's bytes as a flat uint8 numpy array: a view of host memory (CPU tensors too), a copy of a device
    tensor's bytes.

    Why the copy: a file or a peer's pool is written from host memory (no GPUDirect path here),
    so a block on a device is staged once; the memory pools take device tensors as they are."""
    if isinstance(data, tensor_type()):
        if not data.is_contiguous():
            raise ValueError(f"a tensor payload must be contiguous (shape {tuple(data.shape)})")
        flat = data.reshape(-1).view(sys.modules["torch"].uint8)
        return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def host_out(out: Sequence | None, tier: str) -> list[np.ndarray] | None:
    """`out` buffers as numpy views of host memory (CPU tensors accepted); a device tensor is refused.

    Why refused rather than staged: a tier that reads into host memory would need a second
    buffer and a second copy the caller cannot see; reading into pinned host memory and
    copying that to the device (as the runner and the vLLM connector do) costs the same, once."""
    if out is None:
        return None
    views, tensor = [], tensor_type()
    for buf in out:
        if isinstance(buf, tensor):
            if buf.device.type != "cpu":
                raise ValueError(f"{tier}: reads into host buffers, not {buf.device} tensors")
            buf = buf.reshape(-1).view(sys.modules["torch"].uint8).numpy()
        views.append(buf)
    return views


def checksum(data: Payload) -> int:
    """The fletcher64x4 digest of a payload's bytes (see `copyhash`): cheap enough for every lower-tier read.

    Backends that copy or read a payload anyway get the same digest from `copyhash` on the way.
    """
    return hash_bytes(host_bytes(data))


def given_digests(digests: Sequence[int | None] | None, n: int) -> list[int | None]:
    """The verified digests a caller passed to `put_many`, one per item (None where it knows none)."""
    if digests is None:
        return [None] * n
    if len(digests) != n:
        raise ValueError(f"put_many: {len(digests)} digests for {n} items")
    return list(digests)


@dataclass
class BackendStats:
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    digest_mismatches: int = 0  # puts refused: the payload's sum differed from the digest it came with
    deletes: int = 0
    extra: dict = field(default_factory=dict)


class StorageBackend(ABC):
    """One tier's bytes."""

    name: str
    medium: str  # what actually holds the bytes here, e.g. "posix-odirect file", "DRAM (emulated CXL)"
    emulated: bool = False  # True when a stand-in replaces the real medium
    device_buffers: bool = False  # read_verified fills `out` tensors on a device (else: host buffers only)
    _stats: BackendStats

    def _dropped_corrupt(self, key: BlockKey, reason: str) -> None:
        """Count and log one block that failed its read (it is dropped, so each is logged once).

        Why a log line each: a corrupt read is a miss to the caller, so nothing else would ever
        show which tier lost which block, and why."""
        self._stats.corrupt += 1
        log.warning("%s: block %s read as corrupt and dropped (%s)", self.name, bytes(key).hex(), reason)

    @abstractmethod
    def put_many(self, items: Sequence[tuple[BlockKey, Payload]],
                 digests: Sequence[int | None] | None = None) -> list[bool]:
        """Store blocks; True where stored. `digests[i]`, where given, is item i's checksum as verified by the
        tier it was just read from (a demotion, see `read_verified`).

        Why: the digest travels with the bytes, end to end, as ZFS's block pointers carry theirs.
        A True is what lets a mover drop its source copy, so it must mean "these verified bytes are
        here": a backend compares the sum of what it stores (summed in its copy, or on another core
        while a file is written in place) with the given digest and refuses a payload that changed
        since it was verified. Only a DMA-style write from registered memory, which would need a
        pass of its own, stores the given digest unchecked; a payload that changed is then caught by
        the read that verifies it: a miss, never wrong KV.
        """

    def get_many(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray | None]:
        """Payloads (into `out[i]` when given, else new arrays), None for a miss."""
        return self.read_verified(keys, out)[0]

    @abstractmethod
    def read_verified(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None
                      ) -> tuple[list[np.ndarray | None], list[int | None]]:
        """`get_many`'s payloads, and the digest each was verified against (None: a miss, or a tier that
        does not verify, such as HBM): what a demotion hands `put_many(..., digests)` of the tier below."""

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...


class SlottedBackend(StorageBackend):
    """Shared bookkeeping of backends built on a `SlotTable` (the memory pools, the nvme slab)."""

    table: "SlotTable"  # noqa: F821 - set by subclasses
    slot_bytes: int
    _stats: BackendStats

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self.table for key in keys]

    def keys(self) -> list[BlockKey]:
        """Every block held (a control plane that restarts rebuilds its bookkeeping from these)."""
        return self.table.keys()

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = sum(self.table.release(key) for key in keys)
        self._stats.deletes += n
        return n

    @property
    def used_bytes(self) -> int:
        return len(self.table) * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.table.slots * self.slot_bytes

    def stats(self) -> dict:
        return {"name": self.name, "medium": self.medium, "emulated": self.emulated, "blocks": len(self.table),
                "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes, **self._stats.__dict__}
