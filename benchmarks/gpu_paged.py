"""GPU check section paged: the vLLM connector's data plane (`PagedKV` + the dram tier) vs bulk torch copies.

The connector saves a batch of blocks by gathering every layer's page of each block out of the engine's
paged KV tensors into host rows and putting those rows into the dram tier; it loads by reading the tier
into PagedKV's pinned landing rows and scattering them back. The reference for each is the floor of the
same move: ONE bulk torch copy of the same number of bytes across the bus (device -> pinned host for a
save, pinned host -> device for a load). The ratio says how much the per-layer gather/scatter and the
tier's verified copy cost on top of the bus; each part is also timed alone. Blocks are every other block
of the cache (a real batch is not one contiguous range), 32 layers, one model block per row.
"""

from __future__ import annotations

import torch
from gpu_common import GOAL, Plan, best_s, block_bytes, block_keys, cuda, host_blocks, versus

LAYERS = 32


def section_paged(plan: Plan, out: dict) -> None:
    from kvcluster.integrations.vllm.paged_kv import PagedKV
    from kvcluster.storage import dram_backend

    n, r = plan.blocks, plan.repeat
    page = block_bytes(plan) // LAYERS
    row = page * LAYERS
    num_blocks, ids = 2 * n + 1, list(range(1, 2 * n + 1, 2))  # every other block
    layers = paged_layers(num_blocks, page, plan.device)
    kv = PagedKV(layers, [f"layer.{i}" for i in range(LAYERS)], num_blocks, page)
    dram, keys, nbytes = dram_backend(n, row), block_keys("paged", n), n * row
    out.update(layers=LAYERS, page_bytes=page, row_bytes=row, blocks=n, batch_bytes=nbytes, cache_blocks=num_blocks,
               block_ids="every other block", paged_device=str(kv.device), dram_medium=dram.medium)
    landing_rows = [r.numpy() for r in kv.landing(n)]  # pinned on CUDA: the tier reads straight into them

    def save() -> None:
        rows = kv.gather(ids)
        dram.put_many([(k, rows[j].numpy()) for j, k in enumerate(keys)])

    def load() -> None:
        dram.get_many(keys, landing_rows)
        kv.scatter(ids, landing_rows)

    out["row_order_verified"] = row_order_ok(kv, layers, ids[-1])
    out["bytes_verified"] = round_trip_ok(kv, layers, ids, save, load)
    save_s, gather_s = best_s(save, r), best_s(lambda: kv.gather(ids), r)
    rows = kv.gather(ids)
    put_s = best_s(lambda: dram.put_many([(k, rows[j].numpy()) for j, k in enumerate(keys)]), r)
    load_s, scatter_s = best_s(load, r), best_s(lambda: kv.scatter(ids, landing_rows), r)
    get_s = best_s(lambda: dram.get_many(keys, landing_rows), r)
    dev, host = torch.empty((n, row), dtype=torch.uint8, device=plan.device), host_blocks(n, row)
    bulk_d2h, bulk_h2d = best_s(lambda: host.copy_(dev), r), best_s(lambda: dev.copy_(host, non_blocking=True), r)
    per_page_s = best_s(lambda: per_page_gather(layers, ids, page), r)
    pinned, there = ("pinned host", "device") if cuda() else ("host", "host (no CUDA)")
    out["save"] = versus(save_s, bulk_d2h, nbytes, f"one bulk torch copy of the same bytes, {there} -> {pinned}") | {
        "gather_gbps": gbps(nbytes, gather_s), "dram_put_gbps": gbps(nbytes, put_s),
        "per_page_gather_gbps": gbps(nbytes, per_page_s),
        "per_page_gather": "one torch copy per layer page into pageable host rows (the connector's former path)"}
    out["load"] = versus(load_s, bulk_h2d, nbytes, f"one bulk torch copy of the same bytes, {pinned} -> {there}") | {
        "scatter_gbps": gbps(nbytes, scatter_s), "dram_get_gbps": gbps(nbytes, get_s)}


def paged_layers(num_blocks: int, page: int, device: str) -> list[torch.Tensor]:
    """`LAYERS` paged tensors of random bytes: what an engine's KV cache is, to the data plane."""
    g = torch.Generator(device=device).manual_seed(11)
    return [torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device=device, generator=g)
            for _ in range(LAYERS)]


def row_order_ok(kv, layers: list[torch.Tensor], block: int) -> bool:
    """A gathered row is layer 0's page of the block, then layer 1's, ... (the stored payload format)."""
    expected = torch.cat([t[block].cpu() for t in layers])
    return bool(torch.equal(kv.gather([block])[0], expected))


def round_trip_ok(kv, layers: list[torch.Tensor], ids: list[int], save, load) -> bool:
    """Save the blocks, wipe them in the cache, load them back: every layer's bytes as before."""
    before = [t.cpu() for t in layers]
    save()
    index = torch.tensor(ids, device=layers[0].device)
    for t in layers:
        t.index_fill_(0, index, 0)
    load()
    return all(torch.equal(t.cpu(), b) for t, b in zip(layers, before))


def per_page_gather(layers: list[torch.Tensor], ids: list[int], page: int) -> None:
    rows = torch.empty((len(ids), page * len(layers)), dtype=torch.uint8)
    for j, b in enumerate(ids):
        for i, t in enumerate(layers):
            rows[j, i * page:(i + 1) * page].copy_(t[b])


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def summary_paged(s: dict) -> str:
    a, b = s["save"], s["load"]
    return (f"save (gather+dram put) {a['gbps']:.1f} GB/s vs bulk D2H {a['ref_gbps']:.1f} ({a['ratio']:.0%}; gather "
            f"{a['gather_gbps']:.1f}, put {a['dram_put_gbps']:.1f}, per-page gather {a['per_page_gather_gbps']:.1f}); "
            f"load (dram get+scatter) {b['gbps']:.1f} vs bulk H2D {b['ref_gbps']:.1f} ({b['ratio']:.0%}; get "
            f"{b['dram_get_gbps']:.1f}, scatter {b['scatter_gbps']:.1f}); goal {GOAL:.0%}, "
            f"{s['blocks']} x {s['row_bytes'] >> 10} KiB over {s['layers']} layers, verified {s['bytes_verified']}")
