"""Prefix-aware routing: send a request to a replica on the node that holds its longest cached prefix.

The ingress looks the prefix up in the global index and passes the Ray node id
as `prefer_node`. Replicas on that node form the first rank unless they are
full (their queue is at `max_ongoing_requests`); every other replica is the
fallback rank, where Serve picks the shortest queue.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        node = pending_request.kwargs.get("prefer_node") if pending_request is not None else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not node:
            return [candidate_replicas]
        available = {r.replica_id for r in self.select_available_replicas(candidate_replicas)}
        return rank_by_node(candidate_replicas, node, available)


def rank_by_node(replicas: List, node: str, available: set) -> List[List]:
    """[replicas on `node` with room, every other replica]; one rank when either is empty."""
    near = [r for r in replicas if r.node_id == node and r.replica_id in available]
    far = [r for r in replicas if r not in near]
    return [near, far] if near and far else [near or far]
