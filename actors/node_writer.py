"""How an engine's new KV reaches its node's tiers: metadata to the node's controller, bytes to the tiers.

One store is three steps, batched per request: `prepare_store` on the node's
controller (keys and context only: it places the request with the policy, makes
room and names the tier actor each new block goes to), one `put_many` per tier
actor named, all in flight together (the payloads go from this process to the
tier through the node's object store, never through the controller; the victims
the controller handed over are deleted first in the same call), then
`complete_store` with what landed, carried by the writer's next `prepare_store`
(one call per store; a writer's calls reach the controller in order) or sent
alone by `flush`, which a writer calls when it has nothing more to store.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np
import ray

from kvcluster.policies.base import RequestContext

from .index_actor import NAMESPACE
from .node_control_actor import control_handle
from .plan_mover import CALL_TIMEOUT_S

log = logging.getLogger(__name__)


class NodeWriter:
    def __init__(self, node: str, timeout_s: float = CALL_TIMEOUT_S, namespace: str = NAMESPACE) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.namespace = namespace
        self._control = None
        self._tiers: dict[str, object] = {}
        self._unsent = None  # (plan id, writes, failed) of the last store: its completion, not yet sent
        self.counters = {"stores": 0, "written": 0, "refused": 0, "unplaced": 0, "control_unavailable": 0}

    def control(self):
        if self._control is None:
            self._control = control_handle(self.node, self.namespace)
        return self._control

    def _tier(self, name: str):
        if name not in self._tiers:
            self._tiers[name] = ray.get_actor(name, namespace=self.namespace)
        return self._tiers[name]

    def store(self, keys: Sequence[bytes], new: Mapping[bytes, np.ndarray], ctx: RequestContext | None = None,
              pairs: Mapping[bytes, int] | None = None) -> int:
        """Place the request `keys` served on this node and write its `new` blocks where the controller says.
        Returns how many new blocks landed in a tier. No controller (down, restarting): nothing is written,
        the blocks stay with the caller (misses elsewhere, never wrong)."""
        try:
            plan_id, writes = ray.get(self.control().prepare_store.remote(list(keys), list(new), ctx, self._unsent),
                                      timeout=self.timeout_s)
            self._unsent = None
        except (ValueError, ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("controller of %s unavailable (%s): these blocks stay with the engine", self.node,
                        type(exc).__name__)
            self._control = None
            self.counters["control_unavailable"] += 1
            return 0
        self.counters["stores"] += 1
        refs, failed = {}, []
        for name, ks, evict in writes:
            try:
                refs[name] = self._tier(name).put_many.remote(
                    ks, [new[k] for k in ks], None if pairs is None else [pairs.get(k, 0) for k in ks], False,
                    None, evict)
            except ValueError:  # the tier actor is gone: its blocks are refused
                self._tiers.pop(name, None)
                failed.extend(ks)
        for name, ks, _ in writes:
            if name not in refs:
                continue
            try:
                ok = ray.get(refs[name], timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                self._tiers.pop(name, None)
                ok = [False] * len(ks)
            failed.extend(k for k, good in zip(ks, ok) if not good)
        placed = sum(len(ks) for _, ks, _ in writes)
        self.counters["written"] += placed - len(failed)
        self.counters["refused"] += len(failed)
        self.counters["unplaced"] += len(new) - placed
        self._unsent = (plan_id, writes, failed)
        return placed - len(failed)

    def flush(self) -> None:
        """Send the last store's completion now (a writer with nothing more to store); kept for the next store
        if the controller cannot take it (a restarted one reconciles it with what it adopted)."""
        if self._unsent is None:
            return
        try:
            ray.get(self.control().complete_store.remote(*self._unsent), timeout=self.timeout_s)
            self._unsent = None
        except (ValueError, ray.exceptions.RayError, TimeoutError):
            self._control = None
            self.counters["control_unavailable"] += 1

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended (ordered after its stores: same caller, same actor)."""
        try:
            self.control().answered.remote(session, finish, output_tokens)
        except (ValueError, ray.exceptions.RayError):
            self._control = None
            self.counters["control_unavailable"] += 1
