"""KVClusterConnector under tensor parallelism: two vLLM workers, each in its own process with its own shard.

Each worker keeps its shard of every block in tiers of its own (file tiers in `PATH/tp{rank}-of-2`), under
its own key (`shard_key`); the scheduler, in the engine process, knows what they hold only from their
per-step reports (and, on a cluster, from the cluster's index), and promises a block only when both can
load it. The reference is the prompt served from the same engine's own prefix cache (vLLM's blocks, never
kvcluster's): the same KV through the same kernels, so the log-probabilities match bit for bit. That the
connector leaves a cold prefill as vLLM computes it alone is checked against an engine without it, once, in
test_vllm_connector.py; a second two-worker engine here would only add a minute of start-up.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; run `bash scripts/setup.sh`")

from test_vllm_connector import (BLOCK, FINGERPRINT, KEYS, OPEN_ENGINES, close, engines_closed,  # noqa: E402,F401
                                 generate, model_dir, two_nodes)

from kvcluster.keys import shard_key  # noqa: E402
from kvcluster.storage import PFSBackend  # noqa: E402

TP = 2
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def two_workers():
    """vLLM's CPU workers bind their OpenMP threads to NUMA nodes; a machine with one node needs them named."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // TP)
    binds = [cores[min(r * per, len(cores) - 1):][:per] for r in range(TP)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, b)) for b in binds))
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function of this test
        yield


def tp_engine(model_dir, tiers: list[dict], cluster: dict | None = None):
    extra = {"tiers": tiers, "model_fingerprint": FINGERPRINT} | ({"cluster": cluster} if cluster else {})
    transfer = {"kv_connector": "KVClusterConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_module_path": "kvcluster.integrations.vllm.connector", "kv_connector_extra_config": extra}
    llm = vllm.LLM(model=str(model_dir), load_format="dummy", enforce_eager=True, dtype="float32", seed=0,
                   enable_prefix_caching=True, max_model_len=2048, tensor_parallel_size=TP,
                   distributed_executor_backend="mp", kv_transfer_config=transfer)
    OPEN_ENGINES.append(llm)
    return llm


def _worker_counts(worker) -> tuple[int, int, int, int, int, int]:
    """In a worker: (blocks loaded, failed, saved) by its connector, once its background saves are in, and the
    blocks its cluster store read over NIXL, of those the ones written straight into the paged KV and the ones
    read from another engine's lent paged KV (0, 0, 0 without a cluster)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    shared = get_kv_transfer_group()._shared
    shared.wait_saved()
    counters = shared.store.counters if shared.store is not shared.local else {}
    return (shared.loaded_blocks, shared.failed_blocks, shared.saved_blocks, counters.get("nixl_blocks", 0),
            counters.get("nixl_in_place", 0), counters.get("lent_pages", 0))


def counts(llm) -> list[tuple[int, int, int]]:
    return [tuple(c)[:3] for c in llm.collective_rpc(_worker_counts)]


def cold_then_warm(llm) -> tuple[tuple, tuple]:
    """The prompt computed (each worker saves its shard of the 4 full blocks), then from vLLM's prefix cache."""
    cold = generate(llm)
    counts_after_cold = counts(llm)
    warm = generate(llm)
    assert (cold[2], warm[2]) == (0, 4 * BLOCK) and cold[0] == warm[0]
    assert counts(llm) == counts_after_cold == [(0, 0, 4), (0, 0, 4)]  # vLLM answered: nothing loaded or stored
    return cold, warm


def test_two_tensor_parallel_workers_each_store_their_shard_and_a_fresh_engine_loads_both(
        model_dir, two_workers, tmp_path) -> None:
    tiers = [{"kind": "pfs", "capacity": "8MiB", "path": str(tmp_path / "pfs")}]
    llm = tp_engine(model_dir, tiers)
    cold, warm = cold_then_warm(llm)
    assert sorted(os.listdir(tmp_path / "pfs")) == ["tp0-of-2", "tp1-of-2"]
    llm.reset_prefix_cache()
    assert generate(llm) == warm  # the prefix from both workers' tiers, bit for bit vLLM's own
    assert counts(llm) == [(4, 0, 4), (4, 0, 4)]
    close(llm)

    llm = tp_engine(model_dir, tiers)  # a fresh engine: only the block files remain
    assert generate(llm) == warm
    assert counts(llm) == [(4, 0, 0), (4, 0, 0)]

    shard = PFSBackend(tmp_path / "pfs" / "tp1-of-2", 8 << 20).path_for(shard_key(KEYS[2], 1, TP))  # worker 1's
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    llm.reset_prefix_cache()
    tokens, logprobs, _ = generate(llm)
    assert tokens == cold[0]  # worker 1 reported blocks 2-3 as load errors: both workers recomputed them
    assert logprobs == pytest.approx(cold[1], abs=1e-4)
    assert counts(llm) == [(8, 0, 0), (6, 2, 1)]  # worker 1 stored its block 2 again; worker 0 held both
    llm.reset_prefix_cache()
    assert generate(llm) == warm  # worker 1's report of the new block 2 reached the scheduler
    assert counts(llm) == [(12, 0, 0), (10, 2, 1)]
    close(llm)


def test_on_a_cluster_each_worker_loads_its_shard_from_another_nodes_dram(model_dir, two_workers,
                                                                          two_nodes) -> None:
    """Two-worker engines on a two-node cluster: the engine on n0 saves; the control plane places both workers'
    shards in n0's dram tier actor, and each worker lends its shards from its paged KV. A fresh engine on n1
    holds nothing itself: its scheduler asks the cluster's index for both workers' shards, and each worker
    reads its own over NIXL, from the pages of the same rank on n0 while that engine runs, from n0's slab
    once it has shut down."""
    import ray

    from kvcluster.actors.index_client import IndexClient

    local = [{"kind": "dram", "capacity": "8MiB"}]
    link = {"node": "n0", "address": ray.get_runtime_context().gcs_address}
    lender = tp_engine(model_dir, local, link)
    _, warm = cold_then_warm(lender)
    shards = [[shard_key(k, r, TP) for k in KEYS] for r in range(TP)]
    index = IndexClient.connect()
    deadline = time.monotonic() + 300
    lent = [("n0", f"hbm/tp{r}-of-{TP}") for r in range(TP)]  # each worker's pages: a tier of its own
    while index.held_runs(shards) != [4, 4] or not all(
            lent[r] in locs for r, s in enumerate(shards) for locs in index.longest_prefix(s).locations):
        assert time.monotonic() < deadline, f"the cluster indexed {index.held_runs(shards)} of each worker's 4"
        time.sleep(0.2)  # the control plane's placement and the workers' lending are both fire-and-forget
    assert index.held_runs([KEYS]) == [0]  # only the shards are stored, never a whole block

    llm = tp_engine(model_dir, local, link | {"node": "n1"})
    assert generate(llm) == warm  # vLLM's own log-probabilities
    # each worker's 4 shards came over NIXL from its rank's pages on n0, straight into its own paged KV
    assert [tuple(c) for c in llm.collective_rpc(_worker_counts)] == [(4, 0, 0, 4, 4, 4), (4, 0, 0, 4, 4, 4)]
    close(llm)
    close(lender)  # its workers retire their pages: the index keeps n0's dram copies only

    llm = tp_engine(model_dir, local, link | {"node": "n1"})
    assert generate(llm) == warm
    assert [tuple(c) for c in llm.collective_rpc(_worker_counts)] == [(4, 0, 0, 4, 4, 0), (4, 0, 0, 4, 4, 0)]
    close(llm)
