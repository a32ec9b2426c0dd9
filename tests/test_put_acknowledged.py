"""A put that returns True has exactly those bytes on the medium, on every backend and every put path.

Each example writes a batch of distinct random blocks through one path (in place or staged,
page-aligned or merely 64-byte aligned as payloads arriving through Ray are, small or >= 1 MiB
batches that hand copies to a pool thread, with or without the digests a demotion brings) while
another process keeps the second core busy, and then reads every acknowledged block back byte for
byte. A write issued before its staging copy finished shows up here as a checksum mismatch on read.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcluster.keys import KeySpace
from kvcluster.storage import (NVMeBackend, NixlPeerPool, PFSBackend, RDMABackend, checksum, cxl_backend,
                               dram_backend, hbm_backend)
from kvcluster.storage.aligned import aligned_empty

SPACE = KeySpace(model="acknowledged")
SLOT = 128 << 10  # 16 blocks of a batch make 2 MiB: large enough for the pool-thread paths
SLOTS = 80
BACKENDS = ["hbm", "dram", "cxl", "nvme", "pfs", "rdma", "rdma-registered"]
_salts = itertools.count()


@pytest.fixture(scope="module")
def busy_core():
    """A second process spinning, so pool threads wake late as they do under load."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spinner.kill()
    spinner.wait()


@pytest.fixture(scope="module")
def tiers(tmp_path_factory, busy_core) -> dict:
    root: Path = tmp_path_factory.mktemp("acknowledged")
    rdma_registered = RDMABackend(NixlPeerPool(SLOTS, SLOT), SLOT, SLOTS, lanes=2)
    rows = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    rdma_registered.register(rows)
    made = {
        "hbm": hbm_backend(SLOTS, SLOT),
        "dram": dram_backend(SLOTS, SLOT),
        "cxl": cxl_backend(SLOTS, SLOT),
        "nvme": NVMeBackend(root / "nvme", SLOTS, SLOT),
        "pfs": PFSBackend(root / "pfs", SLOTS * SLOT),
        "rdma": RDMABackend(NixlPeerPool(SLOTS, SLOT), 4 << 20, SLOTS, lanes=2),
        "rdma-registered": rdma_registered,
    }
    made["rdma-registered-rows"] = rows.numpy()
    return made


def _payloads(n: int, nbytes: int, seed: int, page_aligned: bool, rows: np.ndarray | None) -> list[np.ndarray]:
    """Distinct random blocks, page-aligned or 64 bytes past a page (aligned for SIMD, not for O_DIRECT)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if rows is not None:  # registered memory of the rdma client: the direct path
            view = rows[i][:nbytes]
        else:
            offset = 0 if page_aligned else 64
            view = aligned_empty(nbytes + 4096)[offset : offset + nbytes]
        view[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append(view)
    return out


def _round_trip(tiers: dict, name: str, n: int, nbytes: int, page_aligned: bool, with_digests: bool) -> None:
    backend = tiers[name]
    rows = tiers["rdma-registered-rows"] if name == "rdma-registered" else None
    salt = next(_salts)
    keys = SPACE.chain_hash_ids(list(range(n)), cache_salt=f"s{salt}")
    data = _payloads(n, nbytes, salt, page_aligned, rows)
    expected = [bytes(d) for d in data]
    digests = [checksum(d) for d in data] if with_digests else None
    acknowledged = backend.put_many(list(zip(keys, data)), digests)
    assert all(acknowledged), (name, acknowledged)
    got = backend.get_many(keys)
    for i, block in enumerate(got):
        assert block is not None and bytes(block) == expected[i], (name, i, backend.stats())
    assert backend.stats().get("corrupt", 0) == 0, backend.stats()
    assert backend.delete(keys) == n
    backend.check_integrity()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("page_aligned", [False, True])
def test_large_batches_in_a_row_are_all_intact(tiers, name, page_aligned) -> None:
    """Demotion-sized batches (64 x 128 KiB) back to back: the load under which staged copies raced their writes."""
    for _ in range(8):
        _round_trip(tiers, name, 64, SLOT, page_aligned, with_digests=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(BACKENDS), n=st.sampled_from([1, 3, 16, 64]),
       nbytes=st.sampled_from([4096, 12_352, SLOT]), page_aligned=st.booleans(), with_digests=st.booleans(),
       rounds=st.integers(1, 3))
def test_every_acknowledged_block_reads_back_byte_for_byte(tiers, name, n, nbytes, page_aligned, with_digests,
                                                           rounds) -> None:
    for _ in range(rounds):  # later rounds reuse stages and slots the earlier ones filled
        _round_trip(tiers, name, n, nbytes, page_aligned, with_digests)
