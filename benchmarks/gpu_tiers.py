"""GPU check sections hbm and nvme: the tier backends' block moves against torch copies and plain preadv."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gpu_common import GOAL, Plan, best_s, block_bytes, block_keys, cuda, host_blocks, versus

ALIGN = 4096  # O_DIRECT buffer alignment


def section_hbm(plan: Plan, out: dict) -> None:
    """hbm backend moves from / to pinned DRAM vs one torch copy per block (and one bulk copy)."""
    from kvcluster.storage import dram_backend, hbm_backend

    n, block = plan.blocks, block_bytes(plan)
    nbytes, r = n * block, plan.repeat
    hbm, dram = hbm_backend(n, block), dram_backend(n, block)
    out.update(block_bytes=block, blocks=n, batch_bytes=nbytes, hbm_medium=hbm.medium, dram_medium=dram.medium)
    src, dst = host_blocks(n, block, seed=1), host_blocks(n, block)
    keys = block_keys("hbm", n)
    items = [(k, src.numpy()[i]) for i, k in enumerate(keys)]
    rows = [dst.numpy()[i] for i in range(n)]
    put_s = best_s(lambda: hbm.put_many(items), r)
    get_s = best_s(lambda: hbm.get_many(keys, rows), r)
    out["bytes_verified"] = bool(np.array_equal(dst.numpy(), src.numpy()))
    dev = torch.empty((n, block), dtype=torch.uint8, device=plan.device)
    ref_put = best_s(lambda: [dev[i].copy_(src[i], non_blocking=True) for i in range(n)], r)
    ref_get = best_s(lambda: [dst[i].copy_(dev[i], non_blocking=True) for i in range(n)], r)
    bulk_put, bulk_get = best_s(lambda: dev.copy_(src, non_blocking=True), r), best_s(lambda: dst.copy_(dev), r)
    host, there = ("pinned host", "device") if cuda() else ("host", "host (no CUDA)")
    to_hbm, from_hbm = f"torch copy_ per block, {host} -> {there}", f"torch copy_ per block, {there} -> {host}"
    out["dram_to_hbm"] = versus(put_s, ref_put, nbytes, to_hbm) | {
        "bulk_copy_gbps": round(nbytes / bulk_put / 1e9, 3)}
    out["hbm_to_dram"] = versus(get_s, ref_get, nbytes, from_hbm) | {
        "bulk_copy_gbps": round(nbytes / bulk_get / 1e9, 3)}
    dram.put_many(items)
    move_s = best_s(lambda: hbm.put_many(list(zip(keys, dram.get_many(keys)))), r)  # a promotion: verified read + put
    out["dram_tier_to_hbm_tier"] = versus(move_s, ref_put, nbytes, to_hbm)
    tensor_paths(plan, out, hbm, dram, keys, src, dev, ref_put)


def tensor_paths(plan: Plan, out: dict, hbm: Any, dram: Any, keys: list, src: torch.Tensor, dev: torch.Tensor,
                 ref_put: float) -> None:
    """The tiers handed torch tensors: payloads as tensors, `out` rows on the model's device (no host bounce)."""
    n, block = src.shape
    nbytes, r = n * block, plan.repeat
    there = "device" if cuda() else "host (no CUDA)"
    tensor_items = [(k, src[i]) for i, k in enumerate(keys)]
    out["dram_to_hbm_tensors"] = versus(best_s(lambda: hbm.put_many(tensor_items), r), ref_put, nbytes,
                                        f"torch copy_ per block, pinned host -> {there}")
    rows = torch.zeros((n, block), dtype=torch.uint8, device=plan.device)
    hbm_s = best_s(lambda: hbm.read_verified(keys, list(rows)), r)
    spare = torch.empty_like(rows)
    ref_d2d = best_s(lambda: [spare[i].copy_(dev[i], non_blocking=True) for i in range(n)], r)
    out["hbm_to_device_tensor"] = versus(hbm_s, ref_d2d, nbytes, f"torch copy_ per block, {there} -> {there}")
    out["hbm_to_device_bytes_verified"] = bool(torch.equal(rows.cpu(), src))
    rows.zero_()
    got, digests = dram.read_verified(keys, list(rows))
    out["dram_to_device_bytes_verified"] = bool(torch.equal(rows.cpu(), src)) and all(d is not None for d in digests)
    dram_s = best_s(lambda: dram.read_verified(keys, list(rows)), r)
    out["dram_tier_to_device_tensor"] = versus(dram_s, ref_put, nbytes, f"torch copy_ per block, pinned host -> "
                                               f"{there} (unverified)") | {
        "path": "DMA per block from the pinned slots, verified on the device" if cuda() else "verified copy (no CUDA)"}


