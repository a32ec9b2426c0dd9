"""`kvcluster replay`: turn CLI choices into tier plans, run each policy, report.

Capacity comes one of four ways: blocks, a fraction of the trace's unique
blocks, a node's tiers file (each tier's KV bytes / block bytes for --model), or
a cluster file's node (--topology: the hierarchy its control plane runs, fastest
first, ending in its share of pfs, each tier's KV bytes / block bytes for the
cluster's model; its bandwidths and GPUs, when given, feed the cost model).
With a tiers file the report also runs the two reference deployments the cost
model compares against, named for what they are: `hbm-only-lru` (prefix caching
in GPU memory alone) and `hbm-dram-lru` (the same, offloading to host memory).
When the node's file prices its GPUs and tiers (`pricing.py`), every deployment
also reports its cost per million prompt tokens; otherwise the report lists the
price fields it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .capacity import node_capacity
from .cluster_config import ClusterConfig, load_cluster_config
from .cluster_control import node_chains
from .cost_model import CostModel, make_cost_model
from .errors import ConfigError
from .model_spec import load_model_spec
from .pricing import missing_prices
from .policies.registry import policy_names
from .hierarchy import TierPlan
from .simulator import PreparedTrace, ReplayResult, replay
from .sizing import size_model
from .tiers import load_node_tiers

REFERENCE_DEPLOYMENTS = (("hbm-only-lru", ("hbm",)), ("hbm-dram-lru", ("hbm", "dram")))


@dataclass(frozen=True)
class ReplayOptions:
    policies: tuple[str, ...]
    capacity_blocks: tuple[int, ...] = ()
    capacity_frac: tuple[float, ...] = ()
    tiers: str | None = None
    topology: str | None = None  # a cluster file: its first node's tiers, with the cluster's model
    model: str = "llama-3.1-8b"
    node: str = "h100-node"
    prefetch_lead_s: float = 0.0
    lookahead_s: float = 0.0  # > 0: also replay each single-tier point with queue look-ahead
    calibration_horizon_s: float = 0.0  # > 0: also score the reuse-gap predictor's P(reuse within this)
    answers_at_finish: bool = False  # each answer told after its request's store, as vLLM's connector tells it

    def validate(self) -> None:
        known = policy_names()
        for name in self.policies:
            if name not in known:
                raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(known)}")
        chosen = sum(bool(x) for x in (self.capacity_blocks, self.capacity_frac, self.tiers, self.topology))
        if chosen != 1:
            raise ConfigError("give exactly one of --capacity-blocks, --capacity-frac, --tiers, --topology")
        if any(f <= 0 or f > 1 for f in self.capacity_frac):
            raise ConfigError("--capacity-frac values must be in (0, 1]")
        if any(n < 0 for n in self.capacity_blocks):
            raise ConfigError("--capacity-blocks values must be >= 0")
        if self.lookahead_s < 0:
            raise ConfigError("--lookahead-s must be >= 0 seconds")
        if self.lookahead_s > 0 and (self.tiers or self.topology):
            raise ConfigError("--lookahead-s pins blocks in one tier: use it with --capacity-*, or "
                              "--prefetch-lead-s with --tiers")
        if self.calibration_horizon_s < 0:
            raise ConfigError("--calibration horizon must be > 0 seconds")


def cluster_of(options: ReplayOptions) -> ClusterConfig | None:
    return load_cluster_config(options.topology) if options.topology else None


def model_of(options: ReplayOptions) -> str:
    """The model that sizes the blocks: a topology's own, else --model."""
    cluster = cluster_of(options)
    return cluster.model if cluster is not None else options.model


