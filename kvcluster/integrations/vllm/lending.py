"""vLLM's paged KV as its node's hbm tier: the blocks in an engine's pages, lent to other nodes over NIXL.

On a kvcluster cluster the engine's pages are the fastest copy of every block it computed or loaded, and
they stay valid until vLLM rewrites them. So the connector lends them: the pages are registered with a NIXL
agent of this process (`NixlRegionLender`), a control actor on this node (`LentPagesActor`, named like a tier
actor: `kvcluster/<node>/hbm`) keeps the directory of which block is in which pages and tells the index,
and a reader on another node reads a block straight from these pages into its own (no host copy here, on a
GPU no bounce through host memory at all).

What the pages hold is followed exactly, from what the scheduler tells the worker each step (`LentBlocks`):
a block enters when its pages are complete (a saved block after the forward that computed it, a loaded
block once in place) and leaves when vLLM writes into its pages again (every block a step's forward or a
load writes). The directory learns of both with one fire-and-forget call per step, so it trails the
pages by up to a step; a reader that reads pages being rewritten finds a wrong digest, a miss. The digest
of each lent block is taken from its pages when it enters.

One engine per node lends (its actor's name is the node's); a second one on the node reads from the cluster
like any other but lends nothing. With tensor parallelism each worker lends its own shards (stored under
keys of their own, `shard_key`) through an actor of its own, `kvcluster/<node>/hbm/tp{rank}-of-{size}`; the
same rank of another engine of that shape is the only reader that asks for those keys, and it asks that actor.

This module is the pure half (`LentBlocks`, the pages' digests); the engine's side of the actor,
`PagedKVLending`, is in `kvcluster.actors.paged_lending`, started through the cluster store's `lend`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...keys import BlockKey
from ...storage.copyhash import hash_segments, tensor_hashes


class LentBlocks:
    """Which key each lent vLLM block holds, and what changed since the last `drain` (pure bookkeeping).

    A key is lent from one block at a time (its latest); a block lends one key."""

    def __init__(self) -> None:
        self._key_of: dict[int, BlockKey] = {}  # block id -> key its pages hold
        self._block_of: dict[BlockKey, int] = {}  # key -> the block it is lent from
        self._entered: dict[BlockKey, tuple[int, int, int]] = {}  # since the last drain: key -> (block, length, digest)
        self._left: set[BlockKey] = set()  # since the last drain: keys no longer lent from where they were

    def __len__(self) -> int:
        return len(self._block_of)

    def block_of(self, key: BlockKey) -> int | None:
        return self._block_of.get(key)

    def lend(self, key: BlockKey, block_id: int, length: int, digest: int) -> None:
        """Block `block_id`'s pages hold `key` now (complete): lent from here, in place of where it was."""
        self._drop_block(block_id)
        old = self._block_of.get(key)
        if old is not None:
            del self._key_of[old]
            self._left.add(key)
        self._key_of[block_id], self._block_of[key] = key, block_id
        self._entered[key] = (block_id, length, digest)

    def written(self, block_ids: Sequence[int]) -> None:
        """vLLM writes these blocks' pages (a forward, a load): whatever they held is lent no more."""
        for b in block_ids:
            self._drop_block(b)

    def _drop_block(self, block_id: int) -> None:
        key = self._key_of.pop(block_id, None)
        if key is not None:
            del self._block_of[key]
            self._entered.pop(key, None)
            self._left.add(key)

    def drain(self) -> tuple[list[tuple[bytes, int, int, int]], list[bytes]]:
        """The changes since the last drain, as `LentDirectory.update` applies them (left first, then entered)."""
        entered = [(bytes(k), *v) for k, v in self._entered.items()]
        left = [bytes(k) for k in self._left]
        self._entered, self._left = {}, set()
        return entered, left

    def keys(self) -> list[BlockKey]:
        return list(self._block_of)


def page_digest(pages: Sequence[torch.Tensor]) -> int:
    """The digest of a block whose bytes are `pages` in order: what a reader verifies after its transfer."""
    return page_digests([pages])[0]


def page_digests(blocks: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """`page_digest` of each block, summed where the pages lie: in place on the host, and on a device in one
    batch (`tensor_hashes`: a few kernels and one synchronisation for all of them, not one per block)."""
    if not blocks:
        return []
    if blocks[0][0].device.type != "cpu":
        return tensor_hashes([torch.cat([p.reshape(-1) for p in pages]) for pages in blocks])
    return [hash_segments([p.numpy() for p in pages]) for pages in blocks]
