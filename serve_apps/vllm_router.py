"""Session-affine routing for vLLM replicas: a session stays on one replica, new sessions go to the least loaded.

A vLLM replica keeps its KV in its own engine (vLLM's prefix cache, then the connector's tiers in the same
process), which no index sees, so where a conversation's next turn is served decides whether its history is
cached. The decision is the core's `SessionRouter`, the same one the simulator replays a cluster with: a
request that names its session (the API's `user`, per tenant) goes where the session went before; a new
session goes to the replica with the fewest blocks routed to it over the last `window_s` seconds; a request
without one follows the sessionless request it continues (its earlier prompt is a prefix of this one). A
shared system prompt therefore does not pull every conversation onto one replica, as routing by the leading
block did.

Serve's replicas come and go: a replica seen for the first time joins the router, one no longer among the
candidates leaves it, and its sessions are placed again on their next request. A request whose replica is
full (its queue at `max_ongoing_requests`) goes where Serve finds the shortest queue, and its session keeps
its replica.

Serve runs a router in every process that calls the replicas (each ingress replica), but a session's turns
may reach any ingress. So the decisions are one object's: a `SessionDirectory` actor per deployment (detached,
found by name, torn down with Serve, as Ray Serve LLM's prefix-tree actor is), asked once per request with
the request's block keys, hashed by the ingress; its clock times the load window. If it cannot answer (it
died; Ray restarts it empty), the ingress decides alone meanwhile: affinity then holds per ingress until the
directory is back, and what it forgot is placed again as new.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Hashable, List, Optional, Sequence

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvcluster.keys import KeySpace
from kvcluster.session_routing import WINDOW_S, SessionRouter


MAX_DECISIONS = 4096  # requests whose replica is remembered, for Serve's retries of the same request
DIRECTORY_NAME = "kvcluster-sessions"
DIRECTORY_TIMEOUT_S = 5.0  # past this, an ingress routes the request alone (the directory is restarting)
DIRECTORY_START_S = 120.0  # the first answer may wait for the directory's process to start
ALONE_S = 10.0  # after the directory failed to answer, an ingress decides alone this long before asking again


class ReplicaSessions:
    """`SessionRouter` over Serve replicas by id; pure, so the tests drive it with fake replicas."""

    def __init__(self, block_tokens: int, root_seed: str = "kvcluster-v1", window_s: float = WINDOW_S) -> None:
        self.block_tokens = block_tokens
        self.keys = KeySpace(model="route", root_seed=root_seed)
        self.window_s = window_s
        self.router: SessionRouter | None = None
        self.node_of: dict[str, int] = {}  # replica id -> the router's node
        self._decided: OrderedDict[str, str] = OrderedDict()  # request id -> replica id

    def blocks(self, prompt_ids: Sequence[int], cache_salt: str = "") -> list:
        """The prompt's full blocks as chained keys, salted per tenant: what routing compares."""
        b = self.block_tokens
        return self.keys.chain_token_ids(list(prompt_ids[: len(prompt_ids) // b * b]), b, cache_salt)

    def choose(self, replica_ids: Sequence[str], request_id: str, session: str, prompt_ids: Sequence[int],
               cache_salt: str = "", now: float = 0.0) -> str:
        """The replica for this request (`place` of its blocks)."""
        return self.place(replica_ids, request_id, session, self.blocks(prompt_ids, cache_salt), now)

    def place(self, replica_ids: Sequence[str], request_id: str, session: str, blocks: Sequence[Hashable],
              now: float = 0.0) -> str:
        """The replica for a request with these block keys. Asked again for the same request (Serve retries a
        full replica's), the same answer while that replica is a candidate: the request is counted once."""
        known = self._decided.get(request_id)
        if known is not None and known in replica_ids:
            return known
        self._sync(replica_ids)
        node = self.router.route(session, blocks, now)
        replica = next(rid for rid, n in self.node_of.items() if n == node)
        self._decided[request_id] = replica
        if len(self._decided) > MAX_DECISIONS:
            self._decided.popitem(last=False)
        return replica

    def _sync(self, replica_ids: Sequence[str]) -> None:
        """New replicas join (in id order, so two routers fed the same replicas agree), missing ones leave."""
        if not replica_ids:
            raise ValueError("no replica to route to")
        current = set(replica_ids)
        for rid in [r for r in self.node_of if r not in current]:
            self.router.leave(self.node_of.pop(rid))
        for rid in sorted(current - set(self.node_of)):
            if self.router is None:
                self.router = SessionRouter(1, window_s=self.window_s)
                self.node_of[rid] = 0
            else:
                self.node_of[rid] = self.router.join()


def rank_for(replicas: List, chosen: str, available: set) -> List[List]:
    """[the chosen replica, every other] when it has room; else one rank, where Serve takes the shortest queue."""
    first = next((r for r in replicas if str(r.replica_id) == chosen and r.replica_id in available), None)
    if first is None:
        return [list(replicas)]
    rest = [r for r in replicas if r is not first]
    return [[first], rest] if rest else [[first]]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class SessionDirectory:
    """Every ingress's routing decisions for one deployment: a `ReplicaSessions` on this actor's clock."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.sessions = ReplicaSessions(1, window_s=window_s)  # keys arrive hashed: its block size is unused

    def place(self, replica_ids: list[str], request_id: str, session: str, blocks: list) -> str:
        return self.sessions.place(replica_ids, request_id, session, blocks, time.monotonic())

    def sessions_known(self) -> int:
        return 0 if self.sessions.router is None else self.sessions.router.sessions_known


def session_directory(app: str, deployment: str, window_s: float = WINDOW_S):
    """The deployment's directory, started by whichever ingress asks first; Serve kills it at shutdown."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    directory = SessionDirectory.options(name=DIRECTORY_NAME, namespace=f"{SERVE_NAMESPACE}::{app}::{deployment}",
                                         get_if_exists=True, lifetime="detached").remote(window_s)
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return directory  # no Serve controller (a router outside Serve): whoever started it kills it
    controller._register_shutdown_cleanup_actor.remote(directory)  # not awaited: this runs on the router's loop
    return directory


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    """Routes `generate(job)` calls by `job["session"]` and `job["prompt_ids"]` (request_router_kwargs:
    `block_tokens`, `root_seed`, `window_s`), through the deployment's `SessionDirectory`."""

    def initialize_state(self, block_tokens: int = 128, root_seed: str = "kvcluster-v1", window_s: float = WINDOW_S,
                         **kwargs) -> None:
        self.sessions = ReplicaSessions(block_tokens, root_seed, window_s)  # hashes; decides while alone
        deployment = getattr(self, "_deployment_id", None)
        self.directory = session_directory(getattr(deployment, "app_name", "") or "",
                                           getattr(deployment, "name", "") or "", window_s)
        self.routed_alone = 0  # requests decided here because the directory did not answer
        self.directory_answered = False
        self.alone_until = 0.0  # a directory that failed is not asked again before this (a hung one would
        # otherwise cost every request DIRECTORY_TIMEOUT_S)

    async def place(self, replica_ids: list[str], request_id: str, session: str, blocks: list) -> str:
        if time.monotonic() >= self.alone_until:
            try:
                ref = self.directory.place.remote(replica_ids, request_id, session, blocks)
                chosen = await asyncio.wait_for(
                    ref, DIRECTORY_TIMEOUT_S if self.directory_answered else DIRECTORY_START_S)
                self.directory_answered = True
                return chosen
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):
                self.alone_until = time.monotonic() + ALONE_S
        self.routed_alone += 1
        return self.sessions.place(replica_ids, request_id, session, blocks, time.monotonic())

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(job, dict) or not job.get("prompt_ids"):
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        blocks = self.sessions.blocks(job["prompt_ids"], job.get("cache_salt", ""))
        chosen = await self.place([str(r.replica_id) for r in candidate_replicas],
                                  pending_request.metadata.internal_request_id, job.get("session", ""), blocks)
        available = {r.replica_id for r in self.select_available_replicas(candidate_replicas)}
        return rank_for(candidate_replicas, chosen, available)
