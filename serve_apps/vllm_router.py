"""Prefix-aware routing for vLLM replicas: the prompt's leading block picks the replica, consistently.

kvcluster's own router (serve_apps/router.py) asks the cluster's global index which node holds a prompt's
longest prefix. A vLLM replica keeps its KV in its own engine (vLLM's prefix cache, then the connector's
tiers in the same process), which no index sees; so here the leading block's key (kvcluster's chained block
key of the first `route_tokens` prompt tokens and the tenant's salt) chooses the replica by rendezvous
hashing: every request that starts with the same block, above all every turn of one conversation, goes to the
same replica, where its prefix is cached, and adding or losing a replica moves only the prefixes that
replica owned. A prompt shorter than one block has nothing cached anywhere and goes where Serve finds the
shortest queue; so does a request whose replica is full (its queue at `max_ongoing_requests`).
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvcluster.keys import BlockKey, KeySpace


def leading_block_key(prompt_ids: Sequence[int], block_tokens: int, cache_salt: str = "",
                      root_seed: str = "kvcluster-v1") -> BlockKey | None:
    """The key of the prompt's first full block, or None when it has none."""
    keys = KeySpace(model="route", root_seed=root_seed).chain_token_ids(prompt_ids[:block_tokens], block_tokens,
                                                                        cache_salt)
    return keys[0] if keys else None


def rendezvous_order(replica_ids: Sequence[str], key: bytes) -> list[str]:
    """The replicas, most preferred for `key` first (highest random weight hashing)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def rank_by_prefix(replicas: List, key: bytes | None, available: set) -> List[List]:
    """[the key's most preferred replica that has room, every other replica]; one rank without a key or room."""
    if key is None:
        return [list(replicas)]
    by_id = {str(r.replica_id): r for r in replicas}
    first = next((by_id[rid] for rid in rendezvous_order(list(by_id), key) if by_id[rid].replica_id in available),
                 None)
    if first is None:
        return [list(replicas)]
    rest = [r for r in replicas if r is not first]
    return [[first], rest] if rest else [[first]]


class LeadingBlockRouter(FIFOMixin, RequestRouter):
    """Routes `generate(job)` calls by `job["prompt_ids"]`'s leading block (request_router_kwargs:
    `block_tokens`, `root_seed`)."""

    def initialize_state(self, block_tokens: int = 128, root_seed: str = "kvcluster-v1", **kwargs) -> None:
        self.block_tokens = block_tokens
        self.root_seed = root_seed

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(job, dict) or not job.get("prompt_ids"):
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        key = leading_block_key(job["prompt_ids"], self.block_tokens, job.get("cache_salt", ""), self.root_seed)
        available = {r.replica_id for r in self.select_available_replicas(candidate_replicas)}
        return rank_by_prefix(candidate_replicas, key, available)
