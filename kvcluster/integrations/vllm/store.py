"""The tiers behind the vLLM connector: configured from `kv_connector_extra_config`, one store per engine.

With `cluster`, the engine's own tiers are the first of a kvcluster cluster's (`kvcluster cluster up`): the
scheduler asks them, then the cluster's block index, how much of a prompt is held anywhere; loads read
this node's tier actors first and other nodes' memory tiers over NIXL (the store `cluster.store_factory`
builds, resolved at run time: `ClusterBlockStore` by default), and new
blocks go to the control plane, whose policy places them in the cluster's tiers. A tier actor that is
gone or slow is a miss, and vLLM recomputes.

vLLM builds two connector objects per engine, one for the scheduler and one per worker. With one worker
in the engine-core process (the "uni" executor) both live there and share one `LocalBlockStore` through
`shared_store`, keyed by the engine's config instance id: the scheduler asks it what it holds, the worker
moves the bytes. With workers in processes of their own (tensor parallel) each builds the store of its own
shard (`for_rank`) and reports what it holds (`holdings.py`). A store over a `pfs` (file) tier adopts the
block files already there, so a fresh engine finds the blocks an earlier one wrote; the `dram` and `nvme`
tiers start empty with their process (the nvme slab's index lives in memory).

Replicas on one node may be given one config: each engine's nvme tier claims a slab of its own, the first of
`PATH/r0`, `PATH/r1`, ... that no live engine holds (`claim_nvme`), since a slab's index lives in its owner's
memory and two owners would overwrite each other's blocks. The pfs tier is shared on purpose: equal keys are
equal bytes, each file is written whole, and it is how another or a restarted replica finds blocks. The last
of an engine's connectors to release its store closes the slab, so an engine started next claims `r0` again.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...cluster_config import DEFAULT_POLICY
from ...errors import ConfigError
from ...keys import BlockKey
from ...policies import policy_names
from ...serving.block_store import LocalBlockStore
from ...storage.base import StorageBackend, StorageError
from ...storage.memory import dram_backend
from ...storage.nvme import NVMeBackend
from ...storage.pfs import PFSBackend, stored_keys
from ...storage.slab_owner import SlabInUse
from ...storage.tiered import TieredStore
from ...tiers import TierSpec, check_tiers, fastest_first, format_size

if TYPE_CHECKING:
    from .base import Cluster, ConnectorStore, Lending

DEFAULT_CLUSTER_FACTORY = "kvcluster.serve_apps.engine_cluster:connect"  # the Ray cluster's store
CONNECTOR_TIERS = ("dram", "nvme", "pfs")  # the kinds an engine's own store runs (kept in kvcluster.tiers.TIER_ORDER)
NODE_SHARE_TIERS = ("dram", "cxl", "nvme")  # the kinds of a node's tier actors an engine starts (`ClusterLink.tiers`)


AUTO_NODE = "auto"


def known_policy(policy: str) -> str:
    if policy not in policy_names():
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(policy_names())}")
    return policy


class ClusterLink(BaseModel):
    """How an engine joins a kvcluster cluster: one that `kvcluster cluster up` started, or one its engines start
    themselves, node by node, as replicas land (`tiers`)."""

    model_config = ConfigDict(extra="forbid")

    node: str = Field(AUTO_NODE, min_length=1,
                      description="the cluster node this engine runs on: its tiers are read first, and its controller "
                                  "places the engine's new blocks. `auto`: the Ray node this process runs on, named "
                                  "from Ray (`node-` and the node id's first 12 hex digits), so one config serves "
                                  "every replica and a node an autoscaler adds joins by itself; or a name from the "
                                  "cluster YAML of `kvcluster cluster up`")
    tiers: list[TierSpec] | None = Field(
        None, description="this node's share of the cluster, started on the node when the first engine there joins "
                          "(kinds dram, cxl, nvme; one tier actor each, and the node's controller over them), with "
                          "the cluster-wide index and predictor if none run yet; null: join a running cluster")
    shared: TierSpec | None = Field(
        None, description="the shared filesystem (kind pfs; its path mounted on every node): every block an engine "
                          "stores also goes there, written behind the request by the engine itself, and a prefix no "
                          "node's memory holds is read from there (so a node's death costs speed, not history)")
    policy: str = Field(DEFAULT_POLICY, description="the node controllers' eviction policy, when `tiers` starts them")
    address: str = Field("auto", description="the Ray cluster to join when this process has joined none "
                                             "(`ray.init(address=...)`)")
    timeout_s: float = Field(10.0, gt=0, description="an index or tier actor that does not answer in this time "
                                                     "is a miss")
    nixl_staging_mib: float | None = Field(32.0, gt=0, description="staging buffer of NIXL reads from memory "
                                                                   "tiers; null reads them through Ray's object store")
    store_factory: str = Field(DEFAULT_CLUSTER_FACTORY, pattern=r"^[\w.]+:\w+$",
                               description="module:callable that joins the cluster for this link and returns its "
                                           "store and index (kvcluster.integrations.vllm.base.Cluster); the "
                                           "default is kvcluster's Ray cluster")
    lend_paged_kv: bool = Field(True, description="lend this engine's paged KV as the node's hbm tier: other "
                                                  "nodes read its blocks straight from its pages over NIXL (one "
                                                  "engine per node; with tensor parallelism each worker lends its "
                                                  "shards; see `lending.py`)")

    @field_validator("tiers")
    @classmethod
    def _node_tiers(cls, tiers: list[TierSpec] | None) -> list[TierSpec] | None:
        if tiers is None:
            return None
        check_tiers(tiers, NODE_SHARE_TIERS, "a node's share of the cluster")
        return fastest_first(tiers)

    @field_validator("shared")
    @classmethod
    def _shared_is_a_directory(cls, shared: TierSpec | None) -> TierSpec | None:
        if shared is not None:
            check_tiers([shared], ("pfs",), "the cluster's shared filesystem")
        return shared

    _known_policy = field_validator("policy")(classmethod(lambda cls, policy: known_policy(policy)))


class ConnectorConfig(BaseModel):
    """`kv_connector_extra_config` of `KVClusterConnector`."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[TierSpec] = Field(min_length=1, description="{kind, capacity, path} as every tier is written "
                                  "(kvcluster.tiers.TierSpec; capacity with its unit, e.g. 512MiB); kinds dram, "
                                  "nvme, pfs, each once, kept fastest first; new blocks enter the first")
    policy: str = Field(DEFAULT_POLICY, description="eviction policy of the tiers, as a cluster's (`bayes` runs in "
                                                   "the first tier, LRU below; see `kvcluster replay --policies`)")
    model_fingerprint: str | None = Field(
        None, description="what makes this engine's KV unique; default: model, revision, dtype, load format, "
                          "KV layout. Engines that share a store must agree on it")
    cluster: ClusterLink | None = Field(None, description="join a kvcluster cluster: its index, tier actors "
                                                          "and control plane behind this engine's own tiers")
    async_loads: bool = Field(True, description="read a request's blocks on a thread of their own while the "
                                                "engine runs other requests; the request waits for them (vLLM's "
                                                "asynchronous load). False: every load lands before the step's "
                                                "forward, which waits for it")
    async_saves: bool = Field(True, description="copy saved blocks out of the paged KV at the end of the step "
                                                "and write them to the tiers on a thread of their own. False: the "
                                                "step waits for the tiers' writes")

    @field_validator("tiers")
    @classmethod
    def _ordered_with_paths(cls, tiers: list[TierSpec]) -> list[TierSpec]:
        check_tiers(tiers, CONNECTOR_TIERS, "the vLLM connector", memory_takes_path=False)
        return fastest_first(tiers)

    _known_policy = field_validator("policy")(classmethod(lambda cls, policy: known_policy(policy)))


