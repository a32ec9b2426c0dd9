"""The placement controller: reads occupancy and predictor snapshots, issues batched moves.

Each round costs a fixed handful of remote calls: one index view, one
predictor snapshot, one `describe` per tier actor (gathered together), then
per (source, destination) pair one copy and one `delete`. Between nodes, from a
memory tier, the copy is the destination's `pull`: its NIXL agent reads the
source's slab directly (UCX: RDMA where the nodes have it). Within a node, or when
NIXL cannot serve a pair, bytes travel as Ray objects (`get_many` + `put_many`,
the measured fallback). A source is deleted only for keys its destination
acknowledged as verified bytes, so a referenced block is never in zero places.
"""

from __future__ import annotations

import threading
from collections import Counter

import ray

from kvcluster.block_types import BlockType, TransitionType, pair_index
from kvcluster.placement import Migration, PlacementConfig, group_moves, plan_moves
from kvcluster.predictor import PredictorSnapshot

from . import metrics
from .index_actor import INDEX_NAME, NAMESPACE
from .predictor_actor import PREDICTOR_NAME
from .tier_actor import actor_name

PLACEMENT_NAME = "kvcluster/placement"
DEFAULT_PAIR = pair_index(int(BlockType.HISTORY), int(TransitionType.FIRST))
NIXL_TIERS = ("dram", "cxl")  # tiers whose pool other nodes read over NIXL


@ray.remote(num_cpus=0, max_restarts=-1)
class PlacementController:
    def __init__(self, tiers: list[tuple[str, str]], config: dict | None = None, head_shards: int = 1) -> None:
        """`head_shards`: head shards per block payload (kv heads; 1 for an MLA latent): an evicted block
        takes that many shards with it, counted as `unit="head_shard"` next to `unit="block"`."""
        self.cfg = PlacementConfig.model_validate(config or {})
        self.head_shards = head_shards
        self.tiers = [tuple(t) for t in tiers]
        self.index = ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
        self.predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
        self.totals: Counter = Counter()
        self._pending: list[Migration] = []
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._lock = threading.Lock()  # the background loop and remote `step` calls take turns
        self._block_bytes: dict = {}

    def migrate(self, keys: list[bytes], node: str) -> None:
        """Ask for a session's blocks to be on `node` by the next round."""
        self._pending.append(Migration(tuple(keys), node))

    def step(self) -> dict:
        """One planning round; returns what it moved and what failed."""
        with self._lock:
            return self._step()

    def _step(self) -> dict:
        actors = {loc: ray.get_actor(actor_name(*loc), namespace=NAMESPACE) for loc in self.tiers}
        view = self.index.placement_view.remote(DEFAULT_PAIR)
        snap_ref = self.predictor.snapshot.remote()
        described = ray.get([a.describe.remote() for a in actors.values()], timeout=30)
        holdings, pairs = ray.get(view, timeout=30)
        snap: PredictorSnapshot = ray.get(snap_ref, timeout=30)
        capacity = {(d["node"], d["tier"]): d["capacity_blocks"] for d in described}
        self._block_bytes = {(d["node"], d["tier"]): d.get("slot_bytes", 0) for d in described}
        migrations, self._pending = self._pending, []
        try:
            return self._carry_out(actors, holdings, pairs, snap, capacity, migrations)
        except BaseException:
            self._pending = migrations + self._pending  # a failed round loses no requested migration
            raise

    def _carry_out(self, actors, holdings, pairs, snap, capacity, migrations) -> dict:
        moves = plan_moves({loc: ks for loc, ks in holdings.items() if loc in capacity}, capacity,
                           lambda k: snap.p_reuse(pairs.get(k, DEFAULT_PAIR)), self.cfg, migrations)
        done: Counter = Counter()
        for (src, dst), group in group_moves(moves).items():
            to_copy = [m.key for m in group if m.copy]
            acked: set[bytes] = {m.key for m in group if not m.copy}
            via: Counter = Counter()
            prefetch = all(m.reason == "promote" for m in group)
            if to_copy and src[0] != dst[0] and src[1] in NIXL_TIERS:
                stored = ray.get(actors[dst].pull.remote(actor_name(*src), to_copy,
                                                         [pairs.get(k, DEFAULT_PAIR) for k in to_copy], prefetch),
                                 timeout=120)
                acked.update(k for k, good in zip(to_copy, stored) if good)
                via["nixl"] += sum(bool(g) for g in stored)
                done["put_refused"] += sum(g is False for g in stored)
                to_copy = [k for k, g in zip(to_copy, stored) if g is None]  # unread over NIXL: try the object store
            if to_copy:
                payloads, digests = ray.get(actors[src].read_verified.remote(to_copy), timeout=60)
                present = [(k, p, d) for k, p, d in zip(to_copy, payloads, digests) if p is not None]
                done["source_missing"] += len(to_copy) - len(present)
                if present:
                    ks = [k for k, _, _ in present]
                    ok = ray.get(actors[dst].put_many.remote(ks, [p for _, p, _ in present],
                                                             [pairs.get(k, DEFAULT_PAIR) for k in ks], prefetch,
                                                             [d for _, _, d in present]),
                                 timeout=60)
                    acked.update(k for k, good in zip(ks, ok) if good)
                    done["put_refused"] += sum(not good for good in ok)
                    via["object_store"] += sum(ok)
            drop = [m.key for m in group if m.drop_source and m.key in acked]
            if drop:
                ray.get(actors[src].delete.remote(drop), timeout=60)
            for m in group:
                if m.key in acked:
                    done[m.reason] += 1
                    if m.reason in ("demote", "spill") and m.drop_source:
                        metrics.evictions().inc(1, {"node": src[0], "tier": src[1], "unit": "block"})
                        metrics.evictions().inc(self.head_shards, {"node": src[0], "tier": src[1],
                                                                   "unit": "head_shard"})
                    if m.reason == "promote":
                        metrics.prefetches().inc(1, {"outcome": "issued"})
            for how, blocks in via.items():
                done[f"{how}_blocks"] += blocks
                if blocks:
                    metrics.bytes_moved().inc(blocks * self._block_bytes.get(src, 0),
                                              {"src": f"{src[0]}/{src[1]}", "dst": f"{dst[0]}/{dst[1]}", "how": how})
        done["planned"] = len(moves)
        self.totals.update(done)
        return dict(done)

    def start(self, period_s: float = 1.0) -> bool:
        """Run `step` every `period_s` seconds in the background until `stop`."""
        if self._loop is not None and self._loop.is_alive():
            return False
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.step()
                except Exception as e:  # a tier actor restarting or absent: count it, try again next round
                    self.totals["failed_rounds"] += 1
                    self.totals[f"last_error:{type(e).__name__}"] = 1

        self._loop = threading.Thread(target=loop, daemon=True, name="placement")
        self._loop.start()
        return True

    def totals_so_far(self) -> dict:
        return dict(self.totals)

    def stop(self) -> dict:
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout=30)
        return dict(self.totals)
