"""GPU check (issue 9): the tiers, the NVMe and NIXL paths, serving and sizing on a CUDA device, in one run.

Run it through `benchmarks/gpu_check.sh` (which picks a Python with CUDA torch and
the repo on PYTHONPATH). Every figure sits next to a reference measured in the same
run on the same bytes, and the ratio between them is what the report is about:

- hbm: the hbm backend's block moves between pinned DRAM and HBM vs torch copies;
- nvme: the nvme backend's reads + H2D vs a plain preadv + H2D (and KvikIO, when
  importable), with the I/O path the backend actually took;
- nixl: raw NIXL UCX VRAM<->DRAM vs torch copies, and the repo's rdma backend vs
  the raw NIXL read;
- serving: TTFT for a long prompt whose prefix is in DRAM vs cold prefill, decode
  tokens/s vs the bare model, greedy output with and without the cache;
- sizing: the sizing engine's bytes vs the CUDA allocator's delta for the cache.

Each section has its own time budget and records its own failure; one JSON report.
`--dry-run` runs the same code on the CPU with a tiny model, every figure labelled
as not a GPU result. `--fetch-wheels DIR` (on a machine with a registry) fills
DIR with the wheels the GPU image lacks.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and ("--dry-run" in sys.argv or os.environ.get("GPU_CHECK_DRY") == "1"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a dry run is a CPU run, even on a GPU machine
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would bury the summary

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import mmap
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

DRY_LABEL = "cpu (dry run, not a GPU result)"
GOAL = 0.8  # backend / reference throughput the tiers aim for
SECTIONS = ("hbm", "nvme", "nixl", "serving", "sizing")
REPO = Path(__file__).resolve().parents[1]
ALIGN = 4096  # O_DIRECT buffer alignment
GPU_WHEELS = [  # what the GPU image (python 3.12, torch cu130) lacks; KINDS.md lists what it has
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "nixl==1.5.1", "nixl-cu13==1.5.1",
]
KVIKIO_WHEELS = ["kvikio-cu13==26.10.0", "libkvikio-cu13==26.10.0", "rapids-logger==0.3.0"]


class Skip(Exception):
    """A part that cannot run here: reported with its reason, never a crash."""


class OutOfTime(Exception):
    """A section ran past its budget; what it measured so far stays in the report."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run: real ones on a GPU, tiny ones for the dry run."""

    dry: bool
    device: str  # torch device of HBM, the model and its cache
    label: str  # goes on every figure
    model: str
    dtype: str
    block_tokens: int
    blocks: int  # blocks per batch in the tier moves
    repeat: int
    prompt_tokens: int
    prefix_tokens: int  # of the prompt, in DRAM before the timed request
    decode_tokens: int
    requests: int  # timed cold/warm request pairs
    sizing_tokens: tuple[int, int]
    budgets: dict[str, float]


def full_plan(label: str) -> Plan:
    return Plan(False, "cuda", label, "llama-3.1-8b", "bf16", 16, 128, 5, 2048, 1984, 64, 3, (1024, 4096),
                {"hbm": 40, "nvme": 60, "nixl": 60, "serving": 240, "sizing": 60})


def dry_plan() -> Plan:
    return Plan(True, "cpu", DRY_LABEL, "kvcluster-tiny-llama", "bf16", 16, 16, 2, 256, 192, 8, 2, (64, 160),
                {"hbm": 30, "nvme": 30, "nixl": 30, "serving": 120, "sizing": 30})


