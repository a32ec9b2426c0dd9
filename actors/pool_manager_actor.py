"""The pooled tier's manager as an actor: a `PoolManager` (metadata only), named `kvcluster/pool`.

As Mooncake's master, it decides and the clients move the bytes: every call is
batched per request (`lookup` of a request's keys, `access` of a request served
on some node), and carries keys, a location name and the request's context. The
blocks go from the node that computed or read them into the pool's storage (the
shared filesystem, a peer's lent DRAM) and from there to the node that reads
them; `stats()` counts any payload that reached this actor as an argument
(`payload_bytes`, 0 by design, as for the node controllers).

Its state is the policy's. It is restarted when its process dies, and takes
back what the pool's storage holds (`PoolManager.adopt`), so the pool keeps
serving it, deleting what no longer fits: a file pool's directory (`files`), or
each lent-DRAM share (`shares`: the shares' actor names, which are their
locations), asked for its keys all at once. A share that does not answer in
time (its node gone or going) is left out: its blocks are never served, and a
reader that finds it dead has the manager forget it as before. Calls in flight
when the manager died fail; the callers' reads of them are misses.
"""

from __future__ import annotations

import os
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvcluster.policies.base import RequestContext
from kvcluster.pool import PoolManager
from kvcluster.storage import PFSBackend

from .index_actor import NAMESPACE
from .node_control_actor import payload_bytes

POOL_MANAGER_NAME = "kvcluster/pool"
SHARE_ANSWER_S = 30.0  # how long a restarting manager waits for the lent shares to list their blocks


def pool_manager_handle(namespace: str = NAMESPACE):
    """The running pool manager, found by name (ValueError when there is none)."""
    return ray.get_actor(POOL_MANAGER_NAME, namespace=namespace)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class PoolManagerActor:
    def __init__(self, policy: str, capacity: int, policy_options: dict | None = None,
                 files: tuple[str, str] | None = None, shares: list[str] | None = None) -> None:
        """`files`: (directory, location) of a file pool; `shares`: the actor names of the lent-DRAM shares
        (each its location). Either is adopted when the manager starts."""
        self.pool = PoolManager(policy, capacity, policy_options)
        self.payload_bytes = 0
        self.calls = 0
        if files is not None:
            directory, location = files
            storage = PFSBackend(directory, 1 << 62)  # listed and trimmed only: the manager bounds what it holds
            storage.delete(self.pool.adopt(storage.keys(), location))
        if shares:
            self._adopt_shares(shares)
        self.adopted = len(self.pool)

    def _adopt_shares(self, names: list[str]) -> None:
        """Each share's blocks, one listing call per share in flight together; a share that is gone, not
        started yet, or silent past SHARE_ANSWER_S adopts nothing."""
        listed = {}
        for name in names:
            try:
                share = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
            listed[name] = (share, share.held_keys.remote())
        deadline = time.monotonic() + SHARE_ANSWER_S  # one wait for all: silent shares do not add up
        for name, (share, ref) in listed.items():
            try:
                keys = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError):
                continue
            extra = self.pool.adopt(keys, name)
            if extra:
                share.delete.remote(extra)  # no answer awaited: what is not adopted is never served

    def _guard(self, *args) -> None:
        self.calls += 1
        self.payload_bytes += payload_bytes(args)

    def lookup(self, keys: list[bytes]) -> list[str | None]:
        """Per key, the location the pool holds it at (None: not in the pool)."""
        self._guard(keys)
        return self.pool.lookup(keys)

    def access(self, keys: list[bytes], ctx: RequestContext, at: str) -> tuple[list[bytes], dict[str, list[bytes]]]:
        """A request served on a node whose pool writes go to location `at`: the keys it writes there, and per
        location the stored keys it deletes (they left the pool)."""
        self._guard(keys, ctx, at)
        return tuple(self.pool.access(keys, ctx, at))

    def lookup_access(self, keys: list[bytes], ctx: RequestContext, at: str
                      ) -> tuple[list[str | None], list[bytes], dict[str, list[bytes]]]:
        """`lookup` then `access` of one request, one call: where the pool holds each key before the request,
        then what the node writes and deletes once it has read its hits (a block deleted before a reader got
        to it is a miss for that reader, never another block's bytes)."""
        self._guard(keys, ctx, at)
        where = self.pool.lookup(keys)
        return (where, *self.pool.access(keys, ctx, at))

    def forget(self, keys: list[bytes]) -> int:
        """Blocks a reader found missing or corrupt, or a writer could not store: they leave the pool."""
        self._guard(keys)
        return self.pool.forget(keys)

    def lost(self, location: str) -> int:
        """The storage at `location` is gone (its node died): its blocks are forgotten, never returned again."""
        self._guard(location)
        return self.pool.lost(location)

    def pid(self) -> int:
        """This process's id (what a test kills to see the manager restart)."""
        return os.getpid()

    def stats(self) -> dict:
        return {"policy": self.pool.policy_name, "capacity_blocks": self.pool.capacity, "blocks": len(self.pool),
                "adopted": self.adopted,
                "locations": self.pool.locations(), "calls": self.calls, "payload_bytes": self.payload_bytes,
                **self.pool.counters}