def parse_config(extra: dict) -> ConnectorConfig:
    """The connector's config, or a ConfigError that names the bad field."""
    try:
        return ConnectorConfig.model_validate(extra)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None


def for_rank(config: ConnectorConfig, rank: int, ranks: int) -> ConnectorConfig:
    """The tiers of worker `rank` of `ranks` (tensor parallel): each worker stores its own shard of every
    block, so each keeps its files in a directory of its own (`PATH/tp{rank}-of-{ranks}`), where a fresh
    engine of the same shape finds them. One worker keeps the paths as given."""
    if ranks == 1:
        return config
    tiers = [t.model_copy(update={"path": str(Path(t.path) / f"tp{rank}-of-{ranks}")}) if t.path else t
             for t in config.tiers]
    return config.model_copy(update={"tiers": tiers})


def files_held(config: ConnectorConfig) -> list[BlockKey]:
    """The blocks a store over `config` will adopt from its pfs tier's files, before it is built."""
    return [key for t in config.tiers if t.kind == "pfs" for key in stored_keys(t.path)]


def _backend(tier: TierSpec, block_bytes: int) -> StorageBackend:
    slots = tier.usable_bytes // block_bytes
    if slots < 1:
        raise ConfigError(f"kv_connector_extra_config: tier {tier.kind}: field capacity: "
                          f"{format_size(tier.usable_bytes)} is less than one block of {block_bytes:,} bytes")
    if tier.kind == "dram":
        return dram_backend(slots, block_bytes)
    if tier.kind == "nvme":
        return claim_nvme(Path(tier.path), slots, block_bytes)
    return PFSBackend(Path(tier.path), slots * block_bytes)


MAX_SLABS_PER_PATH = 256  # engines of one node sharing an nvme path: past it a fault is an error, not an endless search


