"""A model replica: one ModelRunner whose KV prefix comes from the tiers, as a Serve deployment.

The ingress hands over token ids (it tokenized them to route the request), the
sampling parameters and the tenant's salt; the replica streams back events: one
`start` (prompt and cached token counts), text `delta`s, one `end`. Requests on
one replica interleave token by token; each model step runs in a worker thread
so the replica keeps answering health checks and new requests.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import AsyncIterator

import ray
import torch
from ray import serve

from kvcluster.actors.cluster import node_ids
from kvcluster.actors.index_client import open_index
from kvcluster.belady_gap import BeladyGapEstimator
from kvcluster.cluster_config import DEFAULT_POLICY, load_cluster_config
from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.serving.models import load_model
from kvcluster.serving.runner import ModelRunner, RequestTooLong
from kvcluster.serving.sampling import SamplingParams
from kvcluster.storage import hbm_backend
from kvcluster.storage.tiered import TieredStore

from kvcluster.actors import metrics

from .cluster_store import ClusterBlockStore
from .config import ServeAppConfig


GAP_EVERY = 20  # requests between two estimates of the hbm tier's gap to Belady


def cache_cluster(cfg: ServeAppConfig):
    """The cluster YAML, or None without one. Its actors are started by the app builder (or `kvcluster
    cluster up`), never here: a replica or ingress coming up has no side effect on the whole cluster."""
    return None if cfg.cluster is None else load_cluster_config(cfg.cluster)


class KVReplica:
    def __init__(self, config: dict) -> None:
        self.cfg = ServeAppConfig.model_validate(config)
        torch.set_num_threads(self.cfg.torch_threads)
        self.loaded = load_model(self.cfg.model, self.cfg.dtype, self.cfg.seed, self.cfg.name,
                                 device=self.cfg.resolved_device())
        cluster = cache_cluster(self.cfg)
        block_tokens = cluster.block_tokens if cluster is not None else self.cfg.block_tokens
        runner = ModelRunner(self.loaded, None, block_tokens, self.cfg.root_seed)
        block = runner.layout.nbytes()
        self.policy = cluster.policy if cluster is not None else DEFAULT_POLICY
        hbm = LocalBlockStore(TieredStore([hbm_backend(self.cfg.hbm_blocks, block)], block, self.policy))
        self.node = None
        if cluster is not None:
            if cluster.block_bytes() != block:
                raise ValueError(f"cluster {self.cfg.cluster!r} sizes {cluster.block_bytes()}-byte blocks but "
                                 f"{self.cfg.model} with {block_tokens}-token blocks needs {block}")
            here = ray.get_runtime_context().get_node_id()
            self.node = next((name for name, nid in node_ids(cluster).items() if nid == here), None)
            staging = max(32 << 20, 8 * block) if self.cfg.nixl_fetch else None
            runner.store = ClusterBlockStore(hbm, self.node, nixl_staging_bytes=staging,
                                             index=open_index(self.cfg.index_refresh_s))
        else:
            runner.store = hbm
        self.runner = runner
        self._hbm = hbm
        self._gap = BeladyGapEstimator(self.cfg.hbm_blocks, policy=self.policy, block_size=block_tokens)
        self._gap_task: asyncio.Task | None = None
        self._evictions_reported = 0
        self._model_lock = threading.Lock()  # one forward at a time; requests interleave between steps
        self.served = 0

    def _locked(self, fn, *args):
        with self._model_lock:
            return fn(*args)

    async def generate(self, request: dict, prefer_node: str | None = None) -> AsyncIterator[dict]:
        """Stream one request's events. `prefer_node` is read by the router, not here."""
        params = SamplingParams.model_validate(request["params"])
        try:
            gen = await asyncio.to_thread(self._locked, self.runner.start, request["prompt_ids"], params,
                                          request.get("cache_salt", ""), request.get("spans", ()),
                                          request.get("segments", ()), request.get("session", ""))
        except RequestTooLong as exc:
            yield {"type": "error", "message": str(exc)}
            return
        metrics.ttft().observe(gen.ttft_s, {"model": self.cfg.name})
        metrics.cached_tokens().observe(gen.cached_tokens, {"model": self.cfg.name})
        yield {"type": "start", "prompt_tokens": len(gen.prompt_ids), "cached_tokens": gen.cached_tokens,
               "segment_tokens": gen.segment_tokens, "prompt_logprobs": gen.prompt_logprobs,
               "ttft_s": gen.ttft_s, "fetch_s": gen.fetch_s, "node": self.node}
        sent = 0  # output tokens whose log-probabilities went out (with a delta, or with the end)
        try:
            while True:
                delta = self.runner.new_text(gen)
                if delta:
                    yield {"type": "delta", "text": delta, "logprobs": gen.logprobs[sent:gen.completion_tokens]}
                    sent = max(sent, min(len(gen.logprobs), gen.completion_tokens))
                if gen.done:
                    break
                await asyncio.to_thread(self._locked, self.runner.step, gen)
        finally:
            await asyncio.to_thread(self._locked, self.runner.finish, gen)
            self.served += 1
            self._report_hbm()
            self._gap.record(self.runner.block_keys(gen.prompt_ids[: len(gen.prompt_ids) - 1], gen.cache_salt))
            if self.served % GAP_EVERY == 0 and (self._gap_task is None or self._gap_task.done()):
                # ~0.2 s of replay for a full window: in the background, never before this request's end event
                self._gap_task = asyncio.get_running_loop().create_task(self._report_gap())
        yield {"type": "end", "finish_reason": gen.finish_reason, "completion_tokens": gen.completion_tokens,
               "stored_blocks": gen.stored_blocks, "logprobs": gen.logprobs[sent:gen.completion_tokens]}

    def _report_hbm(self) -> None:
        """The replica's own tier (hbm): bytes, and evictions since the last report."""
        tiered = self._hbm.tiered
        backend = tiered.backends[0]
        tags = {"node": self.node or "local", "tier": "hbm"}
        metrics.tier_bytes().set(backend.used_bytes, {**tags, "kind": "used"})
        metrics.tier_bytes().set(backend.capacity_bytes, {**tags, "kind": "capacity"})
        new = tiered.evictions[0] - self._evictions_reported
        if new:
            metrics.evictions().inc(new, {**tags, "unit": "block"})
            metrics.evictions().inc(new * self.runner.layout.shards, {**tags, "unit": "head_shard"})
            self._evictions_reported += new

    async def _report_gap(self) -> None:
        """The hbm tier's estimated gap to Belady over the recent requests, as a gauge."""
        estimate = await asyncio.to_thread(self._gap.estimate)
        if estimate is not None:
            metrics.belady_gap().set(estimate.gap, {"node": self.node or "local", "tier": "hbm", "policy": self.policy})

    def info(self) -> dict:
        store = self.runner.store
        return {"node": self.node, "served": self.served, "pid": os.getpid(), "fingerprint": self.loaded.fingerprint,
                "tiers_hit": dict(getattr(store, "counters", {})), "block_bytes": self.runner.layout.nbytes()}

    def check_health(self) -> None:
        if self.runner is None:
            raise RuntimeError("model not loaded")


def replica_deployment(cfg: ServeAppConfig):
    """KVReplica as a Serve deployment with autoscaling and the prefix-affinity router."""
    from ray.serve.config import RequestRouterConfig

    from .router import PrefixAffinityRouter

    spread = {} if cfg.max_replicas_per_node is None else {"max_replicas_per_node": cfg.max_replicas_per_node}
    return serve.deployment(
        KVReplica,
        name="KVReplica",
        ray_actor_options={"num_cpus": cfg.replica_cpus},
        **spread,
        max_ongoing_requests=cfg.max_ongoing_requests,
        autoscaling_config=cfg.autoscaling.model_dump(),
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
        health_check_period_s=10,
    )
