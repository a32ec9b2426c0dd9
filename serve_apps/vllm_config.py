"""The vLLM Serve app's settings (the `args` of configs/serve.yaml), validated before anything starts.

The app is the same OpenAI front as configs/serve_runner.yaml (serve_apps/ingress.py) over replicas that each run a
vLLM engine with `KVClusterConnector`. So the settings are the engine's and the replicas' here, and the
front's own limits under `api`, checked by the front's own model (`ServeAppConfig`) rather than copied field
by field; the runner's settings (hbm tier, cluster, torch threads) mean nothing to a vLLM replica and are
refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvcluster.errors import ConfigError
from kvcluster.integrations.vllm.store import ConnectorConfig

from .config import ServeAppConfig

# ServeAppConfig fields that set the OpenAI front's limits: the only ones `api` takes
API_FIELDS = ("max_tokens_limit", "max_inflight_requests", "replica_retries", "default_chat_max_tokens",
              "max_request_bytes", "request_body_timeout_s", "tokenizer_threads", "api_keys")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLLMAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("kvcluster-tiny-llama", description="A name under configs/models (its config with "
                       "random weights, vLLM's load_format=dummy, and the offline tokenizer), or a local "
                       "Hugging Face checkpoint directory (its own weights and tokenizer).")
    served_model_name: str | None = Field(None, description="The id clients send as `model` (default: the name).")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Weights and KV dtype.")
    seed: int = Field(0, description="Seed of the random weights: every replica builds the same model.")
    max_model_len: int | None = Field(None, gt=0, description="Tokens of prompt and answer per request; default "
                                      "the model's max_position_embeddings (the front's window).")
    kv_cache_space_gib: int = Field(1, ge=1, description="Host memory of each replica's paged KV cache "
                                      "(vLLM's VLLM_CPU_KVCACHE_SPACE on CPU).")
    kv_cache_blocks: int | None = Field(None, gt=0, description="Blocks of each replica's paged KV cache "
                                        "(vLLM's num_gpu_blocks_override; it must hold one request of "
                                        "max_model_len); default: as many as kv_cache_space_gib holds.")
    connector: ConnectorConfig | None = Field(
        default_factory=lambda: ConnectorConfig(tiers=[{"kind": "dram", "capacity": "512MiB"}]),
        description="KVClusterConnector's kv_connector_extra_config (tiers fastest first, policy); null: "
                    "vLLM's own prefix cache only.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas; a session stays on one, new sessions go to "
                              "the least loaded (serve_apps/vllm_router.py).")
    max_replicas_per_node: int | None = Field(None, ge=1, description="At most this many replicas on one Ray "
                                              "node (1 on a cluster: each node's engine lends its paged KV as "
                                              "the node's hbm tier); default: no limit.")
    replica_cpus: float = Field(1.0, ge=0, description="Ray CPUs each replica reserves.")
    omp_threads: int = Field(1, ge=1, description="OpenMP threads of each engine's CPU kernels.")
    max_ongoing_requests: int = Field(8, ge=1, description="Requests one engine batches at once (its "
                                      "max_num_seqs); more wait in Serve's queue.")
    route_tokens: int = Field(128, ge=1, description="Tokens per block of the router's keys (vLLM's block size on "
                              "CPU): a request without a session follows the one whose blocks it continues, and "
                              "a replica's load is the blocks routed to it.")
    root_seed: str = Field("kvcluster-v1", description="Root of the routing keys.")
    api: dict[str, Any] = Field(default_factory=dict, description=f"The OpenAI front's limits: "
                                f"{', '.join(API_FIELDS)} (as in configs/serve_runner.yaml).")

    @field_validator("api")
    @classmethod
    def _front_fields_only(cls, api: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(api) - set(API_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; api takes {', '.join(API_FIELDS)}")
        return api

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]

    def front(self) -> ServeAppConfig:
        """The OpenAI front's settings: no cache cluster (the engines keep their own tiers), the replicas'
        model and limits."""
        return ServeAppConfig.model_validate({
            **self.api, "model": self.model, "served_model_name": self.served_model_name, "dtype": self.dtype,
            "seed": self.seed, "cluster": None, "device": "cpu", "max_ongoing_requests": self.max_ongoing_requests,
            "autoscaling": {"min_replicas": self.num_replicas, "max_replicas": self.num_replicas},
            "root_seed": self.root_seed})


def load_app_config(args: dict | None) -> VLLMAppConfig:
    """The validated settings, or a ConfigError naming the field."""
    try:
        cfg = VLLMAppConfig.model_validate(args or {})
        cfg.front()
    except ValueError as exc:
        raise ConfigError(f"serve_vllm args: {exc}") from None
    return cfg
