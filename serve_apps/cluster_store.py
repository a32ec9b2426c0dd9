"""A replica's view of the tiers: its own hbm in-process, then every node's tier actors.

`fetch` reads the hbm run first (no remote call), asks the index once where the
rest of the prefix lives, then reads it per (node, tier): memory tiers over NIXL
(one lookup call, then one transfer from the tier's slab into the caller's
buffers, checksums verified here), other tiers with one `get_many` each, all in
flight together; this node's tiers are preferred over remote ones. A block whose
copy fails (its tier gone, corrupt) is read once more from its next copy, if the
index lists one. An engine
whose paged KV is registered here (`register`) has blocks from memory tiers
written straight into their pages (`fetch_placed`): one transfer, no staging. An
engine that lends its paged KV as its node's hbm tier (`kvcluster.integrations.vllm.lending`) is read the
same way, from its pages; a store never reads its own engine's. A
tier actor that is gone or slow is a miss, never an error. Fetched blocks are
promoted into hbm. `store` keeps new blocks in hbm and, on a saver thread, places
the request through its node's controller and writes the new blocks straight
into the tiers it names (`kvcluster.actors.node_writer`: no KV byte passes
through a control actor), and tells the reuse predictor about the request's
blocks in one more call.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import ray
import torch

from kvcluster.actors import metrics
from kvcluster.actors.node_writer import NodeWriter
from kvcluster.actors.index_actor import NAMESPACE
from kvcluster.actors.index_client import IndexClient, LocalIndex
from kvcluster.actors.lent_pages_actor import is_lent, lent_tier
from kvcluster.actors.paged_lending import PagedKVLending
from kvcluster.actors.peer_control import ActorPeerControl
from kvcluster.actors.predictor_actor import PREDICTOR_NAME
from kvcluster.actors.tier_actor import actor_name
from kvcluster.block_index import PrefixMatch
from kvcluster.keys import BlockKey
from kvcluster.serving.block_store import LocalBlockStore, served_context
from kvcluster.serving.shared_files import SharedFiles
from kvcluster.storage import RDMABackend, StorageError
from kvcluster.tiers import NIXL_TIERS, tier_rank  # NIXL_TIERS: memory tiers whose slab a replica reads over NIXL

log = logging.getLogger(__name__)
NIXL_RETRY_S = 30.0  # after a failed NIXL connect, that tier is read through the object store this long


class ClusterBlockStore:
    _closed = False  # set by `close`: stores and answers stay in this replica's hbm

    def __init__(self, hbm: LocalBlockStore, node: str | None, timeout_s: float = 10.0,
                 nixl_staging_bytes: int | None = 32 << 20, index: IndexClient | LocalIndex | None = None,
                 shared: SharedFiles | None = None):
        """`nixl_staging_bytes`: memory tiers are read over NIXL through a staging buffer of this size (one
        lookup call, then the bytes straight from the tier's slab); None reads them with `get_many` through
        the Ray object store. `index`: how lookups reach the block index (default: remote, every shard asked).
        `shared`: the cluster's shared filesystem, written behind every store and read where the cluster's
        memory ends."""
        self.hbm = hbm
        self.shared = shared
        self.node = node
        self.timeout_s = timeout_s
        self.index = index if index is not None else IndexClient.connect()
        self.predictor = ray.get_actor(PREDICTOR_NAME, namespace=NAMESPACE)
        self._actors: dict[tuple[str, str], object] = {}
        self._nixl_staging = nixl_staging_bytes
        self._readers: dict[tuple[str, str], RDMABackend] = {}
        self._no_nixl_until: dict[tuple[str, str], float] = {}
        self.writer = NodeWriter(node) if node is not None else None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-store")  # keeps stores in order
        self._control_faults = 0
        self._queued = 0  # stores handed to the saver thread and not yet written
        self._queue_lock = threading.Lock()
        self._from_peers: set[bytes] = set()  # blocks the last fetch read from other nodes' tiers
        self._requests = 0
        self._regions: list[torch.Tensor] = []  # memory NIXL reads may land in (an engine's paged KV)
        self._in_place: set[tuple[str, str]] = set()  # readers with every region registered
        self.lends = False  # this store's engine lends its paged KV as (node, its lent tier): never read from here
        self.lent_tier = lent_tier()  # the tier its engine (worker) lends as, when it lends
        self.counters = defaultdict(int)  # blocks served per tier, remote failures

    def _actor(self, node: str, tier: str):
        loc = (node, tier)
        if loc not in self._actors:
            self._actors[loc] = ray.get_actor(actor_name(node, tier), namespace=NAMESPACE)
        return self._actors[loc]

    def register(self, region: torch.Tensor) -> None:
        """Memory that blocks from memory tiers may be written straight into (an engine's paged KV tensors, host
        or device): registered with NIXL by every reader, those open now and those opened later."""
        self._regions.append(region)
        for loc in list(self._in_place):
            self._register_with(loc, self._readers[loc], [region])

    def _register_with(self, loc: tuple[str, str], reader: RDMABackend, regions: list[torch.Tensor]) -> None:
        """Register `regions` with one reader; one NIXL cannot register leaves that reader on the staged path."""
        try:
            for region in regions:
                reader.register(region)
        except StorageError as exc:
            log.warning("NIXL reader for %s/%s cannot land blocks in the engine's memory (%s): reading through "
                        "its staging buffer", *loc, exc)
            self._in_place.discard(loc)

    def fetch(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        return self.fetch_placed(keys, out)[0]

    def fetch_placed(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray] | None = None,
                     pages: Sequence[Sequence[torch.Tensor]] | None = None) -> tuple[list[np.ndarray], set[int]]:
        """`fetch`, where block i may also land in `pages[i]` (its pages in an engine's paged KV, in order, inside
        `register`ed memory): blocks read from memory tiers over NIXL are written there, not into `out`. The
        second value holds the positions of the run that are in their pages already; their payloads are still
        returned (copied out of the pages into `out` for the promotion into hbm)."""
        local = self.hbm.fetch(keys, out)
        self.counters["hbm"] += len(local)
        self._count_hbm(len(keys), len(local))
        rest = list(keys[len(local):])
        if not rest:
            return local, set()
        try:
            match: PrefixMatch = self.index.longest_prefix(rest, timeout_s=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("index unavailable (%s): serving the hbm run and the shared files only", type(exc).__name__)
            self.counters["remote_failures"] += 1
            metrics.faults().inc(1, {"component": "replica", "kind": "index_unavailable"})
            from_files = self._read_shared(rest, len(local), out)
            return local + from_files, set()
        match = self._readable(match)
        source = [self._choose(match.locations[j]) for j in range(match.length)]
        got, placed = self._read_from(rest, source, range(match.length), len(local), out, pages)
        retry = []  # a copy that failed (its tier gone, corrupt, pages rewritten) is read once more from the next copy
        for j in range(match.length):
            if got.get(j) is not None:
                continue
            others = [loc for loc in match.locations[j] if tuple(loc) != source[j]]
            if not others:
                break  # no other copy: the run ends here
            source[j] = self._choose(others)
            retry.append(j)
        if retry:
            again, again_placed = self._read_from(rest, source, retry, len(local), out, pages)
            got.update((j, payload) for j, payload in again.items() if payload is not None)
            placed |= again_placed
            self.counters["second_copies"] += sum(again.get(j) is not None for j in retry)
        run: list[np.ndarray] = []
        for j in range(match.length):
            payload = got.get(j)
            if payload is None:
                break
            run.append(payload)
            node, tier = source[j]
            self.counters["lent_pages" if is_lent(tier) else tier] += 1
            if node != self.node:
                self._from_peers.add(bytes(rest[j]))  # "hbm" counts this store's own hits
        if len(run) < len(rest):  # no node's memory holds the rest (or its node is gone): the shared files may
            run += self._read_shared(rest[len(run):], len(local) + len(run), out)
        if run:
            self.hbm.place(rest[: len(run)], run)  # promoted: the next turn finds them in process
            by_source: dict[str, int] = defaultdict(int)
            for j, payload in enumerate(run):
                node, tier = source[j] if j < len(source) else ("shared", "pfs")
                by_source[f"{node}/{tier}"] += payload.nbytes
            for src, nbytes in by_source.items():
                metrics.bytes_moved().inc(nbytes, {"src": src, "dst": f"{self.node or 'local'}/hbm", "how": "promote"})
        placed = {i for i in placed if i < len(local) + len(run)}
        self.counters["nixl_in_place"] += len(placed)  # served from their pages (verified blocks past the run are not)
        return local + run, placed

    def _read_from(self, rest: list[BlockKey], source: list[tuple[str, str]], positions: Sequence[int], offset: int,
                   out: Sequence[np.ndarray] | None, pages: Sequence[Sequence[torch.Tensor]] | None
                   ) -> tuple[dict[int, np.ndarray | None], set[int]]:
        """Blocks `rest[j]` for j in `positions`, each from `source[j]`: memory tiers and lent pages over NIXL
        (into `out[offset + j]`, or straight into `pages[offset + j]`), other tiers with one `get_many` per
        (node, tier), all in flight together. Returns what was read (None: a miss) and which positions of
        `out`/`pages` (offset included) are in their pages."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for j in positions:
            groups[source[j]].append(j)
        got: dict[int, np.ndarray | None] = {}
        refs = {}
        readers = {loc: self._reader(*loc) for loc in groups}
        for (node, tier), where in groups.items():
            if readers[(node, tier)] is not None or is_lent(tier):  # lent pages are read over NIXL or missed
                continue
            try:
                refs[(node, tier)] = self._actor(node, tier).get_many.remote([rest[j] for j in where])
            except ValueError:  # no such actor (node gone): misses
                self._actors.pop((node, tier), None)
                self.counters["remote_failures"] += 1
                metrics.faults().inc(1, {"component": f"{node}/{tier}", "kind": "actor_unavailable"})
        placed: set[int] = set()
        for loc, reader in readers.items():  # while those are in flight: memory tiers over NIXL, into `out` or pages
            if reader is not None:
                where = groups[loc]
                landing = None if out is None else [out[offset + j] for j in where]
                blocks = [rest[j] for j in where]
                if pages is not None and loc in self._in_place:
                    read = self._read_nixl_pages(reader, loc, blocks, [pages[offset + j] for j in where], landing)
                    placed.update(offset + j for j, payload in zip(where, read) if payload is not None)
                else:
                    read = self._read_nixl(reader, loc, blocks, landing)
                got.update(zip(where, read))
        for loc, ref in refs.items():
            try:
                for j, payload in zip(groups[loc], ray.get(ref, timeout=self.timeout_s)):
                    got[j] = payload
            except (ray.exceptions.RayError, TimeoutError):
                self._actors.pop(loc, None)
                self.counters["remote_failures"] += 1
                metrics.faults().inc(1, {"component": f"{loc[0]}/{loc[1]}", "kind": "actor_unavailable"})
        return got, placed

    def _read_shared(self, keys: Sequence[BlockKey], offset: int, out: Sequence[np.ndarray] | None
                     ) -> list[np.ndarray]:
        """The leading run of `keys` from the shared files (into `out[offset + i]`), marked to be copied into
        this node's tiers with the request's store, as blocks read from other nodes are."""
        if self.shared is None or not keys:
            return []
        run = self.shared.read(keys, None if out is None else out[offset: offset + len(keys)])
        self._from_peers.update(bytes(k) for k in keys[: len(run)])
        self.counters["shared"] += len(run)
        return run

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` can be fetched: those in hbm, then the cluster's, per the index,
        then the shared files'."""
        n = self.hbm.held(keys)
        return n if n == len(keys) else n + self.remote_prefix(keys[n:])

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each block is in this store's own tiers (its hbm)."""
        return self.hbm.holds(keys)

    def residency_changes(self) -> tuple[list[BlockKey], list[BlockKey], bool]:
        """What entered and left this store's own tiers (`LocalBlockStore.residency_changes`)."""
        return self.hbm.residency_changes()

    def checkpoint(self) -> int:
        """Copy this store's own memory tiers into its pfs tier, if it has one (a clean shutdown)."""
        return self.hbm.checkpoint()

    def lend(self, paged, suffix: str = ""):
        """Lend an engine's paged KV (`PagedKV`) as this node's hbm tier (`kvcluster.actors.paged_lending`); this
        store then reads no lent pages of its own engine. `suffix`: a tensor-parallel worker's part of its lent
        tier's name (`lent_tier`). None where it cannot lend (logged)."""
        self.lent_tier = lent_tier(suffix)
        lending = PagedKVLending.start(paged, self.node, suffix)
        self.lends = lending is not None
        return lending

    def remote_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` the cluster's tiers hold, per the index (0 when it cannot say)."""
        if not keys:
            return 0
        try:
            n = self._readable(self.index.longest_prefix(list(keys), timeout_s=self.timeout_s)).length
        except (ray.exceptions.RayError, TimeoutError):
            self.counters["remote_failures"] += 1
            n = 0
        if self.shared is not None and n < len(keys):
            n += self.shared.prefix(keys[n:])
        return n

    def _readable(self, match: PrefixMatch) -> PrefixMatch:
        """`match` without the lent pages this store does not read, cut before the first block left with no
        copy: its own engine's (it would read its own memory over NIXL; its engine's prefix cache answers
        first), and all of them when it reads nothing over NIXL (lent pages have no other way out)."""
        no_nixl = self._nixl_staging is None
        if not self.lends and not no_nixl:
            return match
        mine = (self.node, self.lent_tier)
        locations = []
        for locs in match.locations:
            usable = tuple(loc for loc in locs if not (is_lent(loc[1]) and (no_nixl or tuple(loc) == mine)))
            if not usable:
                break
            locations.append(usable)
        return PrefixMatch(len(locations), tuple(locations))

    def _reader(self, node: str, tier: str) -> RDMABackend | None:
        """A NIXL reader of that memory tier's slab (metadata exchanged once), or None: use the object store."""
        loc = (node, tier)
        if self._nixl_staging is None or (tier not in NIXL_TIERS and not is_lent(tier)):
            return None
        if loc in self._readers:
            return self._readers[loc]
        if time.monotonic() < self._no_nixl_until.get(loc, 0.0):
            return None
        try:
            control = ActorPeerControl(self._actor(node, tier), timeout_s=self.timeout_s)
            self._readers[loc] = RDMABackend(control, self._nixl_staging, 1,
                                             name=f"kvc-replica-{self.node}-{node}-{tier}-{uuid.uuid4().hex[:6]}")
        except (StorageError, ValueError) as exc:  # NIXL missing, or the actor is gone: the object store path
            log.warning("NIXL reader for %s/%s unavailable (%s): reading through the object store", node, tier, exc)
            self._no_nixl_until[loc] = time.monotonic() + NIXL_RETRY_S
            self._actors.pop(loc, None)
            self._forget_if_gone(node, tier)  # an engine that lent its pages may have exited
            return None
        self._in_place.add(loc)
        self._register_with(loc, self._readers[loc], self._regions)
        return self._readers[loc]

    def _read_nixl(self, reader: RDMABackend, loc: tuple[str, str], keys: list[BlockKey],
                   landing: list[np.ndarray] | None) -> list[np.ndarray | None]:
        """Blocks of one memory tier into `landing` (or new arrays), through the reader's staging buffer unless
        `landing` lies in registered memory."""
        results: list[np.ndarray | None] = [None] * len(keys)
        digests = self._verified_read(reader, loc, len(keys),
                                      lambda: reader.read_into(keys, landing, results, raise_unavailable=True))
        return [r if d is not None else None for r, d in zip(results, digests)]

    def _read_nixl_pages(self, reader: RDMABackend, loc: tuple[str, str], keys: list[BlockKey],
                         pages: list[Sequence[torch.Tensor]], landing: list[np.ndarray] | None
                         ) -> list[np.ndarray | None]:
        """Blocks of one memory tier straight into their pages; each verified block's bytes then copied from its
        pages into its `landing` row (or a new array), the payload that is promoted into hbm."""
        digests = self._verified_read(reader, loc, len(keys),
                                      lambda: reader.read_segments(keys, pages, raise_unavailable=True))
        out: list[np.ndarray | None] = []
        for k, digest in enumerate(digests):
            if digest is None:
                out.append(None)
                continue
            segments = [t.reshape(-1).view(torch.uint8) for t in pages[k]]
            if segments[0].device.type != "cpu":
                out.append(torch.cat(segments).cpu().numpy())
                continue
            n = sum(t.numel() for t in segments)
            row = landing[k][:n] if landing is not None else np.empty(n, dtype=np.uint8)
            out.append(np.concatenate([t.numpy() for t in segments], out=row))
        return out

    def _verified_read(self, reader: RDMABackend, loc: tuple[str, str], n: int,
                       read: Callable[[], list[int | None]]) -> list[int | None]:
        """A NIXL read's verified digests (None: a miss); a reader whose tier is gone or whose transfer failed
        is dropped (a new one is made later) and its blocks are misses, corrupt blocks are counted as faults."""
        corrupt_before = reader.stats()["corrupt"]
        try:
            digests = read()
        except StorageError as exc:  # the tier's actor is gone or the transfer failed: misses, a new reader later
            log.warning("NIXL read from %s/%s failed: %s", *loc, exc)
            self._readers.pop(loc, None)
            self._in_place.discard(loc)
            self._actors.pop(loc, None)
            self._forget_if_gone(*loc)
            self.counters["remote_failures"] += 1
            metrics.faults().inc(1, {"component": f"{loc[0]}/{loc[1]}", "kind": "actor_unavailable"})
            return [None] * n
        corrupt = reader.stats()["corrupt"] - corrupt_before
        if corrupt:  # dropped at the tier by the reader; a miss here, recomputed
            metrics.faults().inc(corrupt, {"component": f"{loc[0]}/{loc[1]}", "kind": "corrupt"})
        self.counters["nixl_blocks"] += sum(d is not None for d in digests)
        return digests

    def _forget_if_gone(self, node: str, tier: str) -> None:
        """An engine's lent paged KV whose actor is gone (the engine exited or crashed; it is never restarted)
        holds nothing: the index is told, so no reader is promised its blocks again and their other copies are
        read instead. A tier actor is restarted and reports what it holds itself."""
        if not is_lent(tier):
            return
        try:
            ray.get_actor(actor_name(node, tier), namespace=NAMESPACE)
        except ValueError:
            client = self.index.client if isinstance(self.index, LocalIndex) else self.index
            client.lost(node, tier)
            self.counters["lenders_gone"] += 1
            log.warning("the paged KV lent by %s is gone: the index forgets it", node)

    def _count_hbm(self, asked: int, hits: int) -> None:
        tags = {"node": self.node or "local", "tier": "hbm"}
        if hits:
            metrics.tier_lookups().inc(hits, {**tags, "outcome": "hit"})
        if asked > hits:
            metrics.tier_lookups().inc(asked - hits, {**tags, "outcome": "miss"})

    def _choose(self, locations) -> tuple[str, str]:
        """This node's fastest copy, else the fastest copy anywhere."""
        mine = [loc for loc in locations if loc[0] == self.node]
        pool = mine or list(locations)
        return min(pool, key=lambda loc: tier_rank(loc[1]))

    def store(self, keys: Sequence[BlockKey], payloads: Sequence[np.ndarray | None],
              pairs: Sequence[int] | None = None, finish: str = "", output_tokens: int = 0,
              session: str = "", continues: bool = False) -> None:
        """Keep the request's blocks in hbm, then, on this store's saver thread, place the request through
        the node's controller and write its new blocks (and those it read from other nodes, so the next
        turn finds them here) straight into the tiers the controller names (`NodeWriter`). The payloads
        are the caller's to give away: it does not reuse them."""
        self.hbm.store(keys, payloads, pairs, finish, output_tokens, session, continues)
        if self.node is None or not keys or self._closed:
            return
        self._requests += 1
        ctx = served_context(self._requests, time.time(), pairs, finish, output_tokens, session, continues)
        # copies: the saver thread writes them later, and a caller may reuse its rows (a synchronous connector)
        new = {bytes(k): np.array(p, copy=True) for k, p in zip(keys, payloads) if p is not None}
        peers = [k for k, p in zip(keys, payloads) if p is None and bytes(k) in self._from_peers]
        for key in peers:
            got = self.hbm.fetch([key])
            if got:
                new[bytes(key)] = np.array(got[0], copy=True)
        self._from_peers.clear()
        by_key = None if pairs is None else {bytes(k): p for k, p in zip(keys, pairs)}
        with self._queue_lock:
            self._queued += 1
        self._saver.submit(self._write, [bytes(k) for k in keys], new, ctx, by_key)
        if pairs is not None:
            self.predictor.observe.remote(list(keys[: len(pairs)]), list(pairs), time.time())

    def _write(self, keys: list[bytes], new: dict[bytes, np.ndarray], ctx, pairs) -> None:
        landed = self.writer.store(keys, new, ctx, pairs)
        if self.shared is not None:  # behind the request: what this node keeps outlives the node
            self.shared.write(new)
        with self._queue_lock:
            self._queued -= 1
            idle = self._queued == 0
        if idle:  # nothing more to store now: the completion goes alone instead of with the next store
            self.writer.flush()
        if landed:
            nbytes = sum(p.nbytes for p in new.values()) * landed // max(1, len(new))
            metrics.bytes_moved().inc(nbytes, {"src": f"{self.node}/hbm", "dst": f"{self.node}/tiers",
                                               "how": "store"})
        if self.writer.counters["control_unavailable"] > self._control_faults:
            self._control_faults = self.writer.counters["control_unavailable"]
            metrics.faults().inc(1, {"component": f"{self.node}/control", "kind": "actor_unavailable"})

    def answered(self, session: str, finish: str, output_tokens: int) -> None:
        """How the answer to `session`'s latest request ended: this node's hbm policy and its controller (after
        the request's stores, on the same saver thread) re-class its blocks."""
        self.hbm.answered(session, finish, output_tokens)
        if self.node is None or not session or self._closed:
            return
        self._saver.submit(self.writer.answered, session, finish, output_tokens)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every store and answer handed to the saver thread so far has reached the controller."""
        self._saver.submit(lambda: self.writer is not None and self.writer.flush()).result(timeout=timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the stores and answers handed over so far, then stop the saver thread; later stores stay in hbm.

        Why: a saver call made after its process left Ray (`ray.shutdown`) starts a new local Ray in the
        saver thread (Ray's auto-init), whose processes die with that thread: the process is then connected
        to a dead cluster and Ray ends it, with status 1, a minute later. Call this before leaving Ray."""
        if self._closed:
            return
        try:
            self.flush(timeout_s)
        finally:
            self._closed = True
            self._saver.shutdown(wait=False, cancel_futures=True)  # after a flush, nothing is left to wait for

