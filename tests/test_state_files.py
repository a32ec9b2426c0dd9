"""State a cluster leaves on disk: a new cluster never reads an old nvme slab; `down --purge` removes exactly it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvcluster.cli import main
from kvcluster.cluster_config import load_cluster_config
from kvcluster.keys import KeySpace
from kvcluster.state_files import purge, state_paths
from kvcluster.storage import NVMeBackend, PFSBackend


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: kvcluster-tiny-llama\nblock_tokens: 16\ncheckpoint_dir: {tmp_path}/pfs/predictor\n"
                    f"nodes:\n  - name: n0\n    tiers:\n      - {{kind: dram, capacity: 0.01GiB}}\n"
                    f"      - {{kind: nvme, capacity: 0.01GiB, path: {tmp_path}/nvme}}\n"
                    f"      - {{kind: pfs, capacity: 0.01GiB, path: {tmp_path}/pfs}}\n"
                    f"  - name: n1\n    ray_resource: n1\n    tiers:\n"
                    f"      - {{kind: nvme, capacity: 0.01GiB, path: {tmp_path}/nvme}}\n"
                    f"      - {{kind: pfs, capacity: 0.01GiB, path: {tmp_path}/pfs}}\n")
    return path


def test_a_new_nvme_tier_on_an_old_slab_holds_nothing(tmp_path: Path) -> None:
    """The slot index lives in memory: a later cluster's tier on the same slab file serves none of its bytes."""
    keys = KeySpace(model="state").chain_hash_ids([1, 2, 3])
    data = [np.full(4096, i + 1, dtype=np.uint8) for i in range(3)]
    first = NVMeBackend(tmp_path / "nvme", 8, 4096)
    assert first.put_many(list(zip(keys, data))) == [True] * 3
    first.close()
    again = NVMeBackend(tmp_path / "nvme", 8, 4096)
    assert again.get_many(keys) == [None] * 3 and again.contains(keys) == [False] * 3
    assert again.stats()["corrupt"] == 0 and again.used_bytes == 0
    new = [np.full(4096, 9, dtype=np.uint8)]
    assert again.put_many([(keys[0], new[0])]) == [True]  # the slot is reused: the new bytes, checked
    assert np.array_equal(again.get_many(keys[:1])[0], new[0])


def test_purge_removes_the_clusters_files_and_nothing_else(tmp_path: Path) -> None:
    cfg = load_cluster_config(str(_config(tmp_path)))
    assert [str(p) for p in state_paths(cfg)] == [f"{tmp_path}/nvme/n0/kvcluster-nvme.slab",
                                                  f"{tmp_path}/nvme/n0/kvcluster-nvme.slab.owner", f"{tmp_path}/pfs/kv",
                                                  f"{tmp_path}/nvme/n1/kvcluster-nvme.slab",
                                                  f"{tmp_path}/nvme/n1/kvcluster-nvme.slab.owner",
                                                  f"{tmp_path}/pfs/predictor/predictor.json"]
    NVMeBackend(tmp_path / "nvme" / "n0", 4, 4096).close()
    pfs = PFSBackend(tmp_path / "pfs", 1 << 20)
    pfs.put_many([(KeySpace(model="state").chain_hash_ids([7])[0], np.ones(4096, dtype=np.uint8))])
    (tmp_path / "pfs" / "predictor").mkdir()
    (tmp_path / "pfs" / "predictor" / "predictor.json").write_text("{}")
    keep = [tmp_path / "nvme" / "n0" / "notes.txt", tmp_path / "pfs" / "mine.bin"]
    for path in keep:
        path.write_text("not kvcluster's")
    assert purge(cfg) == [f"{tmp_path}/nvme/n0/kvcluster-nvme.slab", f"{tmp_path}/pfs/kv",
                          f"{tmp_path}/pfs/predictor/predictor.json"]
    assert all(path.read_text() == "not kvcluster's" for path in keep)
    assert purge(cfg) == []


def test_down_purge_without_a_running_cluster_still_removes_the_files(tmp_path: Path, capsys) -> None:
    cfg_path = _config(tmp_path)
    NVMeBackend(tmp_path / "nvme" / "n0", 4, 4096).close()
    assert main(["cluster", "down", str(cfg_path), "--purge", "--address", "127.0.0.1:9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"killed": [], "purged": [f"{tmp_path}/nvme/n0/kvcluster-nvme.slab"]}
    assert main(["cluster", "status", str(cfg_path), "--purge", "--address", "127.0.0.1:9"]) == 2
    assert "--purge goes with down only" in capsys.readouterr().err


def test_purge_removes_the_owner_file_a_dead_owner_left_and_it_is_the_backends(tmp_path: Path) -> None:
    """A process killed while it held a slab leaves its pid file (the lock itself went with the process)."""
    cfg = load_cluster_config(str(_config(tmp_path)))
    slab, owner = state_paths(cfg)[:2]
    held = NVMeBackend(slab.parent, 4, 4096)
    assert owner.read_text() == f"{os.getpid()}\n"  # the very file the backend records its owner in
    held.close()
    assert not owner.exists()
    owner.write_text("4194304\n")  # as a killed owner leaves it
    assert purge(cfg) == [str(slab), str(owner)]
    assert not slab.exists() and not owner.exists()
