"""One pooled tier shared by every node: its manager holds metadata only and hears every node's uses.

Peers' DRAM lent over RDMA, or the shared filesystem, is one pool whichever node
reads it. Its manager (as Mooncake's master) decides what stays and never moves a
byte; nodes tell it their uses as events. That is what lets the pool run the
predictive policy: the policy learns a block's reuse gaps from every use on every
node, including the uses served from a node's own tiers, so a block that a node
demotes into the pool arrives with its true class and last-use time. A pool fed
only demotions (an LRU below each node, as in one node's hierarchy) ranks blocks
by when a node let them go; with many small node-local tiers that is nearly
every block at once, and the predictor's edge is gone.

A pool hit is moved up into the reading node's tiers (the pool lets its copy go:
one copy of a block in the cluster, as in a hierarchy), unless another node has
used the block too: then the pool keeps its copy, because a shared prefix (a
system prompt, a common document) taken out of the pool by one node is a miss on
every other node, and a prefix miss at its first block loses the whole request.
With one node nothing is shared, so the pool and its node are exactly one
two-tier hierarchy.
"""

from __future__ import annotations

from typing import Sequence

from .policies.base import EvictionPolicy, RequestContext

SHARED = -1  # `PoolManager._user` value of a block that more than one node has used


class PoolManager:
    """The pooled tier's residency, decided by `policy` over the uses of all nodes."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._user: dict[int, int] = {}  # block -> the one node that has used it, or SHARED
        self.moved_out = 0  # pool hits whose copy went to the reader
        self.kept = 0  # pool hits whose copy stayed (a block other nodes use)

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    def __contains__(self, block: int) -> bool:
        return block in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def used(self, blocks: Sequence[int], ctx: RequestContext, node: int) -> None:
        """`node` served a request of `blocks` (every block now in its own tiers): the policy hears the use;
        the pool's copies of these blocks leave for the node unless another node uses them as well.

        The policy is told through `access`, given room for the request's blocks it does not hold, so that
        hearing a use evicts nothing; the blocks that are not to stay are then discarded: a use learnt, the
        tier unchanged but for the copies the node took."""
        policy, user = self.policy, self._user
        leave: list[int] = []
        for block in dict.fromkeys(blocks):
            held = block in policy
            first = user.setdefault(block, node)
            if first != node and first != SHARED:
                user[block] = first = SHARED
            if held and first == SHARED:
                self.kept += 1
                continue
            self.moved_out += held
            leave.append(block)
        room = sum(1 for b in leave if b not in policy)
        policy.capacity += room
        try:
            evicted = policy.access(blocks, ctx)
        finally:
            policy.capacity -= room
        if evicted:
            raise AssertionError(f"hearing a use evicted {len(evicted)} blocks from the pool")
        policy.discard(leave)

    def demote(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]:
        """Victims of a node's last local tier into the pool; returns what falls out of the pool. A block the
        pool holds already (a shared one) stays as it is."""
        return self.policy.admit(blocks, ctx) if blocks else []

    def check_integrity(self) -> None:
        self.policy.check_integrity()
        assert len(self.policy) <= self.policy.capacity, (len(self.policy), self.policy.capacity)
