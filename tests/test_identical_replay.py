"""An identical replay that fits in the tiers is served from them: nothing acknowledged is lost on the way down.

The first records of the shared Mooncake trace, scaled down 32x in length (each 512-token
hash block becomes one 16-token block, so shared hash ids are shared prefixes), run twice through a
replica's store over real tier actors: a dram tier too small for them, so the control
plane's policy demotes to nvme (the staged path payloads from the object store take) and on
to pfs. Once the first pass's writes and moves have settled, the second pass must find every
whole block of each prompt but the one holding its last token (always computed): a block
lost anywhere (a write refused, a demotion that dropped it, a corrupt read) cuts a
conversation's reuse from there on. No prompt here is a whole number of blocks, so the
second pass stores nothing and starts no moves that could race its reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from kvcluster.actors.cluster import down, up  # noqa: E402
from kvcluster.actors.node_control_actor import control_name  # noqa: E402
from kvcluster.actors.index_actor import INDEX_NAME, NAMESPACE  # noqa: E402
from kvcluster.actors.tier_actor import actor_name  # noqa: E402
from kvcluster.cluster_config import load_cluster_config  # noqa: E402
from kvcluster.serving.block_store import LocalBlockStore  # noqa: E402
from kvcluster.serving.models import load_model  # noqa: E402
from kvcluster.serving.runner import ModelRunner  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402
from kvcluster.storage import hbm_backend  # noqa: E402
from kvcluster.storage.tiered import TieredStore  # noqa: E402
from kvcluster.serve_apps.cluster_store import ClusterBlockStore  # noqa: E402

from data_support import require_data  # noqa: E402

pytestmark = pytest.mark.slow
RECORDS = 24
SCALE = 32  # Mooncake's 512-token hash blocks become 16 tokens: one block each
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def mooncake_prompts(n: int, scale: int = SCALE) -> list[list[int]]:
    """Token ids for the first `n` Mooncake records: each hash id is a fixed run of 512/scale token ids."""
    per_hash = 512 // scale
    prompts = []
    with open(require_data("mooncake", "synthetic_trace.jsonl")) as f:
        for line, _ in zip(f, range(n)):
            record = json.loads(line)
            ids: list[int] = []
            for h in record["hash_ids"]:
                ids += [int(t) for t in np.random.default_rng(h).integers(3, 32000, per_hash)]
            prompts.append(ids[: max(1, record["input_length"] // scale)])
    return prompts


def test_an_identical_replay_reuses_every_usable_prompt_block(tmp_path):
    prompts = mooncake_prompts(RECORDS)
    unique_blocks = len({tuple(p[: 16 * (b + 1)]) for p in prompts for b in range(len(p) // 16)})
    root = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    cfg_path = tmp_path / "cluster.yaml"
    block_gib = 16 * 8192 / (1 << 30)  # kvcluster-tiny-llama, fp32: 8 KiB per token
    cfg_path.write_text(
        f"model: kvcluster-tiny-llama\nblock_tokens: 16\ncheckpoint_dir: {root}/pfs/predictor\nnodes:\n"
        f"  - name: n0\n    tiers:\n"
        f"      - {{kind: dram, capacity: {block_gib * unique_blocks / 4:.6f}GiB}}\n"  # a quarter fits in dram
        f"      - {{kind: nvme, capacity: {block_gib * unique_blocks * 1.5:.6f}GiB, path: {root}/nvme}}\n"
        f"      - {{kind: pfs, capacity: {block_gib * unique_blocks * 2:.6f}GiB, path: {root}/pfs}}\n")
    cfg = load_cluster_config(str(cfg_path))
    os.environ["RAY_TMPDIR"] = root
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             namespace=NAMESPACE, _temp_dir=root, log_to_driver=False)
    try:
        up(cfg)
        runner = ModelRunner(load_model("kvcluster-tiny-llama"))
        block = runner.layout.nbytes()
        hbm = LocalBlockStore(TieredStore([hbm_backend(64, block)], block))  # far smaller than one pass
        runner.store = ClusterBlockStore(hbm, "n0")
        for prompt in prompts:
            runner.complete(prompt, ONE_TOKEN)
        control = ray.get_actor(control_name("n0"), namespace=NAMESPACE)
        index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        usable = [runner.block_keys(p[: (len(p) - 1) // 16 * 16]) for p in prompts]
        assert all(len(p) % 16 for p in prompts)  # the second pass computes no whole block, so stores nothing
        seen: set = set()
        commits = 0  # a prompt commits to the control plane when it computed a block no earlier prompt had
        for keys in usable:
            commits += any(k not in seen for k in keys)
            seen.update(keys)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # every commit placed (they are fire-and-forget) and indexed
            placed = ray.get(control.stats.remote())["stores"] == commits
            if placed and all(ray.get(index.longest_prefix.remote(k)).length == len(k) for k in usable):
                break
            time.sleep(0.5)
        cached = sum(runner.complete(p, ONE_TOKEN).cached_tokens for p in prompts)
        total = sum(len(p) for p in prompts)
        control_stats = ray.get(control.stats.remote())
        occupancy = control_stats["occupancy"]
        stats = {t: ray.get(ray.get_actor(actor_name("n0", t), namespace=NAMESPACE).stats.remote())
                 for t in ("dram", "nvme", "pfs")}
        print(f"\nidentical replay: {cached}/{total} prompt tokens cached ({cached / total:.3f}); "
              f"unique blocks {unique_blocks}; placed {occupancy}, {control_stats['written']} written")
        assert occupancy["n0/nvme"] > 0 and occupancy["n0/dram"] <= cfg.slots(cfg.nodes[0].tiers[0])  # demoted
        assert control_stats["move_failures"] == control_stats["refused"] == 0  # every move the policy decided landed
        assert control_stats["payload_bytes"] == 0  # the replicas wrote their blocks into the tiers themselves
        assert all(s.get("corrupt", 0) == 0 and s.get("put_failures", 0) == 0 for s in stats.values()), stats
        assert cached == sum(len(k) * 16 for k in usable), (cached, total, control_stats)
        runner.store.close()  # its saver thread's last calls are made while Ray is up
        down(cfg)
    finally:
        ray.shutdown()
