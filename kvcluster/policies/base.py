"""The contract every eviction policy keeps.

A policy owns the resident set of one capacity-bounded tier. Blocks are dense
integer ids (the simulator and the live index intern `BlockKey`s once), so the
hot loop touches only ints. Calls are per request, not per block: one `access`
serves a whole request, which keeps a replay above a million block refs/s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable, Mapping, Sequence

FAR = 1 << 62  # next_use of a block that is never referenced again


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a policy may know about the request being served.

    `block_types[i]` and `next_use[i]` describe `blocks[i]` of the same call.
    `next_use` (index of the next request that references the block, FAR if none)
    is given only to offline policies such as Belady; online policies must not read it.
    """

    index: int  # request number in arrival order
    now: float  # seconds, from the injected clock or the trace
    block_types: Sequence[int] = ()
    transition: int = 0
    next_use: Sequence[int] | None = None
    session: str = ""
    finish: str = ""  # how the request's generation ended, when known ("tool_use", "end_turn", ...)
    output_tokens: int = 0  # tokens the request generated, when known (0: unknown)
    continues: bool = False  # more blocks of the session's latest request (a later prefill chunk, blocks its answer
    #   completed), stored apart from its first ones: not a request of its own
    future: Mapping[int, int] | None = None  # offline only: next use of any block (for demoted blocks)


class EvictionPolicy(ABC):
    """Resident set of one tier plus the rule that picks victims.

    Contract:
    - `len(self) <= capacity` after every call; `capacity == 0` holds nothing.
    - `access` uses every block of a request in order (hits are touched, misses
      inserted) and returns the evicted ids in eviction order, none of them
      resident on return. A victim may be a block of the same request (the
      request exceeds capacity, or an offline policy bypasses a block it will
      not need soon).
    - `admit` inserts blocks that arrive without being used (demotion from the
      tier above); resident blocks are left untouched. Returns evicted ids.
    - `discard` removes blocks if resident (promotion upwards, invalidation);
      it never evicts anything else.
    - `answered` tells how a session's latest answer ended after its `access`;
      it moves and evicts nothing.
    - `check_integrity` raises AssertionError when internal structures disagree.
    """

    name: ClassVar[str]
    offline: ClassVar[bool] = False  # True when the policy reads RequestContext.next_use

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def access(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]: ...

    @abstractmethod
    def admit(self, blocks: Sequence[int], ctx: RequestContext) -> list[int]: ...

    @abstractmethod
    def discard(self, blocks: Sequence[int]) -> None: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def resident(self) -> Iterable[int]:
        """The resident block ids (for integrity checks and the live index)."""

    def remembers(self, block: int) -> bool:
        """Whether the policy keeps anything of `block`: resident, or gone but remembered (a ghost whose
        return it would learn from). The cache manager frees a block's key once no tier remembers it."""
        return block in self

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """The answer to `session`'s latest request ended so (`finish` as the API names it, `output_tokens`
        generated), told after the request's blocks were stored without it. A policy that classes blocks by
        how the answer ended re-classes them; the default ignores it, as the classical policies do."""

    @property
    def sessions_known(self) -> int:
        """Sessions whose pace the policy remembers (0 for one that does not class requests by session)."""
        return 0

    def prefix_hits(self, blocks: Sequence[int]) -> int:
        """Length of the leading run of `blocks` that is resident."""
        n = 0
        for block in blocks:
            if block not in self:
                break
            n += 1
        return n
