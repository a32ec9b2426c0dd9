"""A vLLM engine's way into a running kvcluster cluster: the Ray side of the connector's store.

`ClusterLink.store_factory` names `connect` (resolved at run time by `kvcluster.integrations.vllm.store`,
so the core never imports this package): it joins the Ray cluster and returns an `EngineCluster`, whose
`store` is a `ClusterBlockStore` over the engine's own tiers (`ClusterStore` of
`kvcluster.integrations.vllm.base`) and whose `index` is the block index a scheduler asks when its
workers run elsewhere. Every missing piece is a ConfigError that says what to start.
"""

from __future__ import annotations

import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ray

from kvcluster.actors.index_actor import NAMESPACE
from kvcluster.actors.index_client import IndexClient
from kvcluster.actors.node_parts import ensure_node_parts, ray_node_name
from kvcluster.actors.tier_actor import actor_name
from kvcluster.errors import ConfigError
from kvcluster.integrations.vllm.store import AUTO_NODE, ClusterLink
from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.storage import PFSBackend, StorageError
from kvcluster.tiers import TIER_ORDER

from .cluster_store import ClusterBlockStore
from kvcluster.serving.shared_files import SharedFiles

MIB = 1 << 20


class EngineCluster:
    """The cluster a `ClusterLink` names, this process joined to it."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    def node(self, block_bytes: int) -> str:
        """This engine's node: the link's name, or with `auto` the Ray node this process runs on, whose parts
        (tier actors, controller) and the cluster's global actors are started here when the link gives `tiers`."""
        link = self.link
        if link.node != AUTO_NODE:
            return link.node
        if link.tiers is None:
            return ray_node_name()
        # the predictor's posteriors outlive it in the shared directory (else in this node's temp dir)
        root = Path(link.shared.path) if link.shared else Path(tempfile.gettempdir()) / "kvcluster"
        try:
            return ensure_node_parts(link.tiers, block_bytes, link.policy, str(root / "predictor"))
        except ValueError as exc:  # a tier that holds no block of this engine's
            raise ConfigError(f"kv_connector_extra_config.cluster.tiers: {exc}") from None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ConfigError(f"kv_connector_extra_config.cluster.tiers: this node's tier actors did not start: "
                              f"{exc}") from None

    def store(self, local: LocalBlockStore, block_bytes: int) -> ClusterBlockStore:
        """A `ClusterBlockStore` over `local` on the running cluster, or a ConfigError that says what is missing."""
        link = self.link
        node = self.node(block_bytes)
        tiers = []
        for tier in TIER_ORDER:
            try:
                tiers.append(ray.get_actor(actor_name(node, tier), namespace=NAMESPACE))
            except ValueError:
                continue
        if not tiers:
            raise ConfigError(f"kv_connector_extra_config.cluster.node: no tier actors of node {node!r} are "
                              f"running; start the cluster first (`kvcluster cluster up CONFIG`), or give "
                              f"cluster.tiers so that engines start their node's part themselves")
        for described in ray.get([t.describe.remote() for t in tiers], timeout=link.timeout_s):
            if described["slot_bytes"] < block_bytes:
                raise ConfigError(
                    f"kv_connector_extra_config.cluster: tier {node}/{described['tier']} holds blocks of "
                    f"{described['slot_bytes']:,} bytes, this engine's blocks are {block_bytes:,} (vLLM's block of "
                    f"every layer); give the cluster YAML this engine's model, dtype and block_tokens")
        shared = None
        if link.shared is not None:
            try:
                shared = SharedFiles(PFSBackend(link.shared.path, link.shared.usable_bytes))
            except StorageError as exc:
                raise ConfigError(f"kv_connector_extra_config.cluster.shared: {exc}") from None
        try:
            staging = None if link.nixl_staging_mib is None else int(link.nixl_staging_mib * MIB)
            return ClusterBlockStore(local, node, timeout_s=link.timeout_s, nixl_staging_bytes=staging, shared=shared)
        except ValueError as exc:  # the index or predictor actor is not running
            raise ConfigError(f"kv_connector_extra_config.cluster: the cluster's global actors are not running "
                              f"({exc}); start the cluster first (`kvcluster cluster up CONFIG`)") from None

    def index(self) -> IndexClient:
        """The cluster's block index, for a scheduler whose workers run elsewhere, or a ConfigError."""
        try:
            return IndexClient.connect(timeout_s=self.link.timeout_s)
        except (ValueError, TimeoutError) as exc:  # no index actor, or one that does not answer (GetTimeoutError)
            raise ConfigError(f"kv_connector_extra_config.cluster: the cluster's index is not running ({exc}); "
                              f"start the cluster first (`kvcluster cluster up CONFIG`)") from None


@contextmanager
def unseeded_random() -> Iterator[None]:
    """Python's `random` drawn from the OS inside, and left as it was outside.

    Why: Ray draws a driver's GCS subscriber ids from `random` (`ray._private.gcs_pubsub`), and vLLM seeds it
    with the engine's seed in every worker before the connector joins. Two tensor-parallel workers then
    subscribe under one id and take each other's long poll at the GCS: both spin (~10% of a core each) and
    the GCS answers ~1,000 polls a second for every such pair. The engine's own random stream is untouched."""
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


def connect(link: ClusterLink) -> EngineCluster:
    """Join the Ray cluster of `link` unless this process has joined one (a ConfigError naming the address)."""
    if not ray.is_initialized():
        try:
            with unseeded_random():
                ray.init(address=link.address, namespace=NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"kv_connector_extra_config.cluster.address: no Ray cluster at {link.address!r}: "
                              f"{first}") from None
    return EngineCluster(link)
