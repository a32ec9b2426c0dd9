"""Prefix-aware routing end to end: two Ray nodes, one model replica on each, the OpenAI endpoint in front.

A conversation's blocks are written to the dram tier of the node whose replica served it first; the ingress
asks the index which node holds the longest prefix and the router sends every later turn there. Random
routing would keep all 16 follow-ups on their first node with probability 2^-16.
"""

from __future__ import annotations

import os
import tempfile

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from kvcluster.actors.ray_start import start_ray  # noqa: E402
from kvcluster.serving.sampling import SamplingParams  # noqa: E402

from serving_support import DOC, MODEL, _free_port, expected_cached  # noqa: E402

pytestmark = pytest.mark.slow
NODE_HEADER = "x-kvcluster-node"


@pytest.fixture(scope="module")
def two_node_endpoint():
    from kvcluster.serve_apps.app import build_app

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    cluster_yaml = os.path.join(tmp, "cluster.yaml")
    with open(cluster_yaml, "w") as f:
        f.write(f"model: {MODEL}\nblock_tokens: 16\ncheckpoint_dir: {tmp}/pfs/predictor\nnodes:\n"
                "  - name: head\n    tiers: [{kind: dram, capacity: 0.05GiB}]\n"
                "  - name: node-b\n    ray_resource: node_b\n    tiers: [{kind: dram, capacity: 0.05GiB}]\n")
    c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                     "object_store_memory": 192 << 20}))
    start_ray(lambda: c.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=192 << 20))
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "cluster": cluster_yaml, "replica_cpus": 0.5, "max_replicas_per_node": 1,
                         "autoscaling": {"min_replicas": 2, "max_replicas": 2}, "hbm_blocks": 64}),
              name="default", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def ask(endpoint: str, prompt: str) -> tuple[str, int]:
    r = httpx.post(f"{endpoint}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0}, timeout=180)
    assert r.status_code == 200, r.text
    return r.headers[NODE_HEADER], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_every_turn_goes_to_the_node_holding_its_prefix(two_node_endpoint, reference):
    def stored(prompt: str) -> list[int]:
        """What the replica serving `prompt` stored: its tokens and every output token but the last."""
        ids = reference.loaded.tokenizer.encode(prompt)
        return ids + reference.complete(ids, SamplingParams(max_tokens=2, temperature=0)).output_ids[:-1]

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "KVReplica" in a["name"]}
    assert len(names) == 2
    conversations = [f"Conversation {i}: " + DOC[: 300 + 60 * i] for i in range(4)]
    first = {c: ask(two_node_endpoint, c)[0] for c in conversations}
    assert set(first.values()) <= {"head", "node-b"}
    history = {c: [stored(c)] for c in conversations}
    for turn in range(4):
        for c in conversations:
            prompt = c + f" Turn {turn}: tell me more."
            node, cached = ask(two_node_endpoint, prompt)
            assert node == first[c], (c[:16], turn, node, first[c])  # sent to the replica next to its blocks
            assert cached == expected_cached(reference.loaded.tokenizer.encode(prompt), history[c]), (c[:16], turn)
            history[c].append(stored(prompt))
