"""GPU check section nixl: raw NIXL UCX VRAM<->DRAM against torch copies, the rdma backend against raw NIXL, and
the vLLM connector's remote load straight into paged KV pages against the staged read and a scatter."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch
from gpu_common import Plan, Skip, best_s, block_bytes, block_keys, cuda, host_blocks, versus
from paged_nixl import lent_pages


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

    pool = NixlPeerPool(2 * n, block)  # room for the blocks written back from registered memory
    client = RDMABackend(pool, n * block, 2 * n)
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
    result = versus(seconds, raw_read_s, n * block, ref) | {"medium": client.medium, "bytes_verified": ok}
    result["straight_into_registered_" + ("vram" if dev.is_cuda else "host_memory")] = registered_read(
        plan, client, keys, src, dev, raw_read_s)
    result["straight_into_paged_kv_pages"] = paged_read(plan, client, keys, src, dev)
    client.close()
    pool.close()
    return result


def registered_read(plan: Plan, client, keys: list, src: torch.Tensor, dev: torch.Tensor, raw_read_s: float) -> dict:
    """The rdma backend reading straight into memory registered with its agents: VRAM on a GPU (NIXL's VRAM
    descriptors, each block verified on the device), against the raw NIXL read of the same bytes."""
    n, block = src.shape
    rows = torch.zeros((n, block), dtype=torch.uint8, device=dev.device)
    client.register(rows)
    got, _ = client.read_verified(keys, list(rows))
    ok = all(g is not None for g in got) and torch.equal(rows.cpu(), src)
    seconds = best_s(lambda: client.read_verified(keys, list(rows)), plan.repeat)
    direct = client.stats()["extra"].get("direct_reads", 0)
    back = rows.clone()  # and the other way: blocks sent straight from device memory
    wrote = client.put_many([(k, rows[i]) for i, k in enumerate(block_keys("rdma-back", n))])
    return versus(seconds, raw_read_s, n * block, "raw NIXL READ (above)") | {
        "bytes_verified": ok, "direct_reads": direct, "verified_on": "device" if dev.is_cuda else "host",
        "writes_from_registered_memory_ok": all(wrote), "unchanged": bool(torch.equal(back, rows))}


def paged_read(plan: Plan, client, keys: list, src: torch.Tensor, dev: torch.Tensor) -> dict:
    """The vLLM connector's remote load: each block straight into its pages of an engine's paged KV (one page in
    each of PAGED_LAYERS layer tensors registered with NIXL, one descriptor per page, verified where they landed),
    against the path it replaces: the rdma read through the staging buffer into host rows, then
    `PagedKV.scatter` (an H2D copy on a GPU)."""
    from kvcluster.integrations.vllm.paged_kv import PagedKV

    n, block = src.shape
    if block % PAGED_LAYERS:
        raise Skip(f"a {block}-byte block does not split into {PAGED_LAYERS} pages")
    page = block // PAGED_LAYERS
    layers = [torch.zeros((2 * n, page), dtype=torch.uint8, device=dev.device) for _ in range(PAGED_LAYERS)]
    kv = PagedKV(layers, [f"layer.{i}" for i in range(PAGED_LAYERS)], 2 * n, page)
    for region in kv.regions:
        client.register(region)
    targets = list(range(1, 2 * n, 2))  # every other block, as an engine's free blocks come
    pages = [kv.block_pages(b) for b in targets]
    digests = client.read_segments(keys, pages)
    ok = all(d is not None for d in digests) and torch.equal(kv.gather(targets).cpu(), src)
    seconds = best_s(lambda: client.read_segments(keys, pages), plan.repeat)
    rows = host_blocks(n, block)

    def staged_then_scattered() -> None:  # rows outside registered memory: through the staging buffer
        client.read_verified(keys, [rows.numpy()[i] for i in range(n)])
        kv.scatter(targets, list(rows))

    ref_s = best_s(staged_then_scattered, plan.repeat)
    for t in layers:
        t.zero_()
    lent_s, lent_ok = lent_pages(src, keys, PAGED_LAYERS, page, kv, targets, plan.repeat)
    return versus(seconds, ref_s, n * block, "rdma read via staging into host rows + PagedKV.scatter") | {
        "bytes_verified": ok, "pages_per_block": PAGED_LAYERS, "page_bytes": page,
        "segmented_reads": client.stats()["extra"].get("segmented_reads", 0),
        "from_lent_paged_kv": versus(lent_s, seconds, n * block, "the in-place read from a pool's slab (above)")
        | {"bytes_verified": lent_ok, "owner_mem": "VRAM" if dev.is_cuda else "DRAM"}}


PAGED_LAYERS = 32  # pages a block is split into, one per attention layer (Llama-3.1-8B)


def summary_nixl(s: dict) -> str:
    mem, w, r, b = s["local_mem"], s["write_to_dram"], s["read_from_dram"], s["rdma_backend_to_hbm"]
    return (f"NIXL {mem}->DRAM {w['gbps']:.1f} GB/s vs torch {w['ref_gbps']:.1f} ({w['ratio']:.0%}); "
            f"DRAM->{mem} {r['gbps']:.1f} vs {r['ref_gbps']:.1f} ({r['ratio']:.0%}); "
            f"rdma backend+H2D {b['gbps']:.2f} vs raw NIXL read ({b['ratio']:.0%}); "
            + "; ".join(f"{k.replace('_', ' ')} {v['gbps']:.2f} GB/s ({v['ratio']:.0%}, verified {v['bytes_verified']})"
                        for k, v in b.items() if k.startswith("straight_into") and "gbps" in v)
            + "".join(f"; from lent paged KV {v['from_lent_paged_kv']['gbps']:.2f} GB/s "
                      f"({v['from_lent_paged_kv']['ratio']:.0%} of in place)"
                      for k, v in b.items() if isinstance(v, dict) and "from_lent_paged_kv" in v))
