"""The tiers behind the vLLM connector: configured from `kv_connector_extra_config`, one store per engine.

With `cluster`, the engine's own tiers are the first of a kvcluster cluster's (`kvcluster cluster up`): the
scheduler asks them, then the cluster's block index, how much of a prompt is held anywhere; loads read
this node's tier actors first and other nodes' memory tiers over NIXL (`ClusterBlockStore`), and new
blocks go to the control plane, whose policy places them in the cluster's tiers. A tier actor that is
gone or slow is a miss, and vLLM recomputes.

vLLM builds two connector objects per engine, one for the scheduler and one per worker. With one worker
in the engine-core process (the "uni" executor) both live there and share one `LocalBlockStore` through
`shared_store`, keyed by the engine's config instance id: the scheduler asks it what it holds, the worker
moves the bytes. With workers in processes of their own (tensor parallel) each builds the store of its own
shard (`for_rank`) and reports what it holds (`holdings.py`). A store over a `pfs` (file) tier adopts the
block files already there, so a fresh engine finds the blocks an earlier one wrote; the `dram` and `nvme`
tiers start empty with their process (the nvme slab's index lives in memory).
"""

from __future__ import annotations

import threading
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...cluster_config import DEFAULT_POLICY
from ...errors import ConfigError
from ...keys import BlockKey
from ...policies import policy_names
from ...serving.block_store import LocalBlockStore
from ...storage.base import StorageBackend
from ...storage.memory import dram_backend
from ...storage.nvme import NVMeBackend
from ...storage.pfs import PFSBackend, stored_keys
from ...storage.tiered import TieredStore

MIB = 1 << 20
TIER_ORDER = ("dram", "nvme", "pfs")  # fastest first, as everywhere in kvcluster


class TierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["dram", "nvme", "pfs"] = Field(description="the medium: host memory, a slab file, block files")
    capacity_mib: float = Field(gt=0, description="bytes this tier may hold, in MiB")
    path: str | None = Field(None, description="directory of the nvme slab or the pfs block files")


class ClusterLink(BaseModel):
    """How an engine joins a running kvcluster cluster."""

    model_config = ConfigDict(extra="forbid")

    node: str = Field(description="the cluster node (a name from the cluster YAML) this engine runs on: its tiers "
                                  "are read first, and its hierarchy receives the engine's new blocks")
    address: str = Field("auto", description="the Ray cluster to join when this process has joined none "
                                             "(`ray.init(address=...)`)")
    timeout_s: float = Field(10.0, gt=0, description="an index or tier actor that does not answer in this time "
                                                     "is a miss")
    nixl_staging_mib: float | None = Field(32.0, gt=0, description="staging buffer of NIXL reads from memory "
                                                                   "tiers; null reads them through Ray's object store")
    lend_paged_kv: bool = Field(True, description="lend this engine's paged KV as the node's hbm tier: other "
                                                  "nodes read its blocks straight from its pages over NIXL (one "
                                                  "engine per node; with tensor parallelism each worker lends its "
                                                  "shards; see `lending.py`)")


