"""Remote blocks straight into an engine's paged KV over NIXL, against the staged read and a scatter, by page size.

The vLLM connector on a cluster loads a block from another node's memory tier one of two ways:

- in place: one NIXL READ with one descriptor per page (a block is one page in each layer's tensor, all
  registered with NIXL), verified where it landed (`RDMABackend.read_segments`);
- staged: the READ lands in the backend's staging buffer, the copy out of it into a host row sums the
  block, and `PagedKV.scatter` copies the row into the pages.

In place moves the bytes once instead of three times, but costs a descriptor per page. This measures
both on the same blocks, for pages of 8 to 256 KiB (a block of `--layers` pages), and prints in place
against staged. The connector reads in place from `IN_PLACE_MIN_PAGE_BYTES` up.

A third column reads the same blocks from another engine's paged KV lent over NIXL (`NixlRegionLender`, the
node's hbm tier: `kvcluster.integrations.vllm.lending`) page to page, against the in-place read from a pool's
slab: scattered on both sides instead of one.

    .venv/bin/python benchmarks/paged_nixl.py [--json] [--blocks 8] [--layers 8] [--repeat 9]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from harness import JsonOutput, best_of

from kvcluster.cli import positive_int
from kvcluster.integrations.vllm.lending import LentBlocks, page_digest
from kvcluster.integrations.vllm.paged_kv import PagedKV
from kvcluster.keys import KeySpace
from kvcluster.storage import LentDirectory
from kvcluster.storage.rdma import NixlPeerPool, NixlRegionLender, RDMABackend, ucx_transport

PAGES_KIB = (8, 16, 32, 64, 128, 256)


def measure(page: int, layers: int, n: int, repeat: int) -> dict:
    """In place vs staged + scatter for `n` blocks of `layers` pages of `page` bytes, every other block of a
    paged KV twice that size."""
    block = page * layers
    peer = NixlPeerPool(n, block)
    client = RDMABackend(peer, n * block, n, lanes=1)
    try:
        src = torch.from_numpy(np.random.default_rng(page).integers(0, 256, (n, block), dtype=np.uint8))
        keys = KeySpace(model="paged-nixl").chain_hash_ids(list(range(n)), cache_salt=str(page))
        if not all(client.put_many([(k, src[i]) for i, k in enumerate(keys)])):
            raise RuntimeError("the peer did not take the blocks")
        tensors = [torch.zeros((2 * n, page), dtype=torch.uint8) for _ in range(layers)]
        kv = PagedKV(tensors, [f"layer.{i}" for i in range(layers)], 2 * n, page)
        for region in kv.regions:
            client.register(region)
        targets = list(range(1, 2 * n, 2))
        pages = [kv.block_pages(b) for b in targets]
        rows = torch.zeros((n, block), dtype=torch.uint8)  # not registered: the read goes through staging

        def staged() -> None:
            client.read_verified(keys, [rows.numpy()[i] for i in range(n)])
            kv.scatter(targets, list(rows))

        staged_s = best_of(staged, repeat, warmup=1)
        exact_staged = torch.equal(kv.gather(targets), src)
        for t in tensors:
            t.zero_()
        in_place_s = best_of(lambda: client.read_segments(keys, pages), repeat, warmup=1)
        exact = exact_staged and torch.equal(kv.gather(targets), src)
        for t in tensors:
            t.zero_()
        lent_s, exact_lent = lent_pages(src, keys, layers, page, kv, targets, repeat)
    finally:
        client.close()
        peer.close()
    nbytes = n * block
    return {"page_bytes": page, "pages_per_block": layers, "blocks": n, "batch_bytes": nbytes,
            "in_place_gbps": nbytes / in_place_s / 1e9, "staged_gbps": nbytes / staged_s / 1e9,
            "in_place_vs_staged": staged_s / in_place_s, "lent_gbps": nbytes / lent_s / 1e9,
            "lent_vs_in_place": in_place_s / lent_s, "bytes_exact": exact and exact_lent}


def lent_pages(src: torch.Tensor, keys: list, layers: int, page: int, kv: PagedKV, targets: list[int],
               repeat: int) -> tuple[float, bool]:
    """Seconds to read the blocks (host rows `src`) from another engine's lent paged KV (every other block of it,
    on `kv`'s device) into `kv`'s `targets` pages, and whether the bytes are exact."""
    n = len(keys)
    owner = PagedKV([torch.zeros((2 * n, page), dtype=torch.uint8, device=kv.device) for _ in range(layers)],
                    [f"layer.{i}" for i in range(layers)], 2 * n, page)
    owner_blocks = list(range(0, 2 * n, 2))
    owner.scatter(owner_blocks, list(src))
    lender = NixlRegionLender(owner.regions)
    directory = LentDirectory(lender.metadata, lender.descs, owner.row_bytes, lender.name)
    lent = LentBlocks()
    for key, b in zip(keys, owner_blocks):
        lent.lend(key, b, owner.row_bytes, page_digest(owner.block_pages(b)))
    directory.update(*lent.drain())
    reader = RDMABackend(directory, owner.row_bytes, 2 * n, lanes=1)
    try:
        for region in kv.regions:
            reader.register(region)
        pages = [kv.block_pages(b) for b in targets]
        seconds = best_of(lambda: reader.read_segments(keys, pages), repeat, warmup=1)
        return seconds, torch.equal(kv.gather(targets), src)
    finally:
        reader.close()
        lender.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--blocks", type=positive_int, default=8, help="blocks per read")
    parser.add_argument("--layers", type=positive_int, default=8, help="pages per block (attention layers)")
    parser.add_argument("--repeat", type=positive_int, default=9)
    args = parser.parse_args()
    out = JsonOutput(args.json)
    transport, emulated = ucx_transport()
    rows = [measure(kib << 10, args.layers, args.blocks, args.repeat) for kib in PAGES_KIB]
    if out.enabled:
        out.emit({"ucx_transport": transport, "emulated": emulated, "rows": rows})
        return 0
    print(f"NIXL UCX over {transport}{' (no RDMA NIC: a stand-in)' if emulated else ''}; "
          f"{args.blocks} blocks of {args.layers} pages a read")
    print("| page | block | in place GB/s | staged + scatter GB/s | in place / staged | from lent pages GB/s | "
          "lent / in place | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['page_bytes'] >> 10} KiB | {r['page_bytes'] * r['pages_per_block'] >> 10} KiB | "
              f"{r['in_place_gbps']:.2f} | {r['staged_gbps']:.2f} | {r['in_place_vs_staged']:.2f}x | "
              f"{r['lent_gbps']:.2f} | {r['lent_vs_in_place']:.2f}x | {r['bytes_exact']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