def summary_hbm(s: dict) -> str:
    a, b = s["dram_to_hbm"], s["hbm_to_dram"]
    return (f"DRAM->HBM {a['gbps']:.1f} GB/s vs torch {a['ref_gbps']:.1f} ({a['ratio']:.0%}); "
            f"HBM->DRAM {b['gbps']:.1f} vs {b['ref_gbps']:.1f} ({b['ratio']:.0%}); goal {GOAL:.0%}, "
            f"{s['blocks']} x {s['block_bytes'] >> 10} KiB; tensors: DRAM->HBM {s['dram_to_hbm_tensors']['ratio']:.0%}, "
            f"HBM->device {s['hbm_to_device_tensor']['ratio']:.0%}, "
            f"DRAM tier->device verified {s['dram_tier_to_device_tensor']['ratio']:.0%}")


# ---- nvme ----------------------------------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The filesystem holding `path` (from /proc/mounts): says whether O_DIRECT and GDS can apply."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def kvikio_state() -> dict:
    """Whether KvikIO imports and whether it would use GDS (compat mode off) or its POSIX fallback."""
    try:
        import kvikio
        import kvikio.defaults as d
    except Exception as exc:  # noqa: BLE001 - any import failure: not available
        return {"importable": False, "reason": f"{type(exc).__name__}: {exc}"}
    state: dict[str, Any] = {"importable": True, "version": getattr(kvikio, "__version__", "?")}
    for name in ("compat_mode", "is_compat_mode_preferred"):
        with contextlib.suppress(Exception):
            state[name] = str(getattr(d, name)())
    preferred = state.get("is_compat_mode_preferred")
    state["gds"] = None if preferred is None else preferred == "False"  # compat mode: POSIX reads inside KvikIO
    return state


def count_calls(module: Any, name: str, fn: Callable[[], Any]) -> int:
    """How often `fn` calls `module.name` (which I/O path a backend really takes)."""
    real, calls = getattr(module, name), [0]

    def spy(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, spy)
    try:
        fn()
    finally:
        setattr(module, name, real)
    return calls[0]


