"""`serve run configs/serve.yaml` entry point: the OpenAI front bound to vLLM engine replicas.

The front is configs/serve_runner.yaml's (serve_apps/ingress.py: the same endpoints, request checks, errors and
`usage.prompt_tokens_details.cached_tokens`), without a cache cluster: each replica's vLLM engine keeps its
prefix KV itself, in vLLM's prefix cache and, through `KVClusterConnector`, in kvcluster's tiers in the
replica's process. A session stays on one replica, new sessions go to the least loaded
(serve_apps/vllm_router.py).
"""

from __future__ import annotations

from ray.serve import Application

from .ingress import OpenAIIngress
from .vllm_config import load_app_config
from .vllm_replica import replica_deployment


def build_app(args: dict | None = None) -> Application:
    """Validate the args (a ConfigError naming the field), then bind the front to the engine replicas."""
    cfg = load_app_config(args)
    replicas = replica_deployment(cfg).bind(cfg.model_dump())
    return OpenAIIngress.bind(replicas, cfg.front().model_dump())
