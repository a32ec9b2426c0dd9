"""Blocks on pfs and the predictor's posteriors survive a full cluster restart (two Ray sessions)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from kvcluster.actors.cluster import down, up  # noqa: E402
from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE  # noqa: E402
from kvcluster.actors.predictor_actor import PREDICTOR_NAME  # noqa: E402
from kvcluster.block_types import BlockType, TransitionType, pair_index  # noqa: E402
from kvcluster.cluster_config import load_cluster_config  # noqa: E402
from kvcluster.serving.block_store import LocalBlockStore  # noqa: E402
from kvcluster.serving.models import load_model  # noqa: E402
from kvcluster.serving.runner import ModelRunner  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402
from kvcluster.storage import hbm_backend  # noqa: E402
from kvcluster.storage.tiered import TieredStore  # noqa: E402
from kvcluster.serve_apps.cluster_store import ClusterBlockStore  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def start_ray(tmp: str) -> None:
    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             namespace=NAMESPACE, _temp_dir=tmp, log_to_driver=False)


def replica_store(runner: ModelRunner) -> ClusterBlockStore:
    block = runner.layout.nbytes()
    hbm = LocalBlockStore(TieredStore([hbm_backend(64, block)], block))  # a fresh replica: empty hbm
    return ClusterBlockStore(hbm, "n0")


def test_pfs_blocks_and_posteriors_survive_a_full_restart(tmp_path):
    shared = tempfile.mkdtemp(prefix="kvd", dir="/tmp")
    cfg_path = tmp_path / "cluster.yaml"
    cfg_path.write_text(f"model: kvcluster-tiny-llama\nblock_tokens: 16\ncheckpoint_dir: {shared}/pfs/predictor\n"
                        f"predictor: {{prior_alpha: 3.0, pair_priors: {{tool/fork: [1.0, 7.0]}}}}\n"
                        f"nodes:\n  - name: n0\n    tiers: [{{kind: pfs, capacity: 0.1GiB, path: {shared}/pfs}}]\n")
    cfg = load_cluster_config(str(cfg_path))
    loaded = load_model("kvcluster-tiny-llama")
    tokens = [int(t) for t in np.random.RandomState(5).randint(3, 32000, 130)]
    cold = ModelRunner(loaded).complete(tokens, GREEDY)

    start_ray(tempfile.mkdtemp(prefix="kvd1", dir="/tmp"))
    try:
        up(cfg)
        runner = ModelRunner(loaded)
        runner.store = replica_store(runner)
        first = runner.complete(tokens, GREEDY)  # computes everything, writes its blocks through to pfs
        assert first.output_ids == cold.output_ids and first.stored_blocks == 8
        runner.complete(tokens[:100], GREEDY)  # a reuse of the prefix: the predictor learns from it
        predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
        deadline = time.monotonic() + 300
        while ray.get(predictor.snapshot.remote()).version == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        keys = runner.block_keys(tokens[:128])
        while ray.get(index.longest_prefix.remote(keys)).length < 8 and time.monotonic() < deadline:
            time.sleep(0.2)  # the write-through is fire-and-forget
        before = ray.get(predictor.snapshot.remote())
        assert before.version > 0  # a bound: it counts update batches (replica and tier events), grouped by timing
        tool_fork = pair_index(BlockType.TOOL, TransitionType.FORK)
        assert (before.alpha[tool_fork], before.beta[tool_fork]) == (1.0, 7.0)  # the YAML's priors, untouched pair
        assert before.alpha[pair_index(BlockType.OUTPUT, TransitionType.FORK)] == 3.0
        runner.store.close()  # its saver thread's last calls are made while Ray is up
        down(cfg)  # checkpoints the predictor, kills every actor
    finally:
        ray.shutdown()  # the whole cluster is gone: only files remain

    start_ray(tempfile.mkdtemp(prefix="kvd2", dir="/tmp"))
    try:
        up(cfg)
        predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
        after = ray.get(predictor.snapshot.remote())
        assert after.alpha == before.alpha and after.beta == before.beta  # posteriors restored
        index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        deadline = time.monotonic() + 300
        while ray.get(index.longest_prefix.remote(keys)).length < 8 and time.monotonic() < deadline:
            time.sleep(0.2)  # the restarted pfs tier announces the files it found (one batched event)
        runner = ModelRunner(loaded)
        runner.store = replica_store(runner)
        again = runner.complete(tokens, GREEDY)
        assert again.cached_tokens == 128  # 8 blocks read back from pfs, checksums verified
        assert again.output_ids == cold.output_ids
        assert runner.store.counters["pfs"] == 8
        runner.store.close()
        down(cfg)
    finally:
        ray.shutdown()
