"""Storage faults under the model runner: corrupt, full or unwritable tiers are misses, never wrong output."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.serving.models import load_model
from kvcluster.serving.runner import ModelRunner
from kvcluster.serving.sampling import SamplingParams
from kvcluster.storage import NVMeBackend, PFSBackend, layout_for
from kvcluster.storage.tiered import TieredStore

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model("kvcluster-tiny-llama")


@pytest.fixture(scope="module")
def cold(loaded):
    return ModelRunner(loaded)


def disk_runner(loaded, tmp_path, nvme_slots: int = 64):
    block = layout_for(loaded.spec, 16, loaded.dtype).nbytes()
    nvme = NVMeBackend(tmp_path / "nvme", nvme_slots, block)
    pfs = PFSBackend(tmp_path / "pfs", 256 * block)
    return ModelRunner(loaded, LocalBlockStore(TieredStore([nvme, pfs], block))), nvme, pfs


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, 32000, n)]


def test_a_flipped_byte_on_nvme_is_a_miss_and_the_output_is_unchanged(loaded, cold, tmp_path):
    runner, nvme, _ = disk_runner(loaded, tmp_path)
    tokens = prompt(100)
    runner.complete(tokens, GREEDY)
    keys = runner.block_keys(tokens[:96])
    slot = nvme.table.get(keys[2]).slot
    with open(nvme.path, "r+b") as f:  # flip one byte of block 2 on "disk"
        f.seek(slot * nvme.slot_bytes + 1000)
        byte = f.read(1)
        f.seek(slot * nvme.slot_bytes + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    gen = runner.complete(tokens, GREEDY)
    assert gen.cached_tokens == 32  # blocks 0-1 only: the run ends at the corrupt block
    assert gen.output_ids == cold.complete(tokens, GREEDY).output_ids
    assert nvme.stats()["corrupt"] == 1
    assert runner.complete(tokens, GREEDY).cached_tokens == 96  # the recomputed block was stored again


def test_a_corrupt_pfs_file_is_a_miss(loaded, cold, tmp_path):
    runner, nvme, pfs = disk_runner(loaded, tmp_path, nvme_slots=2)  # nvme holds 2 blocks: the rest spill to pfs
    tokens = prompt(120, seed=1)
    runner.complete(tokens, GREEDY)
    files = sorted(pfs.base.glob("??/??/*.kvb"))
    assert files, "nothing reached pfs"
    for f in files:
        data = bytearray(f.read_bytes())
        data[-5] ^= 0x01
        f.write_bytes(bytes(data))
    gen = runner.complete(tokens, GREEDY)
    assert gen.output_ids == cold.complete(tokens, GREEDY).output_ids
    # 120 prompt + 7 fed-back tokens: 7 blocks; LRU keeps the last two placed (5, 6) on nvme, 0-4 spill to pfs and
    # are read in one batch, each failing its checksum; block 0 is among them, so no prefix run is left
    assert pfs.stats()["corrupt"] == 5 and gen.cached_tokens == 0


def test_a_full_nvme_tier_refuses_and_requests_stay_correct(loaded, cold, tmp_path):
    block = layout_for(loaded.spec, 16, loaded.dtype).nbytes()
    nvme = NVMeBackend(tmp_path / "nvme", 2, block)
    runner = ModelRunner(loaded, LocalBlockStore(TieredStore([nvme], block)))
    tokens = prompt(150, seed=2)
    for _ in range(2):
        assert runner.complete(tokens, GREEDY).output_ids == cold.complete(tokens, GREEDY).output_ids
    assert len(nvme.table) <= 2


def test_pfs_that_becomes_unwritable_leaves_misses(loaded, cold, tmp_path):
    block = layout_for(loaded.spec, 16, loaded.dtype).nbytes()
    pfs = PFSBackend(tmp_path / "pfs", 256 * block)
    runner = ModelRunner(loaded, LocalBlockStore(TieredStore([pfs], block)))
    shutil.rmtree(pfs.base)
    pfs.base.write_text("not a directory any more")  # the shared mount went away / read-only
    tokens = prompt(80, seed=3)
    first = runner.complete(tokens, GREEDY)
    second = runner.complete(tokens, GREEDY)
    assert first.output_ids == second.output_ids == cold.complete(tokens, GREEDY).output_ids
    # each request computes 5 whole blocks (80 prompt + 7 fed-back tokens) and none lands: 5 refused puts apiece
    assert second.cached_tokens == 0 and pfs.stats()["put_failures"] == 10


def test_mixed_tenants_never_hit_each_others_blocks(loaded, tmp_path):
    """A replay interleaving three tenants over the same prompts: every hit is the tenant's own."""
    runner, _, _ = disk_runner(loaded, tmp_path)
    shared = prompt(64, seed=4)
    for turn in range(3):
        for tenant in ("a", "b", "c"):
            tokens = shared + prompt(16 * turn, seed=10 + turn)
            gen = runner.complete(tokens, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=tenant)
            # first turn: nothing of its own yet (b and c would hit a's 3 usable blocks if salts leaked); later:
            # the 4 shared blocks it stored itself, not the tail, which differs from its previous turn's
            assert gen.cached_tokens == (0 if turn == 0 else 64), (tenant, turn, gen.cached_tokens)
