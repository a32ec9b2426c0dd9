"""The tiers' checksum, and copy/read primitives that compute it on the way.

Why not xxh3 over the payload: on these CPUs xxh3-64 runs at about copy speed, so
a checksummed 4 MiB read cost ~1.6x a plain copy, hashed or not in cache-sized
chunks (measured: benchmarks/RESULTS.md). The checksum here, "fletcher64x4",
costs two vector adds per 32 bytes on registers a copy loads anyway:

- four interleaved Fletcher sums over 64-bit little-endian words: word i goes to
  lane i % 4, where `a += w` and `b += a` (mod 2^64); a tail shorter than 32 bytes
  is zero-padded to one more stripe;
- the digest chains the byte length and a[0..3], b[0..3], each tagged with its
  place, through MurmurHash3's 64-bit finalizer (a bijection): a change confined
  to one sum always changes the digest.

`a` catches any change confined to one word (every single-bit error); `b` weighs
words by position, so swapped or shifted data is caught; a torn write, a zeroed
page or another block's bytes pass with probability ~2^-64. Blind spot of sums
mod 2^64: paired opposite flips of the same high bit in one lane a power-of-two
distance apart. ZFS's default data checksum (fletcher4) is of this family.

The native module (`_copyhash`, built by setup.py from `native/`) fuses the sums
into the copy and into 256 KiB file reads and writes, with the GIL released, and sums
buffers on a thread of its own while the caller moves them (`hash_in_background`). Without
it (no C compiler at install time) numpy computes the same digests, slower. `KERNEL` says which runs: "avx2", "base" (native, no AVX2) or "python".
"""

from __future__ import annotations

import errno
import os

import numpy as np

try:
    from . import _copyhash as _native
except ImportError:  # the optional extension was not built
    _native = None

KERNEL: str = _native.KERNEL if _native is not None else "python"
STRIPE = 32
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def _digest(a: np.ndarray, b: np.ndarray, n: int) -> int:
    """The byte length and the eight sums chained through the finalizer, as `native/kernel.h` does."""
    h = _fmix64((n ^ _GOLDEN) & _M64)
    for place, word in enumerate([*a.tolist(), *b.tolist()], start=1):
        h = _fmix64(h ^ _fmix64((word + _GOLDEN * place) & _M64))
    return h


def _bytes(buf) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def _hash_py(src) -> int:
    data = _bytes(src)
    n = data.nbytes
    whole = n - n % STRIPE
    words = data[:whole].view("<u8").reshape(-1, 4)
    if n % STRIPE:
        last = np.zeros(STRIPE, dtype=np.uint8)
        last[: n - whole] = data[whole:]
        words = np.concatenate([words, last.view("<u8").reshape(1, 4)])
    a = words.sum(axis=0, dtype=np.uint64)
    weights = np.arange(len(words), 0, -1, dtype=np.uint64)  # word k enters b once per stripe from k on
    b = (words * weights[:, None]).sum(axis=0, dtype=np.uint64)
    return _digest(a, b, n)


def _copy_hash_py(dst, src) -> int:
    data = _bytes(src)
    np.copyto(_bytes(dst)[: data.nbytes], data)
    return _hash_py(data)


def _hash_segments_py(segments) -> int:
    return _hash_py(np.concatenate([_bytes(s) for s in segments]) if segments else b"")


def _pread_hash_py(fd: int, dst, offset: int) -> tuple[int, int]:
    view = memoryview(dst).cast("B")
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done, _hash_py(view[:done])


def _pwrite_hash_py(fd: int, src, offset: int) -> tuple[int, int]:
    view = memoryview(src).cast("B")
    done = 0
    while done < view.nbytes:
        wrote = os.pwrite(fd, view[done:], offset + done)
        if wrote == 0:
            raise OSError(errno.EIO, "pwrite_hash: the file took no bytes")
        done += wrote
    return done, _hash_py(view)


class _SumsDone:
    """`hash_in_background`'s job where there is no native thread: the digests are summed when it is made."""

    def __init__(self, buffers) -> None:
        self._digests = [_hash_py(b) for b in buffers]

    def wait(self) -> list[int]:
        return list(self._digests)


hash_bytes = _native.hash if _native is not None else _hash_py
"""hash_bytes(src) -> the fletcher64x4 digest of a contiguous buffer's bytes."""

copy_hash = _native.copy_hash if _native is not None else _copy_hash_py
"""copy_hash(dst, src) -> digest: copies src into the start of dst, summing on the way."""

hash_segments = _native.hash_segments if _native is not None else _hash_segments_py
"""hash_segments(buffers) -> the digest of the buffers' bytes as one buffer, in order: a block that lies
scattered (an engine's pages of it, one per layer) is verified where it landed, never gathered to be summed."""

hash_in_background = _native.hash_in_background if _native is not None else _SumsDone
"""hash_in_background(buffers) -> job; job.wait() -> their digests, in order. The native job sums on a thread of
its own that never takes the GIL, so the caller goes on (a transfer of the same bytes) and pays no hand-off;
the buffers stay held until `wait`. Without the native module the sums are done before it returns."""

pread_hash = _native.pread_hash if _native is not None else _pread_hash_py
"""pread_hash(fd, dst, offset) -> (bytes read, digest of them); OSError on a read error."""

pwrite_hash = _native.pwrite_hash if _native is not None else _pwrite_hash_py
"""pwrite_hash(fd, src, offset) -> (bytes written, digest of src): each 256 KiB summed right before its write,
while it is in cache; OSError on a write error (how much of the file was written is then unknown)."""


def tensor_hashes(views) -> list[int]:
    """The digests of flat uint8 tensors, summed where they lie (on a GPU for device memory): eight sums per
    block come back, never the bytes.

    Why: a block landed in device memory (a DMA from a host pool, a NIXL read into registered
    VRAM) is verified there; summing it on the host would cost the copy it saved, and the
    host's cores sum far slower than the device reads. Blocks of one length are summed together,
    a few kernels per TENSOR_HASH_BATCH bytes. The sums are `hash_bytes`'s: int64 arithmetic
    wraps as the kernels' uint64 sums do.
    """
    import torch

    out: list[int | None] = [None] * len(views)
    groups: dict[tuple, list[int]] = {}
    for i, view in enumerate(views):
        groups.setdefault((view.numel(), view.device), []).append(i)
    for (n, device), members in groups.items():
        per_batch = max(1, TENSOR_HASH_BATCH // max(n, 1))
        for lo in range(0, len(members), per_batch):
            part = members[lo : lo + per_batch]
            rows = torch.stack([views[i] for i in part])  # [b, n]: one copy at the device's bandwidth
            if n % STRIPE:
                rows = torch.nn.functional.pad(rows, (0, STRIPE - n % STRIPE))
            words = rows.view(torch.int64).view(len(part), -1, 4)  # [b, m, 4]
            weights = torch.arange(words.shape[1], 0, -1, dtype=torch.int64, device=device)
            sums = torch.cat([words.sum(dim=1), (words * weights[None, :, None]).sum(dim=1)], dim=1)
            for i, row in zip(part, sums.cpu().tolist()):
                unsigned = np.array([x & _M64 for x in row], dtype=np.uint64)
                out[i] = _digest(unsigned[:4], unsigned[4:], n)
    return out  # type: ignore[return-value]


TENSOR_HASH_BATCH = 64 << 20  # bytes summed per batch of blocks (the sums take about twice that on the device)
