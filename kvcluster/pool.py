"""The pooled tier's manager: one policy over the pool's capacity, metadata only (Mooncake's master).

The pool is written through (`cluster_sim`): every node tells the manager each
request it serves, in arrival order, so the policy sees the stream one tier fed
the whole trace would see, whatever the number of nodes. The manager holds no
byte. Per request it answers, in one call, which blocks the caller writes into
the pool's storage (admitted by the policy and not stored yet) and which stored
blocks left the pool (the caller deletes them where they are); `lookup` says
which blocks the pool holds and where. The bytes go node -> storage -> node
(files in a shared directory, or a peer's lent DRAM), never through here.

Where a block is stored is a location name (one shared directory is one
location for every node; each node's lent DRAM is a location of its own). A
location that is lost (its node died) is forgotten at once: its blocks leave the
policy and no lookup returns them. A block a reader found missing or corrupt is
forgotten the same way (`forget`). Either way a read of it is a miss, never bytes
of another block.

Keys (ints in the simulator, byte digests live) are interned to small ints for the
policy as `CacheManager` does: one id while the policy remembers the block, the
others let go in amortized sweeps. The simulator and the live actor run this same
class, so for the same requests they make the same decisions.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple, Sequence

from .policies.base import RequestContext
from .policies.registry import make_policy

MIN_KEYS_SWEPT = 4096  # the key table is swept for blocks the policy forgot at twice what it kept, and no sooner


class PoolAnswer(NamedTuple):
    write: list  # keys of the request the caller writes into the pool's storage at the location it named
    delete: dict  # location -> stored keys that left the pool: the caller deletes them there


class PoolManager:
    def __init__(self, policy: str, capacity: int, policy_options: dict | None = None,
                 keys_swept_from: int = MIN_KEYS_SWEPT) -> None:
        self.policy = make_policy(policy, capacity, **(policy_options or {}))
        self.policy_name = policy
        self._ids: dict[Hashable, int] = {}
        self._keys: list[Hashable | None] = []  # by id; None: an id let go, in `_free` for the next new key
        self._free: list[int] = []
        self._stored: dict[int, str] = {}  # id -> location, for every block the pool holds
        self._min_sweep = self._sweep_at = keys_swept_from
        self.counters = {"requests": 0, "written": 0, "deleted": 0, "forgotten": 0, "lost": 0}

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, key: Hashable) -> bool:
        i = self._ids.get(key)
        return i is not None and i in self._stored

    def lookup(self, keys: Sequence[Hashable]) -> list[str | None]:
        """Per key, the location the pool holds it at (None: not in the pool)."""
        ids, stored = self._ids, self._stored
        return [None if (i := ids.get(k)) is None else stored.get(i) for k in keys]

    def access(self, keys: Sequence[Hashable], ctx: RequestContext, at: str = "pool") -> PoolAnswer:
        """A request served on some node, in arrival order: its blocks are used in the pool's policy. Returns the
        blocks the caller writes at location `at` (admitted, not stored yet) and the stored blocks that left."""
        ids = self._intern(keys)
        policy, stored = self.policy, self._stored
        evicted = policy.access(ids, ctx)
        delete: dict[str, list] = {}
        for i in evicted:  # a victim the same call admitted again (a repeated block) stays where it is
            if i in stored and i not in policy:
                delete.setdefault(stored.pop(i), []).append(self._keys[i])
        write = []
        for key, i in zip(keys, ids):
            if i not in stored and i in policy:
                stored[i] = at
                write.append(key)
        self.counters["requests"] += 1
        self.counters["written"] += len(write)
        self.counters["deleted"] += sum(map(len, delete.values()))
        self._sweep()
        return PoolAnswer(write, delete)

    def forget(self, keys: Iterable[Hashable]) -> int:
        """Blocks the storage does not hold after all (a write refused, a read missing or corrupt): they leave
        the pool. Returns how many it held."""
        gone = [i for k in keys if (i := self._ids.get(k)) is not None and self._stored.pop(i, None) is not None]
        self.policy.discard(gone)
        self.counters["forgotten"] += len(gone)
        return len(gone)

    def lost(self, location: str) -> int:
        """Everything stored at `location` is gone (its node died): forgotten, never served again."""
        gone = [i for i, at in self._stored.items() if at == location]
        for i in gone:
            del self._stored[i]
        self.policy.discard(gone)
        self.counters["lost"] += len(gone)
        return len(gone)

    def resident(self) -> list[Hashable]:
        return [self._keys[i] for i in self._stored]

    def locations(self) -> dict[str, int]:
        """Blocks held per location."""
        out: dict[str, int] = {}
        for at in self._stored.values():
            out[at] = out.get(at, 0) + 1
        return out

    def check_integrity(self) -> None:
        self.policy.check_integrity()
        assert set(self._stored) == set(self.policy.resident()), "the pool stores exactly what its policy holds"
        assert len(self._stored) <= self.capacity
        for key, i in self._ids.items():
            assert self._keys[i] == key
        assert all(self._keys[i] is None for i in self._free)

    def _intern(self, keys: Sequence[Hashable]) -> list[int]:
        ids, names, free, out = self._ids, self._keys, self._free, []
        for key in keys:
            i = ids.get(key)
            if i is None:
                if free:
                    i = ids[key] = free.pop()
                    names[i] = key
                else:
                    i = ids[key] = len(names)
                    names.append(key)
            out.append(i)
        return out

    def _sweep(self) -> None:
        """Let go of the keys the policy no longer remembers, once the table holds twice what the last sweep
        kept: amortized O(1) per new key."""
        if len(self._ids) <= self._sweep_at:
            return
        policy, names = self.policy, self._keys
        gone = [i for i, key in enumerate(names) if key is not None and i not in self._stored
                and not policy.remembers(i)]
        for i in gone:
            del self._ids[names[i]]
            names[i] = None
        self._free.extend(reversed(gone))  # the lowest ids are taken first
        self._sweep_at = max(self._min_sweep, 2 * len(self._ids))
