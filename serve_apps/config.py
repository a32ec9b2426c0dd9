"""The Serve app's settings (the `args` of configs/serve_runner.yaml), validated before anything starts."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)


class ServeAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("kvcluster-tiny-llama", description="A name under configs/models, or a local checkpoint dir.")
    served_model_name: str | None = Field(None, description="The id clients send as `model` (default: the name).")
    dtype: str = Field("fp32", pattern="^(fp32|bf16|fp16)$")
    seed: int = Field(0, description="Seed of random weights; every replica builds the same model.")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="Where the model runs; auto: CUDA when "
                                                                          "the replica sees a GPU.")
    block_tokens: int | None = Field(None, gt=0, description="Tokens per KV block of an app without a cluster "
                                     "(`cluster: null`; default 16). With a cluster the cluster YAML's "
                                     "`block_tokens` is the one value, and setting it here too is an error.")
    hbm_blocks: int = Field(512, ge=1, description="Blocks the replica's own tier (hbm) holds.")
    cluster: str | None = Field("local", description="Cluster YAML (configs/cluster) of the tier actors; "
                                                     "None: the replica's hbm tier only.")
    start_cluster: bool = Field(True, description="The app builder starts the cluster's cache actors (idempotent) "
                                "before any replica; false: they must already run (`kvcluster cluster up`).")
    index_refresh_s: float | None = Field(None, gt=0, description="Keep a read-only copy of the block index in "
                                          "the ingress and each replica, refreshed this often (seconds): a lookup "
                                          "costs no remote call, and sees changes up to this late (a block stored "
                                          "since is recomputed). None: ask the index shards per request.")
    prefetch_queued: bool = Field(True, description="A request that must wait for a free replica slot has its "
                                  "cached prefix lifted into its node's first tier by the control plane while it "
                                  "waits.")
    torch_threads: int = Field(1, ge=1, description="Intra-op threads per replica (OpenMP spin-waits hurt on "
                                                    "busy small machines).")
    replica_cpus: float = Field(1.0, ge=0)
    nixl_fetch: bool = Field(True, description="Read dram/cxl tier blocks over NIXL (one lookup call, then the "
                             "bytes from the tier's slab) instead of through the Ray object store.")
    max_replicas_per_node: int | None = Field(None, ge=1, description="Spread replicas over the Ray nodes: at "
                                              "most this many per node (1: one replica next to each node's tiers).")
    max_ongoing_requests: int = Field(8, ge=1, description="Requests a replica interleaves; more wait in Serve.")
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_inflight_requests: int = Field(64, ge=1, description="Generation requests the ingress holds at once; "
                                                             "more get 503 with Retry-After instead of queueing "
                                                             "without bound.")
    replica_retries: int = Field(1, ge=0, description="Times a request is re-sent when its replica dies before "
                                                      "the first token (output is deterministic per request).")
    default_chat_max_tokens: int = Field(256, ge=1)
    max_request_bytes: int = Field(4 << 20, ge=1024, description="Largest request body accepted (bytes); larger "
                                   "ones get 413 from their Content-Length (or as they stream), before any work.")
    request_body_timeout_s: float = Field(30.0, gt=0, description="A request body must arrive within this; "
                                          "slower senders get 408.")
    tokenizer_threads: int = Field(2, ge=1, description="Threads that tokenize and render chat prompts, off the "
                                   "ingress's event loop.")
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty: no auth "
                                                                  "(KVCLUSTER_API_KEYS=comma,separated also works).")
    root_seed: str = Field("kvcluster-v1", description="Block-key root; every node and replica must agree.")

    @model_validator(mode="after")
    def _one_block_size(self) -> "ServeAppConfig":
        if self.cluster is not None and self.block_tokens is not None:
            raise ValueError("block_tokens: the cluster YAML sets it (block_tokens there); leave it out here")
        if self.cluster is None and self.block_tokens is None:
            self.block_tokens = 16
        return self

    def keys(self) -> list[str]:
        env = [k for k in os.environ.get("KVCLUSTER_API_KEYS", "").split(",") if k]
        return self.api_keys + env

    def resolved_device(self) -> str:
        """auto -> cuda when this process sees a GPU (the ingress resolves it the same way, for its block keys)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]
