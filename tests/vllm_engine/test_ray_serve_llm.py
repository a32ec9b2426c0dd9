"""Ray Serve LLM (`ray.serve.llm.build_openai_app`) with KVClusterConnector dropped into `LLMConfig`.

What a Ray Serve LLM user writes (README, "Ray Serve LLM"): the connector in
`engine_kwargs["kv_transfer_config"]`, `server_cls=KVClusterLLMServer` (the engine's one worker in its
engine-core process, which the connector needs) and the CPU env in `runtime_env`. One replica of the tiny Llama
with seeded random weights, asked twice for the same long prompt with vLLM's own prefix cache reset in between,
through the official `openai` client: the second answer's cached tokens can only have come from the
connector's dram tier, and its greedy text must equal the first one's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"

pytest.importorskip("vllm", reason="vLLM is not installed here; run `bash scripts/setup.sh`")
ray = pytest.importorskip("ray", reason="Ray is not installed in this venv; rerun `bash scripts/setup_vllm.sh`")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402
from serve_support import BLOCK, MODEL, local_serve, long_prompt  # noqa: E402

SERVER = "KVClusterLLMServer"
LONG_PROMPT = long_prompt(7)
# the replica's env: one OMP thread per engine, the worker in the engine-core process ("uni"), a 1 GiB paged KV,
# the CPU build, no hub look-ups
REPLICA_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}

pytestmark = pytest.mark.timeout(420)


def llm_config(model_dir: Path):
    from ray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": MODEL, "model_source": str(model_dir)},
        server_cls="kvcluster.integrations.vllm.ray_serve_llm:KVClusterLLMServer",
        engine_kwargs={
            "load_format": "dummy", "dtype": "float32", "seed": 0, "enforce_eager": True,
            "enable_prefix_caching": True, "max_model_len": 2048, "enable_prompt_tokens_details": True,
            "kv_transfer_config": {
                "kv_connector": "KVClusterConnector",
                "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"tiers": [{"kind": "dram", "capacity": "64MiB"}]}},
        },
        # one CPU for the engine, none for the replica actor beside it: the ingress takes the cluster's other
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
                           "ray_actor_options": {"num_cpus": 0}},
        runtime_env={"env_vars": REPLICA_ENV},
        log_engine_metrics=False,
    )


@pytest.fixture(scope="module")
def client():
    """build_openai_app on a local two-CPU Ray; Serve and Ray shut down after."""
    from ray.serve.llm import build_openai_app

    from kvcluster.integrations.vllm.ttft import model_dir

    with local_serve("kvl-") as (tmp, port):
        app = build_openai_app({
            "llm_configs": [llm_config(model_dir(Path(tmp) / "model"))],
            "ingress_deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}})
        serve.run(app, name="llm", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                            timeout=120)


def test_a_prompt_is_served_from_the_connector_after_vllm_forgot_it(client) -> None:
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 2 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    server = serve.get_deployment_handle(f"{SERVER}:{MODEL}", app_name="llm")
    server.reset_prefix_cache.remote().result(timeout_s=60)  # vLLM's own prefix cache: empty again

    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens == prompt_tokens
    # every full block but the one holding the last prompt token (vLLM computes that token for its logits),
    # loaded by the connector from its dram tier
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.completion_tokens == first.usage.completion_tokens == 8
