"""Put/get bandwidth of every tier backend against a raw reference of the same bytes, same run.

References: numpy copy (hbm/dram/cxl), raw os.pwrite / os.preadv on the same
directory (nvme), plain file write+read (pfs), one raw NIXL transfer between the
same two agents and memory (rdma). pfs and rdma puts also face their reference with
each block summed first (`*_vs_summed_ref`): such a put must sum what it stores (a
pfs trailer, an rdma commit holds the digest a read verifies); the raw reference does not.
Two kinds of put: "put", a new block whose digest the backend sums itself, and
"demote", a block handed down with the digest the tier above verified when it
read it (`put_many(items, digests)`): how every tier below the top receives
blocks in the hierarchy (`TieredStore`), and what the payload rows here stand for.
Goal: every backend >= 80% of its reference at >= 4 MiB batches. Backend and
reference run in alternation, best of `--repeat` rounds each, in each of `--trials`
fresh allocations; the median trial is reported (and every trial's ratio in --json).

    .venv/bin/python benchmarks/tier_bandwidth.py [--json] [--dir DIR] [--repeat 5] [--trials 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from harness import Case, JsonOutput, best_interleaved

from kvcluster.cli import positive_int
from kvcluster.keys import KeySpace
from kvcluster.storage import (NixlPeerPool, NVMeBackend, PFSBackend, RDMABackend, checksum, cxl_backend, dram_backend,
                               hbm_backend)
from kvcluster.storage.aligned import aligned_empty, aligned_host_tensor
from kvcluster.tiers import TIER_ORDER

MAX_BLOCK = 2 << 20  # one 16-token block of Llama-3.1-8B in bf16: 32 layers x 2 x 8 heads x 16 x 128 x 2 B
BATCHES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
BACKENDS = TIER_ORDER  # every tier kind (kvcluster.tiers), fastest first
# opt-in: rdma with payloads and landing buffers outside registered memory (RdmaTierActor's puts and gets, whose
# payloads come from and go to the Ray object store): the staging copy's price against the same raw transfer
EXTRA = ("rdma-staged",)
BLOCK = MAX_BLOCK  # set per batch: min(batch, MAX_BLOCK)


def ref_copy(blocks: list[np.ndarray], out: list[np.ndarray]):
    def put():
        for b, o in zip(blocks, out):
            np.copyto(o, b)
    return put, put


def ref_posix(directory: Path, blocks: list[np.ndarray], out: list[np.ndarray], direct: bool):
    """Raw pwrite/preadv with the same open flags the backend got, from and into the same page-aligned rows."""
    path = directory / "reference.bin"
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)

    def put():
        for i, b in enumerate(blocks):
            os.pwrite(fd, b, i * BLOCK)

    def get():
        for i, o in enumerate(out):
            os.preadv(fd, [o], i * BLOCK)
    return put, get


def ref_files(directory: Path, blocks: list[np.ndarray], summed: bool = False):
    """One plain file per block, written new each round (as the backend's puts are: fresh keys).

    With `summed`, each block is summed (`checksum`) right before it is written: the least a file tier
    that must tell a torn or corrupt file from a block has to do, which the plain write leaves out."""
    def put():
        for i, b in enumerate(blocks):
            if summed:
                checksum(b)
            with open(directory / f"ref{i}.bin", "wb") as f:
                f.write(b)

    def clear():
        for i in range(len(blocks)):
            (directory / f"ref{i}.bin").unlink(missing_ok=True)

    out = [np.empty(BLOCK, dtype=np.uint8) for _ in blocks]

    def get():
        for i, o in enumerate(out):
            with open(directory / f"ref{i}.bin", "rb") as f:
                f.readinto(memoryview(o))
    put.setup = clear
    return put, get


def summed_first(put, blocks: list[np.ndarray]):
    """`put` after summing every block (`checksum`): what a put that commits each block's digest must add."""
    def run():
        for b in blocks:
            checksum(b)
        put()
    return run


def ref_nixl(client: RDMABackend, pool: NixlPeerPool, source: torch.Tensor, landing: torch.Tensor, first_slot: int):
    """Raw NIXL transfers of the same bytes between the same two agents and memory as the backend's.

    The client's agent moves `source`'s rows to the pool's slots `first_slot...` (WRITE) and
    back into `landing` (READ): one descriptor list each way, initialize_xfer, transfer, poll,
    release. With `first_slot` 0 these are the slots the backend's blocks hold (a key keeps its
    slot when put again): the same physical memory, whose placement alone moved the ratio by
    up to 2x between runs when the reference had slots of its own. It writes the very bytes
    the blocks hold, so they stay valid (checked after the run).
    """
    agent, peer, base = client.agent, client.peer_name, pool.pool.data_ptr()  # the slab the pool lent the client
    rows, row_bytes = source.shape[0], source.shape[1]
    remote = agent.get_xfer_descs([(base + (first_slot + i) * row_bytes, row_bytes, 0) for i in range(rows)], "DRAM")

    def move(op: str, local_tensor: torch.Tensor):
        local = agent.get_xfer_descs([(local_tensor.data_ptr() + i * row_bytes, row_bytes, 0) for i in range(rows)],
                                     "DRAM")

        def run():
            handle = agent.initialize_xfer(op, local, remote, peer)
            state = agent.transfer(handle)
            while state != "DONE":
                assert state != "ERR", "raw NIXL transfer failed"
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
        return run
    return move("WRITE", source), move("READ", landing)


def measure(name: str, nbytes: int, sub: Path, space: KeySpace, repeat: int) -> dict:
    """One trial: fresh payload rows, landing rows and backend; best-of-`repeat` times of each operation.

    Why fresh allocations per trial: where the kernel places a trial's pages moved the rdma
    ratio at 4 MiB between 51% and 156% from one process to the next (the working set is about
    this VM's 8 MiB L3), far more than any change measured; the summary takes the median trial.
    """
    n = nbytes // BLOCK
    extra_refs: dict = {}  # references beside the main one, for the puts of some backends
    # payloads and landing buffers are rows of two page-aligned host tensors: what a tier pool (dram, cxl)
    # hands the backend below it, which rdma moves without staging and nvme writes in place
    source, landing = aligned_host_tensor(n, BLOCK), aligned_host_tensor(n, BLOCK)
    for i, row in enumerate(source.numpy()):
        row[:] = np.random.default_rng(i).integers(0, 255, BLOCK, dtype=np.uint8)
    blocks, out = list(source.numpy()), list(landing.numpy())
    digests = [checksum(b) for b in blocks]  # what the tier above holds for its rows (it verified them)
    keys = space.chain_hash_ids(list(range(n)), cache_salt=str(nbytes))
    sub.mkdir(parents=True, exist_ok=True)
    gc.collect()  # one case alive at a time: the last one's threads, NIXL agents and buffers are gone
    if name.startswith("rdma"):
        pool = NixlPeerPool(n, BLOCK)
        backend = RDMABackend(pool, nbytes, n)
        backend.register(source)  # payloads and landing buffers in registered memory: no staging copy
        backend.register(landing)
        ref_put, ref_get = ref_nixl(backend, pool, source, landing, first_slot=0)  # the backend's own slots
        extra_refs["ref_put_summed"] = summed_first(ref_put, blocks)
        if name == "rdma-staged":  # the same bytes from and into plain memory: through the staging buffer
            blocks, out = [aligned_empty(BLOCK) for _ in range(n)], [aligned_empty(BLOCK) for _ in range(n)]
            for b, row in zip(blocks, source.numpy()):
                b[:] = row
    elif name == "nvme":
        backend = NVMeBackend(sub / "nvme", n, BLOCK)
        ref_put, ref_get = ref_posix(sub, blocks, out, backend.direct)
    elif name == "pfs":
        backend = PFSBackend(sub / "pfs", 1 << 34)
        ref_put, ref_get = ref_files(sub, blocks)
        extra_refs["ref_put_summed"] = ref_files(sub, blocks, summed=True)[0]
    else:
        backend = {"hbm": hbm_backend, "dram": dram_backend, "cxl": cxl_backend}[name](n, BLOCK)
        ref_put, ref_get = ref_copy(blocks, out)
    items = list(zip(keys, blocks))
    # pfs is content-addressed (a key on file is not written again): each timed put writes new files
    fresh = (lambda: backend.delete(keys)) if name == "pfs" else None
    backend.put_many(items)  # warm: slots faulted in, files and directories exist
    ref_put()
    # backend and reference in turn each round (the order rotating), so both see the same moments of the machine
    puts = best_interleaved({"put": Case(lambda: backend.put_many(items), fresh),
                             "demote": Case(lambda: backend.put_many(items, digests), fresh),
                             "ref_put": Case(ref_put, getattr(ref_put, "setup", None)),
                             **{k: Case(f, getattr(f, "setup", None)) for k, f in extra_refs.items()}}, repeat)
    backend.put_many(items)
    gets = best_interleaved({"get": lambda: backend.get_many(keys, out), "ref_get": ref_get}, repeat)
    if any(g is None for g in backend.get_many(keys, out)):
        raise SystemExit(f"{name}: blocks were lost during the run; its figures are void")
    trial = {"medium": backend.medium, "emulated": backend.emulated, "put_s": puts["put"], "demote_s": puts["demote"],
             "ref_put_s": puts["ref_put"], "get_s": gets["get"], "ref_get_s": gets["ref_get"],
             **{f"{k}_s": puts[k] for k in extra_refs}}
    if hasattr(backend, "close"):
        backend.close()
    shutil.rmtree(sub, ignore_errors=True)  # this trial's slab and files: up to 4x the batch on disk
    return trial


def summarize(name: str, nbytes: int, trials: list[dict]) -> dict:
    """Median over trials of each time and of each ratio (ratios are taken within a trial, then the median)."""
    med = lambda key: float(np.median([t[key] for t in trials]))  # noqa: E731
    ratio = lambda ref, own: float(np.median([t[ref] / t[own] for t in trials]))  # noqa: E731
    n = nbytes // BLOCK
    summed = {}
    if "ref_put_summed_s" in trials[0]:  # the puts against their reference that also sums each block
        summed = {"ref_put_summed_gbps": nbytes / med("ref_put_summed_s") / 1e9,
                  "put_vs_summed_ref": ratio("ref_put_summed_s", "put_s"),
                  "demote_vs_summed_ref": ratio("ref_put_summed_s", "demote_s")}
    return {
        "backend": name, "medium": trials[0]["medium"], "emulated": trials[0]["emulated"], "batch_bytes": nbytes,
        "block_bytes": BLOCK, "trials": len(trials),
        "put_gbps": nbytes / med("put_s") / 1e9, "demote_gbps": nbytes / med("demote_s") / 1e9,
        "get_gbps": nbytes / med("get_s") / 1e9,
        "ref_put_gbps": nbytes / med("ref_put_s") / 1e9, "ref_get_gbps": nbytes / med("ref_get_s") / 1e9,
        "put_vs_ref": ratio("ref_put_s", "put_s"), "demote_vs_ref": ratio("ref_put_s", "demote_s"),
        "get_vs_ref": ratio("ref_get_s", "get_s"),
        "trial_get_vs_ref": [t["ref_get_s"] / t["get_s"] for t in trials],
        "trial_put_vs_ref": [t["ref_put_s"] / t["put_s"] for t in trials],
        "trial_demote_vs_ref": [t["ref_put_s"] / t["demote_s"] for t in trials],
        "put_latency_us_per_block": med("put_s") / n * 1e6, "get_latency_us_per_block": med("get_s") / n * 1e6,
        **summed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", default=None, help="directory for nvme/pfs files (default: a temp dir)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="rounds per trial; each trial keeps its best")
    parser.add_argument("--trials", type=positive_int, default=3,
                        help="fresh allocations per backend and batch; the median trial is reported")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated subset of " + ",".join(BACKENDS + EXTRA) + " (the last is opt-in)")
    parser.add_argument("--batches-kib", default=",".join(str(b >> 10) for b in BATCHES),
                        help="comma-separated batch sizes in KiB")
    args = parser.parse_args()
    out = JsonOutput(args.json)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(wanted) - set(BACKENDS + EXTRA))
    if unknown or not wanted:
        parser.error(f"--backends: unknown backend(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(BACKENDS + EXTRA)}")
    try:
        batches = [int(b) << 10 for b in args.batches_kib.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches-kib: expected comma-separated integers, got {args.batches_kib!r}")
    if not batches or min(batches) <= 0:
        parser.error("--batches-kib: every batch size must be a positive number of KiB")
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvc-bw-"))
    rows = []
    space = KeySpace(model="bench")
    global BLOCK
    for nbytes in batches:
        BLOCK = min(nbytes, MAX_BLOCK)
        for name in (name for name in BACKENDS + EXTRA if name in wanted):
            trials = [measure(name, nbytes, root / f"b{nbytes}-t{t}", space, args.repeat) for t in range(args.trials)]
            rows.append(summarize(name, nbytes, trials))
    if out.enabled:
        out.emit(rows)
        return 0
    print("| backend | batch | block | put GB/s | demote GB/s | ref | put/ref | demote/ref | get GB/s | ref | get/ref "
          "| get us/block |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['batch_bytes'] >> 10:,} KiB | {r['block_bytes'] >> 10:,} KiB | {r['put_gbps']:.2f} | "
              f"{r['demote_gbps']:.2f} | {r['ref_put_gbps']:.2f} | {r['put_vs_ref']:.0%} | {r['demote_vs_ref']:.0%} | "
              f"{r['get_gbps']:.2f} | {r['ref_get_gbps']:.2f} | {r['get_vs_ref']:.0%} | {r['get_latency_us_per_block']:.0f} |")
    print("\nmedia: " + "; ".join(sorted({f"{r['backend']}: {r['medium']}" for r in rows})))
    for r in (r for r in rows if "put_vs_summed_ref" in r):
        print(f"{r['backend']} {r['batch_bytes'] >> 10:,} KiB against its reference summing each block "
              f"({r['ref_put_summed_gbps']:.2f} GB/s): put {r['put_vs_summed_ref']:.0%}, "
              f"demote {r['demote_vs_summed_ref']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