class ConnectorConfig(BaseModel):
    """`kv_connector_extra_config` of `KVClusterConnector`."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[TierConfig] = Field(min_length=1, description="fastest first; new blocks enter the first")
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
    def _ordered_with_paths(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        kinds = [t.kind for t in tiers]
        if len(set(kinds)) != len(kinds) or kinds != sorted(kinds, key=TIER_ORDER.index):
            raise ValueError(f"tiers must be distinct and fastest first ({', '.join(TIER_ORDER)}), got {kinds}")
        for t in tiers:
            if t.kind != "dram" and not t.path:
                raise ValueError(f"tier {t.kind} needs a path")
            if t.kind == "dram" and t.path:
                raise ValueError("tier dram takes no path")
        return tiers

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy not in policy_names():
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(policy_names())}")
        return policy


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


def _backend(tier: TierConfig, block_bytes: int) -> StorageBackend:
    slots = int(tier.capacity_mib * MIB) // block_bytes
    if slots < 1:
        raise ConfigError(f"kv_connector_extra_config: tier {tier.kind} holds {tier.capacity_mib} MiB, "
                          f"less than one block of {block_bytes:,} bytes")
    if tier.kind == "dram":
        return dram_backend(slots, block_bytes)
    if tier.kind == "nvme":
        return NVMeBackend(Path(tier.path), slots, block_bytes)
    return PFSBackend(Path(tier.path), slots * block_bytes)


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


def _join_ray(link: ClusterLink) -> None:
    """Join the Ray cluster of `link` unless this process has joined one, or a ConfigError naming the address."""
    import ray

    from ...actors.index_actor import NAMESPACE

    if ray.is_initialized():
        return
    try:
        ray.init(address=link.address, namespace=NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"kv_connector_extra_config.cluster.address: no Ray cluster at {link.address!r}: "
                          f"{first}") from None


def cluster_index(link: ClusterLink):
    """The block index of the cluster `link` names (`IndexClient`), for a scheduler whose workers run
    elsewhere, or a ConfigError that says what is missing."""
    from ...actors.index_client import IndexClient

    _join_ray(link)
    try:
        return IndexClient.connect(timeout_s=link.timeout_s)
    except (ValueError, TimeoutError) as exc:  # no index actor, or one that does not answer (Ray's GetTimeoutError)
        raise ConfigError(f"kv_connector_extra_config.cluster: the cluster's index is not running ({exc}); start "
                          f"the cluster first (`kvcluster cluster up CONFIG`)") from None


def join_cluster(link: ClusterLink, local: LocalBlockStore, block_bytes: int):
    """A `ClusterBlockStore` over `local` on a running cluster, or a ConfigError that says what is missing."""
    import ray

    from ...actors.index_actor import NAMESPACE
    from ...actors.tier_actor import actor_name
    from ...serve_apps.cluster_store import ClusterBlockStore
    from ...tiers import TIER_ORDER

    _join_ray(link)
    tiers = []
    for tier in TIER_ORDER:
        try:
            tiers.append(ray.get_actor(actor_name(link.node, tier), namespace=NAMESPACE))
        except ValueError:
            continue
    if not tiers:
        raise ConfigError(f"kv_connector_extra_config.cluster.node: no tier actors of node {link.node!r} are "
                          f"running; start the cluster first (`kvcluster cluster up CONFIG`)")
    for described in ray.get([t.describe.remote() for t in tiers], timeout=link.timeout_s):
        if described["slot_bytes"] < block_bytes:
            raise ConfigError(
                f"kv_connector_extra_config.cluster: tier {link.node}/{described['tier']} holds blocks of "
                f"{described['slot_bytes']:,} bytes, this engine's blocks are {block_bytes:,} (vLLM's block of "
                f"every layer); give the cluster YAML this engine's model, dtype and block_tokens")
    try:
        staging = None if link.nixl_staging_mib is None else int(link.nixl_staging_mib * MIB)
        return ClusterBlockStore(local, link.node, timeout_s=link.timeout_s, nixl_staging_bytes=staging)
    except ValueError as exc:  # the index or predictor actor is not running
        raise ConfigError(f"kv_connector_extra_config.cluster: the cluster's global actors are not running "
                          f"({exc}); start the cluster first (`kvcluster cluster up CONFIG`)") from None


@dataclass
class EngineStore:
    """One engine's store and what its connector moved through it.

    `local` is the engine's own tiers; `store` is what the connector reads and writes: `local` itself,
    or a cluster's tiers behind it (`ClusterBlockStore`)."""

    local: LocalBlockStore
    store: object  # LocalBlockStore or ClusterBlockStore: fetch(keys, out), store(keys, payloads)
    loaded_blocks: int = 0  # blocks copied from the store into vLLM's paged KV
    failed_blocks: int = 0  # blocks the scheduler was promised that did not load (corrupt or gone): recomputed
    saved_blocks: int = 0  # blocks copied from vLLM's paged KV into the store
    answers_told: int = 0  # finished requests whose answer (length, finish) went to the store's policy
    saving: list = field(default_factory=list)  # Futures of background stores (`async_saves`)
    lending: object = None  # `PagedKVLending` when the engine lends its paged KV as its node's hbm tier

    def wait_saved(self, timeout_s: float | None = None) -> None:
        """Block until every background store handed over so far is in the tiers (or failed and logged)."""
        pending, self.saving = list(self.saving), []
        wait(pending, timeout=timeout_s)

    def held(self, keys: list[BlockKey]) -> int:
        """How many leading blocks of `keys` are held: in this engine's tiers, then anywhere in the cluster."""
        n = self.local.held(keys)
        if n == len(keys) or self.store is self.local:
            return n
        return n + self.store.remote_prefix(keys[n:])


_stores: dict[str, EngineStore] = {}
_stores_lock = threading.Lock()


def shared_store(engine: str, config: ConnectorConfig, block_bytes: int) -> EngineStore:
    """The one store of engine `engine` (built by whichever of its connectors asks first)."""
    with _stores_lock:
        shared = _stores.get(engine)
        if shared is None:
            local = build_store(config, block_bytes)
            remote = None if config.cluster is None else join_cluster(config.cluster, local, block_bytes)
            shared = _stores[engine] = EngineStore(local, local if remote is None else remote)
        elif shared.local.tiered.block_bytes != block_bytes:
            raise ConfigError(f"engine {engine}: connectors disagree on the block size "
                              f"({shared.local.tiered.block_bytes} vs {block_bytes} bytes)")
        return shared


def release_store(engine: str) -> None:
    """Forget engine `engine`'s store (its engine shut down); file tiers keep their blocks."""
    with _stores_lock:
        _stores.pop(engine, None)


def engine_stores() -> dict[str, EngineStore]:
    """The live stores by engine, for stats and tests."""
    with _stores_lock:
        return dict(_stores)
