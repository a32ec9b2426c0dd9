"""What every predictive policy's invariant test runs: interned prefix requests through a policy, checked each step."""

from __future__ import annotations

from typing import Callable, Sequence

from kvcluster.policies.base import RequestContext


def interned_requests(token_runs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Block ids as chained keys give them: an id names its whole prefix, so equal prefixes share ids."""
    ids: dict[tuple[int, ...], int] = {}
    return [[ids.setdefault(tuple(run[: j + 1]), len(ids)) for j in range(len(run))] for run in token_runs]


def check_invariants(policy, capacity: int, token_runs: Sequence[Sequence[int]],
                     ctx: Callable[[int, list[int]], RequestContext]) -> None:
    """Capacity held, evictions distinct and gone, integrity after every request, each request's resident blocks
    a prefix of it, and never more prefix hits than an infinite cache would give."""
    hits = inf_hits = 0
    seen: set[int] = set()
    for i, blocks in enumerate(interned_requests(token_runs)):
        hits += policy.prefix_hits(blocks)
        for b in blocks:
            if b not in seen:
                break
            inf_hits += 1
        seen.update(blocks)
        evicted = policy.access(blocks, ctx(i, blocks))
        assert len(policy) <= capacity and all(b not in policy for b in evicted)
        assert len(evicted) == len(set(evicted))
        policy.check_integrity()
        resident = [b in policy for b in blocks]
        assert resident == sorted(resident, reverse=True)  # prefix-closed within the request just served
    assert hits <= inf_hits