def claim_nvme(path: Path, slots: int, block_bytes: int) -> NVMeBackend:
    """This engine's nvme tier: a slab in the first of `path/r0`, `path/r1`, ... that no live backend owns
    (`SlabInUse`: another replica on this node, or an engine of this process not yet shut down).

    Why: N engines on a node given one path get N slabs, never one slab with N slot indexes; an engine started
    after the one before it exited (or released its store) takes `r0` again and reuses its file, instead of
    leaving a new slab behind on every restart."""
    for replica in range(MAX_SLABS_PER_PATH):
        try:
            return NVMeBackend(path / f"r{replica}", slots, block_bytes)
        except SlabInUse:
            continue
    raise StorageError(f"nvme: all {MAX_SLABS_PER_PATH} slabs under {path} (r0 to r{MAX_SLABS_PER_PATH - 1}) are in "
                       f"use by live engines; give this engine's nvme tier another path")


def build_store(config: ConnectorConfig, block_bytes: int) -> LocalBlockStore:
    """The tiers over `block_bytes` blocks; a pfs tier's existing files are adopted (extras deleted)."""
    backends = [_backend(t, block_bytes) for t in config.tiers]
    tiered = TieredStore(backends, block_bytes, config.policy)
    for index, backend in enumerate(backends):
        if isinstance(backend, PFSBackend):
            drop = tiered.manager.adopt(index, backend.keys())
            if drop:
                backend.delete(drop)
    return LocalBlockStore(tiered)


def open_cluster(link: ClusterLink) -> Cluster:
    """The cluster `link` names, through the factory its `store_factory` names ("module:callable", imported
    now: the core never imports the Ray side), or a ConfigError naming the field."""
    module_name, _, attr = link.store_factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"kv_connector_extra_config.cluster.store_factory: cannot load {link.store_factory!r} "
                          f"({exc}); install kvcluster[cluster] for the Ray cluster's store") from None
    return factory(link)


@dataclass
class EngineStore:
    """One engine's store and what its connector moved through it.

    `local` is the engine's own tiers; `store` is what the connector reads and writes (`ConnectorStore`):
    `local` itself, or a cluster's tiers behind it (`Cluster.store`). The connector calls `store` directly;
    this record only keeps them and the counters together for the engine's two connectors."""

    local: LocalBlockStore
    store: ConnectorStore
    loaded_blocks: int = 0  # blocks copied from the store into vLLM's paged KV
    failed_blocks: int = 0  # blocks the scheduler was promised that did not load (corrupt or gone): recomputed
    saved_blocks: int = 0  # blocks copied from vLLM's paged KV into the store
    answers_told: int = 0  # finished requests whose answer (length, finish) went to the store's policy
    saving: list = field(default_factory=list)  # Futures of background stores (`async_saves`)
    lending: Lending | None = None  # set when the engine lends its paged KV as its node's hbm tier
    holders: int = 0  # the engine's connectors using this store: the last to release it closes its files

    def wait_saved(self, timeout_s: float | None = None) -> None:
        """Block until every background store handed over so far is in the tiers (or failed and logged)."""
        pending, self.saving = list(self.saving), []
        wait(pending, timeout=timeout_s)


_stores: dict[str, EngineStore] = {}
_stores_lock = threading.Lock()


def shared_store(engine: str, config: ConnectorConfig, block_bytes: int) -> EngineStore:
    """The one store of engine `engine` (built by whichever of its connectors asks first)."""
    with _stores_lock:
        shared = _stores.get(engine)
        if shared is None:
            local = build_store(config, block_bytes)
            remote = None if config.cluster is None else open_cluster(config.cluster).store(local, block_bytes)
            shared = _stores[engine] = EngineStore(local, local if remote is None else remote)
        elif shared.local.tiered.block_bytes != block_bytes:
            raise ConfigError(f"engine {engine}: connectors disagree on the block size "
                              f"({shared.local.tiered.block_bytes} vs {block_bytes} bytes)")
        shared.holders += 1
        return shared


def release_store(engine: str) -> None:
    """One of engine `engine`'s connectors is done with its store (its engine shut down). The last one forgets
    it and closes its nvme slab, so that an engine started next in this process claims the same slab again
    (the two connectors of one engine shut down in either order); file tiers keep their blocks."""
    with _stores_lock:
        shared = _stores.get(engine)
        if shared is None:
            return
        shared.holders -= 1
        if shared.holders > 0:
            return
        del _stores[engine]
    close_files(shared.local)


def close_files(local: LocalBlockStore) -> None:
    """Close the store's nvme slab (its lock with it); nothing may use the store after this."""
    for backend in local.tiered.backends:
        if isinstance(backend, NVMeBackend):
            backend.close()


def engine_stores() -> dict[str, EngineStore]:
    """The live stores by engine, for stats and tests."""
    with _stores_lock:
        return dict(_stores)
