"""The vLLM Serve app as a cluster (configs/serve_cluster.yaml's shape) on a 2-node `ray.cluster_utils.Cluster`,
asked through its HTTP endpoint with the official `openai` client.

One replica per node, each joined with `node: auto`: the replicas start their nodes' tier actors and
controllers, named from Ray, and the cluster's index and predictor. A shared system prompt one session's
replica computed is loaded by the other replica from the cluster (the same greedy text); then the first
session's node is removed, and that session's next turn, now on the other node, is served from the cluster
(the shared files its replica wrote behind), with the text a cold computation gives (another cache salt).
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["RAY_AUTH_MODE"] = "disabled"

pytest.importorskip("vllm", reason="vLLM is not installed here; run `bash scripts/setup.sh`")
ray = pytest.importorskip("ray", reason="Ray is not installed in this venv; rerun `bash scripts/setup_vllm.sh`")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402
from serve_support import BLOCK, MODEL, free_port, long_prompt, ray_tmpdir  # noqa: E402

pytestmark = pytest.mark.timeout(600)
NODE_HEADER = "x-kvcluster-node"


def wait_for(what: str, check, timeout_s: float = 300.0):
    """Poll `check()` until it returns something true (an event, with a ceiling only for a broken run)."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def cluster_app(tmp_path_factory):
    """Head (no CPU for replicas: Serve's controller, proxy and the ingress) and two 1-CPU nodes, the app with
    one replica on each; yields (the Cluster, the openai client, {node name: Ray node})."""
    from ray.cluster_utils import Cluster

    from kvcluster.actors.index_actor import NAMESPACE
    from kvcluster.actors.node_parts import ray_node_name
    from kvcluster.actors.ray_start import start_ray
    from kvcluster.serve_apps.vllm_app import build_app

    shared = tmp_path_factory.mktemp("shared")
    with ray_tmpdir("kvcc"):
        store = {"object_store_memory": 128 << 20}
        c = start_ray(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                            **store}))
        workers = [start_ray(lambda: c.add_node(num_cpus=1, **store)) for _ in range(2)]
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        c.wait_for_nodes()
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app({
                "model": MODEL, "num_replicas": 2, "max_replicas_per_node": 1, "kv_cache_blocks": 40,
                "connector": {"tiers": [{"kind": "dram", "capacity": "8MiB"}], "policy": "lru",
                              "cluster": {"node": "auto", "policy": "lru",
                                          "tiers": [{"kind": "dram", "capacity": "32MiB"}],
                                          "shared": {"kind": "pfs", "capacity": "256MiB", "path": str(shared)}}},
                "api": {"max_tokens_limit": 64}}), name="cluster", route_prefix="/")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            yield c, client, {ray_node_name(w.node_id): w for w in workers}
        finally:
            serve.shutdown()
            ray.shutdown()
            c.shutdown()


def chat(client, session: str, messages: list[dict], salt: str | None = None):
    """One greedy chat turn: (answer text, prompt tokens, cached tokens, the node whose replica answered)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, user=session,
        extra_body={"cache_salt": salt} if salt else None)
    done = raw.parse()
    return (done.choices[0].message.content, done.usage.prompt_tokens,
            done.usage.prompt_tokens_details.cached_tokens, raw.headers.get(NODE_HEADER))


def running_replicas() -> int:
    """Replicas Serve's controller counts as running."""
    status = serve.status().applications["cluster"].deployments["VLLMReplica"]
    return status.replica_states.get("RUNNING", 0)


def replica_info(node: str) -> dict | None:
    """The info of the replica on `node` (requests go to a replica at random: 50 tries miss one of two with
    p = 2**-50), None when none answers from there."""
    handle = serve.get_deployment_handle("VLLMReplica", app_name="cluster")
    for _ in range(50):
        info = handle.info.remote().result(timeout_s=60)
        if info["node"] == node:
            return info
    return None


def written_behind(node: str, blocks: int):
    """The shared files' count of blocks the replica on `node` has written, once it reaches `blocks`."""
    info = replica_info(node) or {}
    written = info.get("connector", {}).get("shared", {}).get("written", 0)
    return written if written >= blocks else None


def test_replicas_share_one_cache_and_a_removed_nodes_session_finds_its_history(cluster_app) -> None:
    cluster, client, nodes = cluster_app
    system = long_prompt(11, words=300)  # a system prompt of two 128-token blocks, shared by every session
    first = [{"role": "system", "content": system}, {"role": "user", "content": long_prompt(12, words=500)}]

    text_a, prompt_tokens, cached, node_a = chat(client, "alice", first)
    assert cached == 0 and node_a in nodes and prompt_tokens > 5 * BLOCK
    wait_for("alice's blocks written behind to the shared files",
             lambda: written_behind(node_a, (prompt_tokens - 1) // BLOCK))

    other = [{"role": "system", "content": system}, {"role": "user", "content": "a short question"}]
    text_b, tokens_b, cached_b, node_b = chat(client, "bob", other)  # a new session: the other, idle replica
    assert node_b in nodes and node_b != node_a
    system_blocks = cached_b // BLOCK
    assert system_blocks >= 2 and cached_b < tokens_b  # the shared system prompt, from the cluster
    reference, _, cold, _ = chat(client, "ref-b", other, salt="cold-b")  # another salt: computed from scratch
    assert cold == 0 and text_b == reference
    info_b = replica_info(node_b)["connector"]
    assert info_b["loaded_blocks"] == system_blocks and info_b["failed_blocks"] == 0

    second = first + [{"role": "assistant", "content": text_a}, {"role": "user", "content": "and the second?"}]
    text, tokens2, _, node = chat(client, "alice", second)
    assert node == node_a  # the session stays on its replica
    wait_for("alice's second turn written behind", lambda: written_behind(node_a, (tokens2 - 1) // BLOCK))

    cluster.remove_node(nodes[node_a])  # alice's node dies, with its replica and its share of the memory
    wait_for("Serve dropping the dead replica", lambda: running_replicas() == 1)
    third = second + [{"role": "assistant", "content": text}, {"role": "user", "content": "and the third?"}]
    text3, tokens3, cached3, node3 = chat(client, "alice", third)
    assert node3 == node_b
    # her history beyond the system prompt: only the shared files her replica wrote behind hold it
    assert cached3 >= tokens3 // 2 and cached3 > system_blocks * BLOCK
    reference, _, cold, _ = chat(client, "ref-a", third, salt="cold-a")
    assert cold == 0 and text3 == reference
    info = replica_info(node_b)["connector"]
    assert info["failed_blocks"] == 0 and info["cluster"]["shared"] >= (cached3 // BLOCK) - system_blocks