# ---- timing --------------------------------------------------------------------------------------------


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def best_s(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    """Fastest of `repeat` timed runs after one untimed warm-up (setup runs untimed before each)."""
    times = []
    for i in range(repeat + 1):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def versus(seconds: float, ref_seconds: float, nbytes: int, ref: str) -> dict:
    """A backend's throughput next to its same-run reference on the same bytes."""
    ratio = ref_seconds / seconds
    return {"gbps": round(nbytes / seconds / 1e9, 3), "ref": ref, "ref_gbps": round(nbytes / ref_seconds / 1e9, 3),
            "ratio": round(ratio, 3), "goal": GOAL, "meets_goal": ratio >= GOAL}


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in this (main) thread after `seconds`, between Python steps."""
    def on_alarm(signum, frame):  # noqa: ARG001
        raise OutOfTime(f"ran past its {seconds:.0f} s budget")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- buffers and keys ----------------------------------------------------------------------------------


def host_blocks(n: int, block: int, seed: int | None = None) -> torch.Tensor:
    """`n` blocks of host memory, pinned where CUDA is (the DRAM tier's kind of memory)."""
    t = torch.empty((n, block), dtype=torch.uint8, pin_memory=cuda())
    if seed is not None:
        t.numpy()[:] = np.random.default_rng(seed).integers(0, 256, (n, block), dtype=np.uint8)
    return t


def block_keys(tag: str, n: int) -> list:
    from kvcluster.keys import KeySpace

    return KeySpace(model=f"gpu-check-{tag}").chain_hash_ids(list(range(n)), cache_salt=tag)


def block_bytes(plan: Plan) -> int:
    """One block of the served model in the plan's dtype (2 MiB for Llama-3.1-8B in bf16)."""
    from kvcluster.model_spec import load_model_spec
    from kvcluster.storage.layout import layout_for

    return layout_for(load_model_spec(plan.model), plan.block_tokens, plan.dtype).nbytes()


# ---- hbm -----------------------------------------------------------------------------------------------


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


def summary_hbm(s: dict) -> str:
    a, b = s["dram_to_hbm"], s["hbm_to_dram"]
    return (f"DRAM->HBM {a['gbps']:.1f} GB/s vs torch {a['ref_gbps']:.1f} ({a['ratio']:.0%}); "
            f"HBM->DRAM {b['gbps']:.1f} vs {b['ref_gbps']:.1f} ({b['ratio']:.0%}); goal {GOAL:.0%}, "
            f"{s['blocks']} x {s['block_bytes'] >> 10} KiB")


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


# ---- nixl ----------------------------------------------------------------------------------------------


class NixlPair:
    """Two in-process NIXL UCX agents: `local` memory (VRAM on a GPU) and a pinned DRAM `remote`."""

    def __init__(self, local: torch.Tensor, remote: torch.Tensor, block: int) -> None:
        from kvcluster.storage.rdma import _agent  # agents as the backends make them (sleeping progress thread)

        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.a = _agent(f"gpu-check-a-{tag}")
        self.b = _agent(f"gpu-check-b-{tag}")
        self.peer, self.local, self.remote = f"gpu-check-b-{tag}", local, remote
        self.a.register_memory(local)
        self.b.register_memory(remote)
        self.a.add_remote_agent(self.b.get_agent_metadata())
        n, vram = local.shape[0], local.is_cuda
        dev_id = local.get_device() if vram else 0
        self.mem = "VRAM" if vram else "DRAM"
        self.local_descs = self.a.get_xfer_descs(
            [(local.data_ptr() + i * block, block, dev_id) for i in range(n)], self.mem)
        self.remote_descs = self.a.get_xfer_descs([(remote.data_ptr() + i * block, block, 0) for i in range(n)], "DRAM")
        self.backend = ""

    def move(self, op: str) -> None:
        """One transfer of the whole batch (WRITE: local -> remote, READ: remote -> local)."""
        h = self.a.initialize_xfer(op, self.local_descs, self.remote_descs, self.peer)
        try:
            state = self.a.transfer(h)
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"NIXL {op} failed")
                state = self.a.check_xfer_state(h)
            if not self.backend:
                with contextlib.suppress(Exception):
                    self.backend = str(self.a.query_xfer_backend(h))
        finally:
            self.a.release_xfer_handle(h)


def section_nixl(plan: Plan, out: dict) -> None:
    """Raw NIXL UCX VRAM<->DRAM vs torch copies; the repo's rdma backend + H2D vs the raw NIXL read."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"nixl not importable ({type(exc).__name__}: {exc}); carry its wheels, see gpu_check.sh") from None
    n, block = plan.blocks, block_bytes(plan)
    local = torch.empty((n, block), dtype=torch.uint8, device=plan.device)
    out.update(block_bytes=block, blocks=n, batch_bytes=n * block, local_mem="VRAM" if local.is_cuda else "DRAM",
               remote_mem="DRAM (pinned)" if cuda() else "DRAM", ucx_tls=os.environ.get("UCX_TLS", "(default)"))
    try:
        raw_read_s, failure = raw_nixl(plan, out, local, block), None
    except Exception as exc:  # noqa: BLE001 - the rdma backend below still runs, against torch copies
        raw_read_s, failure = None, exc
    try:
        out["rdma_backend_to_hbm"] = rdma_backend_read(plan, local, n, block, raw_read_s)
    except Exception as exc:  # noqa: BLE001 - with both broken, the raw NIXL error is the section's
        if failure is None:
            raise
        out["rdma_backend_to_hbm"] = {"error": f"{type(exc).__name__}: {exc}"}
    if failure is not None:
        raise failure


def raw_nixl(plan: Plan, out: dict, local: torch.Tensor, block: int) -> float:
    """NIXL WRITE/READ of the batch between `local` and pinned DRAM vs torch copies; returns the READ time."""
    n, r = local.shape[0], plan.repeat
    nbytes = n * block
    remote = host_blocks(n, block)
    pair = NixlPair(local, remote, block)
    local.copy_(torch.from_numpy(np.random.default_rng(3).integers(0, 256, (n, block), dtype=np.uint8)))
    pair.move("WRITE")
    verified = torch.equal(remote, local.cpu())
    remote.numpy()[:] = np.random.default_rng(4).integers(0, 256, (n, block), dtype=np.uint8)
    pair.move("READ")
    out["bytes_verified"] = verified and torch.equal(local.cpu(), remote)
    write_s, read_s = best_s(lambda: pair.move("WRITE"), r), best_s(lambda: pair.move("READ"), r)
    out["nixl_backend"] = pair.backend or "UCX"
    ref_w = best_s(lambda: [remote[i].copy_(local[i], non_blocking=True) for i in range(n)], r)
    ref_r = best_s(lambda: [local[i].copy_(remote[i], non_blocking=True) for i in range(n)], r)
    out["write_to_dram"] = versus(write_s, ref_w, nbytes, f"torch copy_ per block, {pair.mem} -> DRAM")
    out["read_from_dram"] = versus(read_s, ref_r, nbytes, f"torch copy_ per block, DRAM -> {pair.mem}")
    return read_s


def rdma_backend_read(plan: Plan, dev: torch.Tensor, n: int, block: int, raw_read_s: float | None) -> dict:
    """What the repo does for a peer's block: rdma get_many (NIXL DRAM->DRAM, checksum) then H2D.

    Its reference is the raw NIXL read into `dev`; where that failed, one torch copy per block into `dev`.
    """
    from kvcluster.storage import NixlPeerPool, RDMABackend

    pool = NixlPeerPool(n, block)
    client = RDMABackend(pool, n * block, n)
    src, dst = host_blocks(n, block, seed=5), host_blocks(n, block)
    keys = block_keys("rdma", n)
    assert all(client.put_many([(k, src.numpy()[i]) for i, k in enumerate(keys)])), "rdma put failed"
    rows = [dst.numpy()[i] for i in range(n)]

    def read() -> None:
        client.get_many(keys, rows)
        dev.copy_(dst, non_blocking=True)

    seconds = best_s(read, plan.repeat)
    ok = bool(np.array_equal(dst.numpy(), src.numpy()))
    ref = f"raw NIXL READ {'pinned DRAM -> VRAM' if dev.is_cuda else 'DRAM -> DRAM'} (above)"
    if raw_read_s is None:
        ref, raw_read_s = "torch copy_ per block into the same buffer (the raw NIXL read failed)", best_s(
            lambda: [dev[i].copy_(src[i], non_blocking=True) for i in range(n)], plan.repeat)
    return versus(seconds, raw_read_s, n * block, ref) | {"medium": client.medium, "bytes_verified": ok}


def summary_nixl(s: dict) -> str:
    mem, w, r, b = s["local_mem"], s["write_to_dram"], s["read_from_dram"], s["rdma_backend_to_hbm"]
    return (f"NIXL {mem}->DRAM {w['gbps']:.1f} GB/s vs torch {w['ref_gbps']:.1f} ({w['ratio']:.0%}); "
            f"DRAM->{mem} {r['gbps']:.1f} vs {r['ref_gbps']:.1f} ({r['ratio']:.0%}); "
            f"rdma backend+H2D {b['gbps']:.2f} vs raw NIXL read ({b['ratio']:.0%})")


# ---- the served model ----------------------------------------------------------------------------------


class RunnerModel:
    """The model as the runner calls it, on any device and transformers version.

    The runner passes CPU input ids and `cache=` (transformers 5.24); this moves the
    ids to the model's device and names the cache argument the installed
    transformers takes (`past_key_values` in 5.17, where `cache=` would be
    swallowed by **kwargs and the restored prefix silently ignored).
    """

    def __init__(self, model: Any, device: str) -> None:
        self.model, self.device = model, torch.device(device)
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = next((k for k in ("cache", "past_key_values") if k in params), None)
        if self.cache_kwarg is None:
            raise RuntimeError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=")

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        if "cache" in kwargs and self.cache_kwarg != "cache":  # the runner itself already names it right
            kwargs[self.cache_kwarg] = kwargs.pop("cache")
        return self.model(input_ids=input_ids.to(self.device), **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (copies, pickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)


_MODEL: dict[str, Any] = {}


def served_model(plan: Plan) -> tuple[Any, dict]:
    """The plan's model, built once on its device with seeded random weights (a failure is kept, not retried)."""
    if "error" in _MODEL:
        raise RuntimeError(f"the model could not be built earlier: {_MODEL['error']}")
    if "loaded" not in _MODEL:
        import transformers

        from kvcluster.serving.models import load_model

        t0 = time.perf_counter()
        try:
            loaded = load_model(plan.model, dtype=plan.dtype, seed=0, device=plan.device)
        except Exception as exc:
            _MODEL["error"] = f"{type(exc).__name__}: {exc}"
            raise
        sync()
        view = RunnerModel(loaded.model, plan.device)
        weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        _MODEL["loaded"] = dataclasses.replace(loaded, model=view)
        _MODEL["info"] = {"model": plan.model, "dtype": plan.dtype, "build_s": round(time.perf_counter() - t0, 2),
                          "weights_gib": round(weights / 2**30, 2), "transformers": transformers.__version__,
                          "cache_kwarg": view.cache_kwarg,
                          "attn_implementation": getattr(loaded.model.config, "_attn_implementation", "?"),
                          "model_device": str(next(loaded.model.parameters()).device)}
    return _MODEL["loaded"], dict(_MODEL["info"])


def make_runner(loaded: Any, plan: Plan, store: Any):
    """A ModelRunner on the plan's model; it finds the model's device and cache argument itself."""
    from kvcluster.serving.runner import ModelRunner

    runner = ModelRunner(loaded, store, plan.block_tokens)
    if runner.device.type != torch.device(plan.device).type:
        raise RuntimeError(f"the runner sees the model on {runner.device}, the plan wants {plan.device}")
    return runner


def random_tokens(rng: np.random.RandomState, n: int) -> list[int]:
    return [int(t) for t in rng.randint(3, 32000, n)]  # ids every shipped tokenizer and model knows


def timed_request(runner: Any, ids: list[int], params: Any) -> dict:
    """One request through start/step/finish: TTFT (the runner's own clock), decode tokens/s, write-back time."""
    gen = runner.start(ids, params)
    t1 = time.perf_counter()
    while not gen.done:
        runner.step(gen)
    sync()
    t2 = time.perf_counter()
    runner.new_text(gen)
    runner.finish(gen)
    steps = len(gen.output_ids) - 1
    return {"ttft_s": round(gen.ttft_s, 5), "fetch_s": round(gen.fetch_s, 5), "cached_tokens": gen.cached_tokens,
            "decode_tokens_per_s": round(steps / (t2 - t1), 2) if steps else None,
            "write_back_s": round(time.perf_counter() - t2, 4), "stored_blocks": gen.stored_blocks,
            "output_ids": list(gen.output_ids)}


@torch.inference_mode()
def raw_greedy(loaded: Any, ids: list[int], steps: int) -> dict:
    """The bare model with a fresh DynamicCache, greedy: the decode reference, and a third output to compare."""
    from transformers import DynamicCache

    model = loaded.model
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    out = [int(torch.argmax(logits))]
    t1 = time.perf_counter()
    for _ in range(steps - 1):
        logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        out.append(int(torch.argmax(logits)))
    sync()
    t2 = time.perf_counter()
    return {"ttft_s": round(t1 - t0, 5), "decode_tokens_per_s": round((steps - 1) / (t2 - t1), 2) if steps > 1
            else None, "output_ids": out}


@torch.inference_mode()
def first_token_gap(runner: Any, ids: list[int], prefix: int) -> dict:
    """Next-token logits after the restored prefix vs after a full prefill: how far apart the two paths are."""
    model = runner.loaded.model
    payloads = runner.store.fetch(runner.block_keys(ids[:prefix]))
    warm = model(input_ids=torch.tensor([ids[len(payloads) * runner.block_tokens:]]),
                 cache=runner.codec.decode(payloads), use_cache=True).logits[0, -1].float()
    cold = model(input_ids=torch.tensor([ids]), cache=runner.codec.new_cache(), use_cache=True).logits[0, -1].float()
    top2 = torch.topk(cold, 2).values
    return {"max_abs_diff": float((warm - cold).abs().max()), "cold_top1_minus_top2": float(top2[0] - top2[1]),
            "same_argmax": int(torch.argmax(warm)) == int(torch.argmax(cold)), "restored_blocks": len(payloads)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def section_serving(plan: Plan, out: dict) -> None:
    """TTFT with the prompt's prefix in DRAM vs cold prefill, decode tokens/s, greedy equality."""
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.serving.sampling import SamplingParams
    from kvcluster.storage import dram_backend, layout_for
    from kvcluster.storage.tiered import TieredStore

    loaded, info = served_model(plan)
    out.update(info)
    out.update(prompt_tokens=plan.prompt_tokens, prefix_tokens=plan.prefix_tokens, decode_tokens=plan.decode_tokens,
               block_tokens=plan.block_tokens)
    block = layout_for(loaded.spec, plan.block_tokens, plan.dtype).nbytes()
    slots = (plan.prompt_tokens + plan.decode_tokens) // plan.block_tokens * (plan.requests + 2) + 8
    dram = dram_backend(slots, block)
    out["store"] = f"TieredStore([dram]): {slots} x {block >> 10} KiB, {dram.medium}"
    cold, warm = make_runner(loaded, plan, None), make_runner(loaded, plan, LocalBlockStore(TieredStore([dram], block)))
    greedy = SamplingParams(max_tokens=plan.decode_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.RandomState(0)
    prefix = random_tokens(rng, plan.prefix_tokens)
    tails = [random_tokens(rng, plan.prompt_tokens - plan.prefix_tokens) for _ in range(plan.requests + 1)]
    one = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    cold.complete(prefix + tails[0], one)  # warm-up: kernels and allocator at these lengths
    seeded = warm.complete(prefix, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out["prefix_blocks_in_dram"] = seeded.stored_blocks
    runs = []
    for tail in tails[1:]:  # a new tail each time: the cached part is exactly the prefix
        c, w = timed_request(cold, prefix + tail, greedy), timed_request(warm, prefix + tail, greedy)
        runs.append({"cold": c, "warm": w, "greedy_equal": c["output_ids"] == w["output_ids"],
                     "first_divergence": first_divergence(c["output_ids"], w["output_ids"])})
        out["runs"] = runs
    summarise_runs(out, runs, plan)
    ref = raw_greedy(loaded, prefix + tails[1], plan.decode_tokens)
    runner_tps = runs[0]["cold"]["decode_tokens_per_s"]
    out["raw_model_reference"] = {k: v for k, v in ref.items() if k != "output_ids"} | {
        "greedy_equal_to_cold_runner": ref["output_ids"] == runs[0]["cold"]["output_ids"],
        "runner_decode_vs_raw": round(runner_tps / ref["decode_tokens_per_s"], 3)
        if runner_tps and ref["decode_tokens_per_s"] else None}
    out["first_token_logits"] = first_token_gap(warm, prefix + tails[1], plan.prefix_tokens)
    drop_equal_outputs(runs)
    if cuda():
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def summarise_runs(out: dict, runs: list[dict], plan: Plan) -> None:
    """Medians over the timed pairs, and whether every pair's greedy output matched."""
    med = lambda side, key: round(statistics.median(r[side][key] for r in runs), 5)  # noqa: E731
    cold_ttft, warm_ttft = med("cold", "ttft_s"), med("warm", "ttft_s")
    out["ttft_cold_s"], out["ttft_prefix_in_dram_s"] = cold_ttft, warm_ttft
    out["ttft_speedup"] = round(cold_ttft / warm_ttft, 2)
    out["fetch_s"] = med("warm", "fetch_s")
    out["cached_tokens"] = [r["warm"]["cached_tokens"] for r in runs]
    out["prefix_fully_cached"] = all(t == plan.prefix_tokens for t in out["cached_tokens"])
    out["decode_tokens_per_s_cold"], out["decode_tokens_per_s_warm"] = (
        med("cold", "decode_tokens_per_s"), med("warm", "decode_tokens_per_s"))
    out["greedy_equal"] = all(r["greedy_equal"] for r in runs)


def drop_equal_outputs(runs: list[dict]) -> None:
    """The full id lists stay in the report only where cold and warm differ."""
    for r in runs:
        if r["greedy_equal"]:
            r["cold"].pop("output_ids")
            r["warm"].pop("output_ids")


def summary_serving(s: dict) -> str:
    ref = s["raw_model_reference"]
    return (f"{s['model']} {s['dtype']}: TTFT cold {s['ttft_cold_s'] * 1e3:.1f} ms, {s['prefix_tokens']}/"
            f"{s['prompt_tokens']} in DRAM {s['ttft_prefix_in_dram_s'] * 1e3:.1f} ms ({s['ttft_speedup']:.1f}x); "
            f"decode {s['decode_tokens_per_s_cold']:.1f} tok/s vs bare model {ref['decode_tokens_per_s']:.1f} "
            f"({ref['runner_decode_vs_raw']:.0%}); greedy equal: {s['greedy_equal']} "
            f"(cache arg: {s['cache_kwarg']})")


# ---- sizing --------------------------------------------------------------------------------------------


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds (as tests/test_sizing_vs_transformers.py counts them)."""
    total = 0
    for layer in cache.layers:
        for attr in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, attr, None)
            parts = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
    return total


@torch.inference_mode()
def prefill_bytes(loaded: Any, ids: torch.Tensor) -> tuple[int | None, int]:
    """(allocator delta, tensor bytes) of the cache one prefill of `ids` leaves behind."""
    from transformers import DynamicCache

    gc.collect()
    sync()
    before = torch.cuda.memory_allocated() if cuda() else None
    cache = DynamicCache(config=loaded.model.config)
    out = loaded.model(input_ids=ids, cache=cache, use_cache=True)
    del out
    gc.collect()
    sync()
    delta = torch.cuda.memory_allocated() - before if before is not None else None
    tensors = cache_tensor_bytes(cache)
    del cache
    return delta, tensors


def section_sizing(plan: Plan, out: dict) -> None:
    """The sizing engine's bytes for N tokens vs what the allocator holds after a prefill of N tokens."""
    from kvcluster.sizing import size_model

    loaded, info = served_model(plan)
    out.update(model=info["model"], dtype=plan.dtype)
    n1, n2 = plan.sizing_tokens
    ids = torch.tensor([random_tokens(np.random.RandomState(7), n2)])
    prefill_bytes(loaded, ids[:, :n1])  # warm-up: workspaces made on first use are not the cache's
    rows = []
    for n in (n1, n2):
        delta, tensors = prefill_bytes(loaded, ids[:, :n])
        engine = size_model(loaded.spec, dtype=plan.dtype, context=n)
        measured = delta if delta is not None else tensors
        rows.append({"tokens": n, "measured_bytes": measured, "cache_tensor_bytes": tensors,
                     "engine_bytes_per_sequence": engine.bytes_per_sequence,
                     "engine_bytes_per_token_x_tokens": engine.bytes_per_token * n,
                     "measured_over_engine": round(measured / engine.bytes_per_sequence, 4)})
    out["measured_by"] = ("torch.cuda.memory_allocated() delta across the prefill" if cuda()
                          else "sum of the cache's tensor bytes (no CUDA allocator on the CPU)")
    out["rows"] = rows
    engine_bpt = size_model(loaded.spec, dtype=plan.dtype, context=n2).bytes_per_token
    slope = (rows[1]["measured_bytes"] - rows[0]["measured_bytes"]) / (n2 - n1)
    out.update(engine_bytes_per_token=engine_bpt, measured_bytes_per_token=slope,
               slope_over_engine=round(slope / engine_bpt, 4),
               exact=all(r["measured_bytes"] == r["engine_bytes_per_sequence"] for r in rows))


def summary_sizing(s: dict) -> str:
    last = s["rows"][-1]
    return (f"engine {s['engine_bytes_per_token']:,} B/token; measured {s['measured_bytes_per_token']:,.0f} B/token "
            f"({s['slope_over_engine']:.2%}); at {last['tokens']} tokens {last['measured_bytes']:,} B vs engine "
            f"{last['engine_bytes_per_sequence']:,} ({last['measured_over_engine']:.2%})")


# ---- the report ----------------------------------------------------------------------------------------

RUN: dict[str, Callable[[Plan, dict], None]] = {
    "hbm": section_hbm, "nvme": section_nvme, "nixl": section_nixl, "serving": section_serving,
    "sizing": section_sizing}
SUMMARY: dict[str, Callable[[dict], str]] = {
    "hbm": summary_hbm, "nvme": summary_nvme, "nixl": summary_nixl, "serving": summary_serving,
    "sizing": summary_sizing}


def run_section(name: str, plan: Plan) -> dict:
    """One section: its figures, or `skipped` with the reason, or `error` with what broke (the rest still run)."""
    out: dict[str, Any] = {"device": plan.label}
    t0 = time.perf_counter()
    try:
        with time_limit(plan.budgets[name]):
            RUN[name](plan, out)
        out["status"] = "ok"
    except Skip as exc:
        out.update(status="skipped", skipped=str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded, and the next section runs
        hint = " (carry its wheel: benchmarks/gpu_check.sh --help)" if isinstance(exc, ModuleNotFoundError) else ""
        out.update(status="error", error=f"{type(exc).__name__}: {exc}{hint}",
                   traceback=traceback.format_exc().strip().splitlines()[-8:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    label_figures(out, plan.label)
    return out


def label_figures(node: Any, label: str) -> None:
    """Every dict holding a figure names the device it was measured on."""
    if isinstance(node, dict):
        if any(isinstance(v, float) for v in node.values()):
            node.setdefault("device", label)
        for v in node.values():
            label_figures(v, label)
    elif isinstance(node, list):
        for v in node:
            label_figures(v, label)


def environment(plan: Plan) -> dict:
    import transformers

    env = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
           "wheels_installed": os.environ.get("GPU_CHECK_WHEELS_INSTALLED", "").split(), "dry_run": plan.dry}
    if cuda():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    return env


def report_path(arg: str | None) -> Path:
    if arg or os.environ.get("GPU_CHECK_JSON"):
        return Path(arg or os.environ["GPU_CHECK_JSON"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return REPO / "benchmarks" / "gpu_check.json"


def write(report: dict, path: Path) -> None:
    """Rewritten after every section, so a run stopped from outside still leaves what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def summary_line(name: str, s: dict) -> str:
    if s["status"] == "skipped":
        return f"{name:8} skipped: {s['skipped']}"
    if s["status"] == "error":
        return f"{name:8} ERROR: {s['error'][:300]}"
    try:
        return f"{name:8} {SUMMARY[name](s)}"
    except Exception as exc:  # noqa: BLE001 - a missing figure must not hide the others
        return f"{name:8} ok (summary unavailable: {type(exc).__name__}: {exc})"


def fetch_wheels(directory: Path, kvikio: bool) -> int:
    """On a machine with a registry: the GPU image's missing wheels, big ones recompressed to fit the carry limit."""
    directory.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                             "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "-d", str(directory), *GPU_WHEELS, *(KVIKIO_WHEELS if kvikio else [])]
    if subprocess.call(cmd):
        return 1
    for wheel in directory.glob("*.whl"):
        if wheel.stat().st_size > 4 << 20:
            recompress(wheel)
    total = sum(w.stat().st_size for w in directory.glob("*.whl"))
    print(f"gpu_check: {len(list(directory.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {directory}")
    return 0


def recompress(wheel: Path) -> None:
    """Rewrite a wheel with LZMA (pip reads it; 56 -> 33 MiB for nixl-cu13): the device carry limit is 64 MiB."""
    tmp = wheel.with_suffix(".lzma")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_LZMA)
    tmp.replace(wheel)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: keeps the code from rotting")
    parser.add_argument("--out", help="report path (default: $GPU_CHECK_JSON, $OUT/gpu_check.json, "
                                      "benchmarks/gpu_check.json)")
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    parser.add_argument("--fetch-wheels", metavar="DIR", help="download the wheels the GPU image lacks into DIR")
    parser.add_argument("--with-kvikio", action="store_true", help="with --fetch-wheels: KvikIO too (~4 MiB)")
    args = parser.parse_args()
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels), args.with_kvikio)
    dry = args.dry_run or os.environ.get("GPU_CHECK_DRY") == "1"
    try:
        import kvcluster  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - cannot start: say why in one line
        print(f"gpu_check: cannot import kvcluster ({type(exc).__name__}: {exc}); is the repo on PYTHONPATH?")
        return 2
    if not dry and not cuda():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check")
        return 0
    plan = dry_plan() if dry else full_plan(torch.cuda.get_device_name(0))
    path = report_path(args.out)
    names = [s for s in (args.only.split(",") if args.only else SECTIONS) if s in RUN]
    t0 = time.perf_counter()
    report: dict[str, Any] = {"check": "gpu_check (issue 9)", "device": plan.label,
                              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "environment": environment(plan), "plan": dataclasses.asdict(plan), "sections": {}}
    print(f"gpu_check on {plan.label}: torch {torch.__version__}, transformers {report['environment']['transformers']}"
          f" -> {path}", flush=True)
    for name in names:
        report["sections"][name] = section = run_section(name, plan)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        write(report, path)
        print(summary_line(name, section), flush=True)
    print(f"gpu_check: {sum(s['status'] == 'ok' for s in report['sections'].values())}/{len(names)} sections ok "
          f"in {report['total_s']} s; report {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
