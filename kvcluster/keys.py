"""Block keys: a chained BLAKE2b hash every node computes identically.

A key covers the parent block's key, the block's token ids (int32 little-endian),
the model fingerprint and the tenant's cache salt, so equal keys mean equal KV and
tenants never share a block. Never Python's `hash` (salted per process).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16
DEFAULT_ROOT_SEED = "kvcluster-v1"


@dataclass(frozen=True)
class KeySpace:
    """Everything that makes two blocks with equal tokens hold different KV."""

    model: str = "trace"  # model fingerprint: name, dtype, RoPE settings, layout
    root_seed: str = DEFAULT_ROOT_SEED  # configured cluster-wide; every node must agree

    def root(self, cache_salt: str = "") -> BlockKey:
        """The parent key of a sequence's first block, for one tenant."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvc-root")
        for part in (self.root_seed, self.model, cache_salt):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))
            h.update(data)
        return BlockKey(h.digest())

    def child(self, parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
        """Key of the block with `token_ids` that follows `parent`."""
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvc-tok")
        h.update(np.asarray(token_ids, dtype="<i4").tobytes())
        return BlockKey(h.digest())

    def child_of_hash_id(self, parent: BlockKey, hash_id: int | str) -> BlockKey:
        """Key for a trace block known only by its hash id (hash-only traces)."""
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvc-hid")
        h.update(str(hash_id).encode())
        return BlockKey(h.digest())

    def chain(self, blocks_of_tokens: Sequence[Sequence[int]], cache_salt: str = "") -> list[BlockKey]:
        """Keys of consecutive full blocks of a token sequence."""
        keys, parent = [], self.root(cache_salt)
        for tokens in blocks_of_tokens:
            parent = self.child(parent, tokens)
            keys.append(parent)
        return keys

    def chain_token_ids(self, token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[BlockKey]:
        """Keys of every full `block_size` block of `token_ids` (a partial tail gets none)."""
        full = len(token_ids) // block_size
        return self.chain([token_ids[i * block_size : (i + 1) * block_size] for i in range(full)], cache_salt)

    def chain_hash_ids(self, hash_ids: Sequence[int | str], cache_salt: str = "") -> list[BlockKey]:
        """Keys for a hash-only trace request: the hash ids take the place of token ids."""
        keys, parent = [], self.root(cache_salt)
        for hash_id in hash_ids:
            parent = self.child_of_hash_id(parent, hash_id)
            keys.append(parent)
        return keys


def shard_key(key: BlockKey, rank: int, ranks: int) -> BlockKey:
    """The key of worker `rank`'s shard of block `key`, when `ranks` tensor-parallel workers each hold a shard
    of every block (their heads): distinct per worker, so the shards can share tiers and an index. Its own
    inverse (a per-worker mask), so a worker's stored keys map back to the block's. One worker: `key`."""
    if ranks == 1:
        return key
    return BlockKey((int.from_bytes(key, "little") ^ _shard_mask(rank, ranks)).to_bytes(len(key), "little"))


def _shard_mask(rank: int, ranks: int) -> int:
    if not 0 <= rank < ranks:
        raise ValueError(f"worker rank {rank} outside 0..{ranks - 1}")
    digest = hashlib.blake2b(f"{rank}/{ranks}".encode(), digest_size=KEY_BYTES, person=b"kvc-shard").digest()
    return int.from_bytes(digest, "little")


def stand_in_key(block: int) -> BlockKey:
    """The key a trace's block id stands for where a replay needs real keys (bytes in tiers, shards): a digest,
    so such keys spread over index and control plane shards as real keys do."""
    return BlockKey(hashlib.blake2b(int(block).to_bytes(8, "big"), digest_size=KEY_BYTES, person=b"kvc-sid").digest())
