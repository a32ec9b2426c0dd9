"""pfs puts: a block file is whole after the write is cut short anywhere (header or payload), and a payload that
differs from its given digest leaves no file at all."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvcluster.keys import KeySpace
from kvcluster.storage import PFSBackend, checksum
from kvcluster.storage import pfs as pfs_module

SPACE = KeySpace(model="pfs-write")


@pytest.mark.parametrize("cap", [7, 4096, 40_000])
def test_short_writes_are_continued_to_a_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cap: int) -> None:
    real = os.pwrite
    calls = []

    def short(fd: int, data, offset: int) -> int:  # a write the kernel cut after `cap` bytes
        calls.append(offset)
        return real(fd, bytes(data)[:cap], offset)

    monkeypatch.setattr(pfs_module.os, "pwrite", short)
    keys = SPACE.chain_hash_ids([1, 2])
    data = [np.random.default_rng(i).integers(0, 255, 100_003, dtype=np.uint8) for i in range(2)]
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(keys, data))) == [True, True]
    assert len(calls) > 4  # the cut writes were continued (payload and header of each file)
    monkeypatch.undo()
    assert all(np.array_equal(g, d) for g, d in zip(PFSBackend(tmp_path, 1 << 30).get_many(keys), data))


def test_a_payload_unlike_its_digest_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    keys = SPACE.chain_hash_ids([3, 4])
    data = [np.full(50_000, i, dtype=np.uint8) for i in range(2)]
    pfs = PFSBackend(tmp_path, 1 << 30)
    assert pfs.put_many(list(zip(keys, data)), [checksum(data[0]), checksum(data[0])]) == [True, False]
    assert pfs.contains(keys) == [True, False] and pfs.stats()["digest_mismatches"] == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [f"{bytes(keys[0]).hex()}.kvb"]
