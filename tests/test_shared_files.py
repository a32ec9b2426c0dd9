"""The shared filesystem as engines reach it (kvcluster.serving.shared_files): written behind by one engine,
read by another; a run ends at the first block missing or corrupt, never wrong bytes. And the cluster link's
settings (`ClusterLink`): `node: auto`, the node's share, the shared directory, each refused by name when bad."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcluster.errors import ConfigError
from kvcluster.integrations.vllm.store import ClusterLink, parse_config
from kvcluster.keys import KeySpace
from kvcluster.serving.shared_files import SharedFiles
from kvcluster.storage.pfs import PFSBackend

KEYS = KeySpace(model="shared").chain_hash_ids(list(range(6)))
BLOCKS = [np.full(8192, i + 1, dtype=np.uint8) for i in range(6)]


def test_one_engine_writes_behind_and_another_reads_the_leading_run(tmp_path: Path) -> None:
    writer = SharedFiles(PFSBackend(tmp_path, 1 << 20))
    reader = SharedFiles(PFSBackend(tmp_path, 1 << 20))  # another engine, another node: the same directory
    assert writer.write({bytes(k): b for k, b in zip(KEYS[:4], BLOCKS[:4])}) == 4
    assert writer.write({bytes(KEYS[0]): BLOCKS[0]}) == 1  # on file already: not written again
    assert reader.prefix(KEYS) == 4
    out = [np.zeros(8192, dtype=np.uint8) for _ in KEYS]
    run = reader.read(KEYS, out)
    assert len(run) == 4 and all(np.array_equal(got, want) for got, want in zip(run, BLOCKS))
    assert all(np.array_equal(out[i], BLOCKS[i]) for i in range(4)) and not out[4].any()
    assert reader.read(KEYS[4:]) == [] and reader.counters["read"] == 4


def test_a_corrupt_file_ends_the_run_as_a_miss(tmp_path: Path) -> None:
    files = SharedFiles(PFSBackend(tmp_path, 1 << 20))
    files.write({bytes(k): b for k, b in zip(KEYS[:3], BLOCKS[:3])})
    path = files.backend.path_for(KEYS[1])
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    run = files.read(KEYS[:3])
    assert len(run) == 1 and np.array_equal(run[0], BLOCKS[0])  # block 1 fails its checksum: the run ends
    assert files.backend.stats()["corrupt"] == 1


def test_a_full_directory_refuses_what_does_not_fit(tmp_path: Path) -> None:
    files = SharedFiles(PFSBackend(tmp_path, 2 * 8192))
    assert files.write({bytes(k): b for k, b in zip(KEYS[:3], BLOCKS[:3])}) == 2
    assert files.counters == {"written": 2, "refused": 1, "read": 0}


def test_the_cluster_link_joins_its_own_ray_node_by_default_and_names_bad_fields(tmp_path: Path) -> None:
    link = ClusterLink()
    assert (link.node, link.tiers, link.shared) == ("auto", None, None)
    config = parse_config({"tiers": [{"kind": "dram", "capacity": "8MiB"}],
                           "cluster": {"tiers": [{"kind": "nvme", "capacity": "1GiB", "path": str(tmp_path)},
                                                 {"kind": "dram", "capacity": "64MiB"}],
                                       "shared": {"kind": "pfs", "capacity": "1GiB", "path": str(tmp_path)}}})
    assert [t.kind for t in config.cluster.tiers] == ["dram", "nvme"]  # fastest first
    bad = [({"tiers": [{"kind": "pfs", "capacity": "1GiB", "path": str(tmp_path)}]},
            "cluster.tiers", "a node's share of the cluster runs no pfs tier"),
           ({"shared": {"kind": "dram", "capacity": "1GiB"}}, "cluster.shared", "runs no dram tier"),
           ({"shared": {"kind": "pfs", "capacity": "1GiB"}}, "cluster.shared", "needs a directory"),
           ({"policy": "mru"}, "cluster.policy", "unknown policy 'mru'"),
           ({"node": ""}, "cluster.node", "at least 1 character")]
    for cluster, field, message in bad:
        with pytest.raises(ConfigError) as err:
            parse_config({"tiers": [{"kind": "dram", "capacity": "8MiB"}], "cluster": cluster})
        assert field in str(err.value) and message in str(err.value), str(err.value)


def test_a_node_share_that_holds_no_block_is_refused_by_name_before_anything_starts(monkeypatch) -> None:
    """`cluster.tiers` smaller than one of the engine's blocks: a ConfigError naming the field, before any actor
    starts (no Ray call is made: the node id comes from the patched runtime context)."""
    from types import SimpleNamespace

    from kvcluster.actors import node_parts
    from kvcluster.serve_apps.engine_cluster import EngineCluster

    monkeypatch.setattr(node_parts.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(node_parts, "start_global_actors", lambda *a, **k: pytest.fail("an actor was started"))
    link = ClusterLink(tiers=[{"kind": "dram", "capacity": "1MiB"}])
    with pytest.raises(ConfigError) as err:
        EngineCluster(link).node(block_bytes=2 << 20)
    assert str(err.value).startswith("kv_connector_extra_config.cluster.tiers: ")
    assert "holds no 2097152-byte block" in str(err.value)
