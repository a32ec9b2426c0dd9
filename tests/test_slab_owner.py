"""An nvme slab has one owner (issue 55): a second opener, in this process or another, is refused with the path and
the owner's pid; closing, being collected or dying releases it. The vLLM connector's stores over one nvme path
claim slabs of their own (`PATH/r0`, `PATH/r1`, ...), each serving its own blocks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcluster.integrations.vllm.store import build_store, engine_stores, parse_config, release_store, shared_store
from kvcluster.keys import KeySpace
from kvcluster.storage import NVMeBackend, SlabInUse, StorageError
from kvcluster.storage.slab_owner import owner_file

SPACE = KeySpace(model="slab-owner")
BLOCK = 16 << 10
REPO = Path(__file__).resolve().parents[1]
HOLD_IN_A_CHILD = ("import sys\nfrom kvcluster.storage import NVMeBackend\n"
                   "held = NVMeBackend(sys.argv[1], 4, 4096)\nprint('held', flush=True)\nsys.stdin.read()\n")


def block(value: int) -> np.ndarray:
    return np.full(BLOCK, value, dtype=np.uint8)


def test_a_second_opener_is_refused_naming_the_slab_and_the_owners_pid(tmp_path: Path) -> None:
    """The issue's reproduction: the second backend on one directory is refused before it writes a byte, so the
    first one's blocks stay whole; once the first is closed, a new one opens."""
    (ka,), (kb,) = SPACE.chain_hash_ids([1]), SPACE.chain_hash_ids([2])
    first = NVMeBackend(tmp_path, 4, 1 << 20)
    assert first.put_many([(ka, block(1))]) == [True]
    with pytest.raises(SlabInUse) as refused:
        NVMeBackend(tmp_path, 4, 1 << 20)
    assert isinstance(refused.value, StorageError)
    assert f"{tmp_path}/kvcluster-nvme.slab" in str(refused.value) and f"pid {os.getpid()}" in str(refused.value)
    assert np.array_equal(first.get_many([ka])[0], block(1)) and first.stats()["corrupt"] == 0
    first.close()
    first.close()  # idempotent
    assert not owner_file(first.path).exists()
    second = NVMeBackend(tmp_path, 4, 1 << 20)
    assert second.put_many([(kb, block(2))]) == [True] and np.array_equal(second.get_many([kb])[0], block(2))
    assert owner_file(second.path).read_text() == f"{os.getpid()}\n"
    second.close()


def test_a_refused_opener_keeps_no_descriptor(tmp_path: Path) -> None:
    held = NVMeBackend(tmp_path, 2, 4096)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(SlabInUse):
            NVMeBackend(tmp_path, 2, 4096)
    assert len(os.listdir("/proc/self/fd")) == before
    held.close()


def test_a_slab_that_cannot_be_reserved_is_released(tmp_path: Path) -> None:
    """fallocate fails (1 PiB): the half-built backend gives the slab up at once, though the error's traceback
    still holds it."""
    with pytest.raises(StorageError, match="not enough free space|cannot reserve") as failed:
        NVMeBackend(tmp_path, 1 << 20, 1 << 30)
    assert not isinstance(failed.value, SlabInUse)
    assert not owner_file(tmp_path / "kvcluster-nvme.slab").exists()
    NVMeBackend(tmp_path, 4, 4096).close()


def test_a_backend_dropped_without_close_releases_its_slab_when_collected(tmp_path: Path) -> None:
    dropped = NVMeBackend(tmp_path, 2, 4096)
    del dropped
    gc.collect()
    NVMeBackend(tmp_path, 2, 4096).close()


def test_a_slab_held_by_another_process_is_refused_with_its_pid_until_that_process_dies(tmp_path: Path) -> None:
    """The child is killed (SIGKILL): no close runs, the kernel drops its lock; the stale pid file it leaves is
    overwritten by the next owner."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", HOLD_IN_A_CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(SlabInUse, match=f"{tmp_path}/kvcluster-nvme.slab is in use by pid {child.pid}:"):
            NVMeBackend(tmp_path, 4, 4096)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert owner_file(tmp_path / "kvcluster-nvme.slab").read_text() == f"{child.pid}\n"  # it died holding it
    mine = NVMeBackend(tmp_path, 4, 4096)
    assert owner_file(mine.path).read_text() == f"{os.getpid()}\n"
    mine.close()


def connector_config(root: Path):
    """Two dram blocks in front of an nvme tier: most blocks a store keeps are demoted to its slab."""
    return parse_config({"tiers": [{"kind": "dram", "capacity": f"{2 * BLOCK}B"},
                                   {"kind": "nvme", "capacity": "1MiB", "path": str(root / "nvme")}],
                         "policy": "lru"})


def nvme_of(store):
    (nvme,) = [b for b in store.tiered.backends if isinstance(b, NVMeBackend)]
    return nvme


def test_two_connector_stores_over_one_nvme_path_claim_slabs_of_their_own(tmp_path: Path) -> None:
    """Two replicas on a node given one config: r0 and r1, each reading back exactly its own blocks from its slab
    (with one shared slab each would overwrite the other's slots, and every read of the first be corrupt)."""
    config = connector_config(tmp_path)
    stores = [build_store(config, BLOCK), build_store(config, BLOCK)]
    assert [nvme_of(s).path for s in stores] == [tmp_path / "nvme" / f"r{i}" / "kvcluster-nvme.slab" for i in (0, 1)]
    chains = [SPACE.chain_hash_ids(list(range(100 * r, 100 * r + 8))) for r in (0, 1)]
    for r, (store, keys) in enumerate(zip(stores, chains)):
        for j, key in enumerate(keys):  # one request per block: the older ones go down to nvme
            store.store([key], [block(16 * r + j + 1)])
    for r, (store, keys) in enumerate(zip(stores, chains)):
        got = store.fetch(keys)
        assert len(got) == 8 and all(np.array_equal(g, block(16 * r + j + 1)) for j, g in enumerate(got))
        stats = nvme_of(store).stats()
        assert stats["gets"] >= 6 and stats["corrupt"] == 0, stats
        store.tiered.check_integrity()
    for store in stores:
        nvme_of(store).close()


def test_an_engines_slab_is_released_by_its_last_connector_and_claimed_again(tmp_path: Path) -> None:
    """The scheduler's and the worker's connector share one store: the first to shut down leaves the slab held,
    the last closes it, and the engine started next takes r0 again instead of a new slab."""
    config = connector_config(tmp_path)
    first = shared_store("slab-owner-a", config, BLOCK)
    assert shared_store("slab-owner-a", config, BLOCK) is first  # its second connector
    slab = nvme_of(first.local).path
    try:
        release_store("slab-owner-a")
        assert "slab-owner-a" in engine_stores()
        with pytest.raises(SlabInUse):
            NVMeBackend(slab.parent, 4, BLOCK)
        release_store("slab-owner-a")
        assert "slab-owner-a" not in engine_stores()
        again = shared_store("slab-owner-b", config, BLOCK)
        assert nvme_of(again.local).path == slab == tmp_path / "nvme" / "r0" / "kvcluster-nvme.slab"
    finally:
        release_store("slab-owner-a")
        release_store("slab-owner-b")
    assert not engine_stores().keys() & {"slab-owner-a", "slab-owner-b"}
