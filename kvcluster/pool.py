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
policy (`KeyTable`, as `CacheManager` does): one id while the policy remembers the
block, the others let go in amortized sweeps. The simulator and the live actor run this same
class, so for the same requests they make the same decisions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Iterable, NamedTuple, Sequence

from .key_table import MIN_KEYS_SWEPT, KeyTable
from .policies.base import RequestContext
from .policies.registry import make_policy

class PoolAnswer(NamedTuple):
    write: list  # keys of the request the caller writes into the pool's storage at the location it named
    delete: dict  # location -> stored keys that left the pool: the caller deletes them there


class PoolManager:
    def __init__(self, policy: str, capacity: int, policy_options: dict | None = None,
                 keys_swept_from: int = MIN_KEYS_SWEPT) -> None:
        self.policy = make_policy(policy, capacity, **(policy_options or {}))
        self.policy_name = policy
        self._table = KeyTable(keys_swept_from)
        self._stored: dict[int, str] = {}  # id -> location, for every block the pool holds
        self.counters = {"requests": 0, "written": 0, "deleted": 0, "forgotten": 0, "lost": 0}

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, key: Hashable) -> bool:
        i = self._table.ids.get(key)
        return i is not None and i in self._stored

    def lookup(self, keys: Sequence[Hashable]) -> list[str | None]:
        """Per key, the location the pool holds it at (None: not in the pool)."""
        ids, stored = self._table.ids, self._stored
        return [None if (i := ids.get(k)) is None else stored.get(i) for k in keys]

    def access(self, keys: Sequence[Hashable], ctx: RequestContext, at: str = "pool") -> PoolAnswer:
        """A request served on some node, in arrival order: its blocks are used in the pool's policy. Returns the
        blocks the caller writes at location `at` (admitted, not stored yet) and the stored blocks that left."""
        ids = self._table.intern(keys)
        policy, stored, names = self.policy, self._stored, self._table.keys
        evicted = policy.access(ids, ctx)
        delete: dict[str, list] = {}
        for i in evicted:  # a victim the same call admitted again (a repeated block) stays where it is
            if i in stored and i not in policy:
                delete.setdefault(stored.pop(i), []).append(names[i])
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

    def adopt(self, keys: Sequence[Hashable], at: str) -> list[Hashable]:
        """Blocks the storage at `at` holds when this manager starts (a restart of its process): taken into the
        policy as one request, so the pool counts and serves them again. Returns those it has no room for,
        which the caller deletes there. Nothing to adopt leaves the policy untouched (a request, even an empty
        one, is part of what it learns from)."""
        if not keys:
            return []
        ids = self._table.intern(keys)
        self.policy.access(ids, RequestContext(0, 0.0))
        kept = self.policy
        for i in ids:
            if i in kept:
                self._stored[i] = at
        names = self._table.keys
        return [names[i] for i in dict.fromkeys(ids) if i not in kept]

    def forget(self, keys: Iterable[Hashable]) -> int:
        """Blocks the storage does not hold after all (a write refused, a read missing or corrupt): they leave
        the pool. Returns how many it held."""
        gone = [i for i in self._table.known(keys) if i is not None and self._stored.pop(i, None) is not None]
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
        names = self._table.keys
        return [names[i] for i in self._stored]

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
        self._table.check_integrity()

    def _sweep(self) -> None:
        """Let go of the keys of blocks the pool neither stores nor its policy remembers (`KeyTable.sweep`)."""
        stored, policy = self._stored, self.policy
        self._table.sweep(lambda i: i in stored or policy.remembers(i))



def shard_of(key: Hashable, shards: int) -> int:
    """The shard of a key, the same in every process: its digest's first 8 bytes, or a multiplicative hash of an
    int key (the simulator's keys are dense ints, whose `hash` is themselves)."""
    if isinstance(key, (bytes, bytearray)):
        return int.from_bytes(key[:8], "little") % shards
    return (((int(key) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32) % shards


class ShardedPool:
    """The pool split by key hash over `shards` managers, each with its share of the capacity and a policy of its
    own: `shards` times one manager's decisions per second, at a price in hit rate (`cluster_sim
    --pool-shards`): each shard's policy sees only its blocks of a request, so a request's prefix is scattered
    over policies that rank it apart. Answers as one `PoolManager` does."""

    def __init__(self, policy: str, capacity: int, shards: int, policy_options: dict | None = None,
                 keys_swept_from: int = MIN_KEYS_SWEPT) -> None:
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be an int >= 1, got {shards!r}")
        caps = [capacity // shards + (1 if i < capacity % shards else 0) for i in range(shards)]
        self.shards = [PoolManager(policy, c, policy_options, keys_swept_from) for c in caps]
        self.policy_name = policy

    @property
    def capacity(self) -> int:
        return sum(m.capacity for m in self.shards)

    @property
    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for m in self.shards:
            for name, n in m.counters.items():
                total[name] = total.get(name, 0) + n
        return total

    def __len__(self) -> int:
        return sum(len(m) for m in self.shards)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.shards[shard_of(key, len(self.shards))]

    def _split(self, keys: Sequence[Hashable]) -> dict[int, list[int]]:
        """Positions of `keys` per shard, in request order."""
        n, groups = len(self.shards), {}
        for pos, key in enumerate(keys):
            groups.setdefault(shard_of(key, n), []).append(pos)
        return groups

    def lookup(self, keys: Sequence[Hashable]) -> list[str | None]:
        out: list[str | None] = [None] * len(keys)
        for s, positions in self._split(keys).items():
            for pos, at in zip(positions, self.shards[s].lookup([keys[p] for p in positions])):
                out[pos] = at
        return out

    def access(self, keys: Sequence[Hashable], ctx: RequestContext, at: str = "pool") -> PoolAnswer:
        """Each shard is told its blocks of the request (with their types), in the request's order."""
        written: list[tuple[int, Hashable]] = []
        delete: dict[str, list] = {}
        types = ctx.block_types
        for s, positions in self._split(keys).items():
            sub = replace(ctx, block_types=[types[p] for p in positions] if types else (),
                          next_use=None if ctx.next_use is None else [ctx.next_use[p] for p in positions])
            part = [keys[p] for p in positions]
            answer = self.shards[s].access(part, sub, at)
            first = {}
            for p, k in zip(positions, part):
                first.setdefault(k, p)
            written += [(first[k], k) for k in answer.write]
            for where, gone in answer.delete.items():
                delete.setdefault(where, []).extend(gone)
        written.sort(key=lambda pk: pk[0])
        return PoolAnswer([k for _, k in written], delete)

    def forget(self, keys: Iterable[Hashable]) -> int:
        keys = list(keys)
        return sum(self.shards[s].forget([keys[p] for p in positions]) for s, positions in self._split(keys).items())

    def lost(self, location: str) -> int:
        return sum(m.lost(location) for m in self.shards)

    def resident(self) -> list[Hashable]:
        return [k for m in self.shards for k in m.resident()]

    def locations(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.shards:
            for at, n in m.locations().items():
                out[at] = out.get(at, 0) + n
        return out

    def check_integrity(self) -> None:
        n = len(self.shards)
        for s, m in enumerate(self.shards):
            m.check_integrity()
            assert all(shard_of(k, n) == s for k in m.resident()), "a shard holds only its own keys"
