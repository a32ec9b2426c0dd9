"""What the vLLM connector asks of the tiers behind it: the store protocol, apart from where it runs.

`KVClusterConnector` talks to one `ConnectorStore`: `held` (lookup), `fetch` (load), `store` (save) and
`answered`, plus what an engine's own tiers report (`holds`, `residency_changes`, `checkpoint`). Two
implementations: `LocalBlockStore` (`kvcluster.serving.block_store`, this process's tiers, what every test
without Ray uses) and, on a kvcluster cluster, the Ray one the config names (`ClusterLink.store_factory`,
resolved at run time, so `kvcluster/` never imports `kvcluster.actors` or `kvcluster.serve_apps`). Behind both,
a `store` is the node writer's three steps, as in vLLM's `kv_offload`: prepare (the `CacheManager`'s policy
places the request and names each new block's tier), the copy, complete (the blocks that did not land leave
the bookkeeping: a miss later, never a claim no tier backs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from ...keys import BlockKey
from ...serving.block_store import BlockStore

if TYPE_CHECKING:
    import torch

    from ...serving.block_store import LocalBlockStore
    from .paged_kv import PagedKV


class ConnectorStore(BlockStore, Protocol):
    """The store of one engine (or one tensor-parallel worker's shard). `fetch`, `store` and `answered` as
    `BlockStore` says; each may be called from the connector's loader or saver thread."""

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` can be loaded: the engine's own tiers, then (a cluster) any node's.
        A lookup: no use is counted, nothing is pinned (a block gone by the load is a load error, recomputed)."""

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each block is in the engine's own tiers (a save then sends no bytes for it)."""

    def residency_changes(self) -> tuple[list[BlockKey], list[BlockKey], bool]:
        """(entered, left, full listing) of the engine's own tiers since the last call
        (`LocalBlockStore.residency_changes`)."""

    def checkpoint(self) -> int:
        """Copy the engine's memory tiers into its pfs tier at a clean shutdown; the blocks copied."""


class Lending(Protocol):
    """The engine's paged KV lent as its node's hbm tier (`lending.py`), as the connector drives it."""

    def written(self, block_ids: Sequence[int]) -> None:
        """vLLM writes these blocks' pages: whatever they held is lent no more."""

    def lend(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """These blocks' pages hold these keys, complete."""

    def flush(self) -> None:
        """The step's changes to the cluster, in one call."""

    def close(self, timeout_s: float) -> None:
        """Stop lending."""


@runtime_checkable
class ClusterStore(ConnectorStore, Protocol):
    """A `ConnectorStore` on a cluster: blocks from other nodes' memory tiers land in the engine's pages."""

    def fetch_placed(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None,
                     pages: Sequence[Sequence["torch.Tensor"]] | None) -> tuple[list[np.ndarray], set[int]]:
        """`fetch`, where block i may land in `pages[i]`; the second value: the positions already there."""

    def register(self, region: "torch.Tensor") -> None:
        """Memory (the paged KV) that `fetch_placed` may write blocks straight into."""

    def lend(self, paged: "PagedKV", suffix: str) -> Lending | None:
        """Lend `paged` as this node's hbm tier (`suffix`: a tensor-parallel worker's part of the name), or None
        where it cannot (another engine lends already, NIXL cannot register the memory)."""


class BlockRuns(Protocol):
    """A cluster's block index, as a scheduler whose workers run elsewhere asks it."""

    def held_runs(self, runs: Sequence[Sequence[BlockKey]], timeout_s: float | None = None) -> list[int]:
        """For each run of keys, how many leading blocks some node holds."""


class Cluster(Protocol):
    """What `ClusterLink.store_factory` returns for a link: the way into one running cluster."""

    def store(self, local: "LocalBlockStore", block_bytes: int) -> ClusterStore:
        """The engine's store: `local` first, then the cluster's tiers; a ConfigError says what is missing."""

    def index(self) -> BlockRuns:
        """The cluster's block index; a ConfigError says what is missing."""

