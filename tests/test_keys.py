"""Block keys: deterministic across processes, chained, salted per tenant and model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcluster.keys import KEY_BYTES, KeySpace, shard_key


def test_keys_are_the_same_in_another_process() -> None:
    here = KeySpace(model="llama").chain_token_ids(list(range(64)), 16)[-1].hex()
    code = "from kvcluster.keys import KeySpace; print(KeySpace(model='llama').chain_token_ids(list(range(64)), 16)[-1].hex())"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there and len(bytes.fromhex(here)) == KEY_BYTES


def test_salt_model_and_seed_separate_key_spaces() -> None:
    tokens = list(range(32))
    base = KeySpace(model="m").chain_token_ids(tokens, 16)
    assert KeySpace(model="m").chain_token_ids(tokens, 16, cache_salt="tenant-b") != base
    assert KeySpace(model="other").chain_token_ids(tokens, 16) != base
    assert KeySpace(model="m", root_seed="cluster-2").chain_token_ids(tokens, 16) != base


def test_a_partial_tail_gets_no_key() -> None:
    assert len(KeySpace().chain_token_ids(list(range(47)), 16)) == 2


@given(st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=80), st.integers(0, 2**31 - 1))
def test_chaining_means_a_key_fixes_its_whole_prefix(tokens, other) -> None:
    space = KeySpace()
    keys = space.chain_token_ids(tokens, 16)
    changed = [other if i == 0 and other != tokens[0] else t for i, t in enumerate(tokens)]
    if changed != tokens:
        assert all(a != b for a, b in zip(keys, space.chain_token_ids(changed, 16)))
    longer = space.chain_token_ids(tokens + [1] * 16, 16)
    assert longer[: len(keys)] == keys


def test_hash_ids_and_tokens_do_not_collide() -> None:
    space = KeySpace()
    assert space.chain_hash_ids([1]) != space.chain([[1]])


def test_shard_keys_differ_per_worker_and_map_back() -> None:
    keys = KeySpace(model="m").chain_token_ids(list(range(64)), 16)
    for key in keys:
        shards = [shard_key(key, r, 4) for r in range(4)]
        assert len(set(shards) | {key}) == 5  # every worker's shard has a key of its own
        assert [shard_key(s, r, 4) for r, s in enumerate(shards)] == [key] * 4  # its own inverse
        assert shard_key(key, 0, 2) != shard_key(key, 0, 4)  # a different split is different bytes
        assert shard_key(key, 0, 1) == key  # one worker holds whole blocks
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        shard_key(keys[0], 2, 2)