def topology_plan(cluster: ClusterConfig, block_bytes: int) -> list[TierPlan]:
    """The first node's hierarchy as its control plane runs it (`node_chains`), in blocks of `block_bytes`."""
    node = cluster.node()
    slots = {(node.name, t.kind): t.usable_bytes // max(1, block_bytes) for t in node.tiers}
    chain = node_chains(cluster, slots)[node.name]
    return [t.plan() for t in chain]


def plans(options: ReplayOptions, trace: PreparedTrace, block_bytes: int) -> list[list[TierPlan]]:
    """One tier plan per capacity point."""
    if options.topology:
        return [topology_plan(load_cluster_config(options.topology), block_bytes)]
    if options.tiers:
        node = load_node_tiers(options.tiers)
        report = size_model(load_model_spec(options.model))
        caps = node_capacity(report, node)
        return [[TierPlan(t.name, t.bytes // max(1, block_bytes)) for t in caps.tiers]]
    if options.capacity_frac:
        return [[TierPlan("hbm", max(1, round(f * trace.unique_blocks)))] for f in options.capacity_frac]
    return [[TierPlan("hbm", n)] for n in options.capacity_blocks]


def cost_model_for(options: ReplayOptions, plan: list[TierPlan], block_size: int) -> CostModel | None:
    """The node's bandwidths and GPUs; None for a topology node that names no GPUs (hit rates only)."""
    cluster = cluster_of(options)
    if cluster is not None:
        if cluster.node().gpu is None:
            return None
        spec = load_model_spec(cluster.model)
        return make_cost_model(spec, size_model(spec, dtype=cluster.dtype), cluster.node(),
                               tuple(t.name for t in plan), block_size)
    spec = load_model_spec(options.model)
    node = load_node_tiers(options.tiers or options.node)
    return make_cost_model(spec, size_model(spec), node, tuple(t.name for t in plan), block_size)


def run_replay(
    options: ReplayOptions,
    trace: PreparedTrace,
    progress_factory: Callable[[str], Callable[[int], None] | None] = lambda label: None,
) -> dict:
    """Every policy at every capacity point, plus reference deployments for a tiers file."""
    options.validate()
    cluster = cluster_of(options)
    spec = load_model_spec(model_of(options))
    block_bytes = size_model(spec, dtype=cluster.dtype if cluster else None).bytes_per_token * trace.block_size
    results: list[ReplayResult] = []
    for plan in plans(options, trace, block_bytes):
        cost = cost_model_for(options, plan, trace.block_size)
        for policy in options.policies:
            results.append(
                replay(trace, policy, plan, cost=cost, prefetch_lead_s=options.prefetch_lead_s,
                       answers_at_finish=options.answers_at_finish,
                       progress=progress_factory(f"{policy} @ {sum(t.capacity_blocks for t in plan):,} blocks"))
            )
            if options.lookahead_s > 0:  # a separate figure, never mixed into the one above
                ahead = replay(trace, policy, plan, lookahead_s=options.lookahead_s,
                               answers_at_finish=options.answers_at_finish)
                results[-1].lookahead = {"lookahead_s": options.lookahead_s, "hit_rate": ahead.hit_rate}
    out = {
        "trace": trace.name,
        "requests": trace.requests,
        "block_refs": trace.block_refs,
        "unique_blocks": trace.unique_blocks,
        "block_size": trace.block_size,
        "model": model_of(options),
        "results": [r.to_dict() for r in results],
        "infinite_hit_rate": trace.infinite_hit_rate(),
        "answers": "told after each request's store" if options.answers_at_finish else "known at each store",
    }
    if options.topology:
        out["topology"] = {"cluster": options.topology, "node": cluster.node().name}
    if options.tiers:
        out["reference_deployments"] = _references(options, trace, block_bytes)
    priced = cost_model_for(options, plan, trace.block_size) if (options.tiers or options.topology) else None
    if priced is not None and missing_prices(priced.node, priced.tier_names):
        out["unpriced"] = missing_prices(priced.node, priced.tier_names)
    if options.calibration_horizon_s > 0:
        from .calibration import calibrate

        out["calibration"] = calibrate(trace, options.calibration_horizon_s)
    return out


def _references(options: ReplayOptions, trace: PreparedTrace, block_bytes: int) -> list[dict]:
    full = {t.name: t for t in plans(options, trace, block_bytes)[0]}
    refs = []
    for label, names in REFERENCE_DEPLOYMENTS:
        plan = [full[n] for n in names if n in full]
        result = replay(trace, "lru", plan, cost=cost_model_for(options, plan, trace.block_size))
        refs.append({"deployment": label, **result.to_dict()})
    return refs