def evict(*fds: int) -> None:
    """Drop the files' pages from the page cache, so reads come from the device."""
    for fd in fds:
        with contextlib.suppress(OSError, AttributeError):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def section_nvme(plan: Plan, out: dict) -> None:
    """nvme backend get + H2D vs a plain preadv of the same bytes + the same H2D; KvikIO file->VRAM if present."""
    from kvcluster.storage import NVMeBackend

    n, block = plan.blocks, block_bytes(plan)
    root = Path(tempfile.mkdtemp(prefix="kvc-gpu-check-", dir=os.environ.get("GPU_CHECK_NVME_DIR")))
    try:
        measure_nvme(plan, out, root, NVMeBackend(root / "nvme", n, block), block)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_nvme(plan: Plan, out: dict, root: Path, nv: Any, block: int) -> None:
    n = plan.blocks
    nbytes, r = n * block, plan.repeat
    out.update(block_bytes=block, blocks=n, batch_bytes=nbytes, dir=str(root.parent), filesystem=fs_type(root),
               medium=nv.medium, o_direct=nv.direct, kvikio=kvikio_state(), kvikio_handle_open=nv.kvikio is not None)
    src, dst = host_blocks(n, block, seed=2), host_blocks(n, block)
    keys = block_keys("nvme", n)
    assert all(nv.put_many([(k, src.numpy()[i]) for i, k in enumerate(keys)])), "nvme put failed"
    rows = [dst.numpy()[i] for i in range(n)]
    preadv = count_calls(os, "preadv", lambda: nv.get_many(keys, rows))
    out["bytes_verified"] = bool(np.array_equal(dst.numpy(), src.numpy()))
    out["io_path_used"] = (f"POSIX os.preadv ({'O_DIRECT' if nv.direct else 'buffered'}) into host memory, then H2D"
                           if preadv >= n else "not os.preadv (KvikIO or another path)")
    out["preadv_calls_per_block"] = preadv / n
    out["medium_matches_io"] = ("kvikio" in nv.medium) == (preadv < n)
    dev = torch.empty((n, block), dtype=torch.uint8, device=plan.device)
    ref_fd, stage = reference_file(root, src, nv.direct, block)
    direct_into_rows = not nv.direct or all(row.ctypes.data % ALIGN == 0 for row in rows)
    h2d = "same H2D of the batch from pinned memory" if cuda() else "copy into a second host buffer (no CUDA)"

    def backend_read() -> None:
        nv.get_many(keys, rows)
        dev.copy_(dst, non_blocking=True)

    def plain_read() -> None:
        for i in range(n):
            if direct_into_rows:
                os.preadv(ref_fd, [rows[i]], i * block)
            else:  # O_DIRECT wants aligned buffers
                os.preadv(ref_fd, [stage[i]], i * block)
                rows[i][:] = np.frombuffer(stage[i], dtype=np.uint8)
        dev.copy_(dst, non_blocking=True)

    setup = lambda: evict(nv.fd, ref_fd)  # noqa: E731
    dst.zero_()
    plain_read()
    out["reference_bytes_verified"] = bool(np.array_equal(dst.numpy(), src.numpy()))
    into = "into the same pinned rows" if direct_into_rows else "into aligned buffers, then copied"
    out["read_to_hbm"] = versus(best_s(backend_read, r, setup), best_s(plain_read, r, setup), nbytes,
                                f"os.preadv per block {into}, same open flags, then the {h2d}")
    out["page_cache_evicted_before_each_read"] = True
    out["kvikio_file_to_vram"] = kvikio_read(root / "reference.bin", dev, nbytes, r, ref_fd)
    os.close(ref_fd)
    nv.close()


def reference_file(root: Path, src: torch.Tensor, direct: bool, block: int) -> tuple[int, list]:
    """The batch written as one plain file with the backend's open flags; its read buffers (aligned for O_DIRECT)."""
    n = src.shape[0]
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(root / "reference.bin", flags, 0o600)
    bufs = [mmap.mmap(-1, block) for _ in range(n)]
    for i, buf in enumerate(bufs):
        buf[:] = src.numpy()[i].tobytes()
        os.pwrite(fd, buf, i * block)
    return fd, bufs


def kvikio_read(path: Path, dev: torch.Tensor, nbytes: int, repeat: int, fd: int) -> dict:
    """KvikIO straight from the file into device memory (GDS, or its compat fallback): the best a GPU path does."""
    state = kvikio_state()
    if not state["importable"]:
        return {"skipped": f"kvikio not importable ({state['reason']})"}
    if not cuda():
        return {"skipped": "no CUDA device: KvikIO reads into device memory"}
    import kvikio

    f = kvikio.CuFile(str(path), "r")
    try:
        seconds = best_s(lambda: f.pread(dev, nbytes, 0).get(), repeat, lambda: evict(fd))
    finally:
        f.close()
    return {"gbps": round(nbytes / seconds / 1e9, 3), "compat_mode": state.get("compat_mode"), "gds": state["gds"]}


def summary_nvme(s: dict) -> str:
    a, k = s["read_to_hbm"], s.get("kvikio_file_to_vram", {})
    kv = f"KvikIO file->VRAM {k['gbps']:.1f} GB/s (gds {k['gds']})" if "gbps" in k else f"KvikIO: {k.get('skipped')}"
    return (f"read+H2D {a['gbps']:.2f} GB/s vs preadv+H2D {a['ref_gbps']:.2f} ({a['ratio']:.0%}); "
            f"path: {s['io_path_used']} on {s['filesystem']}; {kv}")
