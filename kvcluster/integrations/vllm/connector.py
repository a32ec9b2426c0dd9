"""`KVClusterConnector`: kvcluster's tiers under vLLM's paged KV cache (vLLM's KV connector API, v1).

One kvcluster block is one vLLM block (128 tokens on CPU) of every attention layer: the block's bytes of
each layer's paged tensor, layer after layer, keyed by kvcluster's chained block key (`KeySpace`: the
token ids, the model fingerprint and the request's `cache_salt`), so equal keys mean equal KV and
tenants never share a block. vLLM's own prefix cache stays the first tier; the connector answers what
comes past it.

Scheduler side: `get_num_new_matched_tokens` counts the leading run of the request's blocks past vLLM's
local hit that the store holds, in any tier; `build_connector_meta` hands the worker that load and the
blocks each scheduled request completes this step, with what the eviction policy knows of the request
(`RequestFacts`). Worker side: `start_load_kv` reads each request's run with one batched, checksummed
fetch; `wait_for_save` gathers each request's new full blocks from the paged tensors after the forward
and stores them in one batch, with the blocks it loaded or found held: the policy counts a request's use
of its blocks there, once per step, as the replay counts a trace request's. A block whose bytes fail
their checksum (or vanished since the lookup) ends the run: it and the blocks after it are reported
through `get_block_ids_with_load_errors`, and vLLM (`kv_load_failure_policy="recompute"`, required)
recomputes them.

Asynchronous by default (`async_loads`, `async_saves`), so a slow tier (a file, another node) stalls no
other request: a load is read on a loader thread while the request waits in vLLM's
WAITING_FOR_REMOTE_KVS and the engine runs the others; `get_finished` puts the blocks in place and
releases the request. A save's blocks are copied out of the paged KV at the end of the step (they may
be freed or preempted after it) and written to the tiers on a saver thread; until then a lookup misses
them. The paged tensors are touched by the engine's own thread, with one exception: on a cluster, blocks
from other nodes' memory tiers are written over NIXL straight into the loading request's own pages (the
paged tensors are registered with NIXL), on the loader thread. vLLM neither reads those blocks nor frees
them, even for an aborted request, until `get_finished` reports the load done.

Tensor parallel: each worker (a process of its own) moves its shard of each block, under a key of its own
(`shard_key`), through tiers of its own, and reports each step which blocks entered and left them
(`build_connector_worker_meta`); the scheduler promises a block only when every worker can load it, from
its tiers (`WorkerHoldings`) or the cluster's (its index, asked for every worker's shards at once). A load
error on any worker makes every worker recompute the block (vLLM gathers the workers' errors).
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ...block_types import BlockType, TransitionType, pair_index
from ...errors import ConfigError
from ...keys import BlockKey, KeySpace, shard_key
from ...traces.classify import majority_block_types
from .base import ClusterStore, ConnectorStore, Lending
from .holdings import RankReport, WorkerHoldings
from .paged_kv import PagedKV
from .store import EngineStore, files_held, for_rank, open_cluster, parse_config, release_store, shared_store

log = logging.getLogger(__name__)
LOAD_WAIT_S = 0.005  # per step with loads in flight, the engine thread waits up to this long for one of them
IN_PLACE_MIN_PAGE_BYTES = 64 << 10
"""On a cluster, pages at least this large are read over NIXL straight into the paged KV, smaller ones through the
staging buffer, a host row and a scatter. Each page costs a NIXL descriptor: with UCX over shared memory, in place
ran at 0.65x the staged path for 8 KiB pages, 0.83x at 32 KiB, 1.17x at 64 KiB and 1.46x at 128 KiB
(`benchmarks/paged_nixl.py`)."""

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


SESSION_PARAM = "kvcluster_session"
"""The request's `kv_transfer_params` key that names its session (an end user, a conversation): the eviction
policy learns each session's pace between requests (`policies/bayes.py`). vLLM's OpenAI server takes
`kv_transfer_params` in the request body; kvcluster's front sets it from the API's `user`."""
SPANS_PARAM = "kvcluster_spans"
"""The `kv_transfer_params` key of the prompt's roles: [[block type, tokens], ...] in order (`BlockType` values:
a system prompt is SYSTEM, a tool result TOOL, ...), adding up to the prompt. kvcluster's front sends its
rendered chat's; the policy ranks a request's leading SYSTEM blocks as a prefix other sessions share."""
STOP_ENDS_TURN_PARAM = "kvcluster_stop_ends_turn"
"""The `kv_transfer_params` key that says a `stop` finish of this request ends its turn (the front calls no tools:
kvcluster's refuses them). Without it the engine's `stop` may be a tool call, which the OpenAI layer above it
tells apart, so only the answer's length is passed on."""
MAX_SESSION_CHARS = 256
MAX_SPANS = 4096
_BLOCK_TYPES = frozenset(int(t) for t in BlockType)


@dataclass(frozen=True)
class RequestFacts:
    """What the eviction policy knows of a request on the engine path: its session, whether it continued a
    cached prefix (APPEND) or started cold (FIRST), and the types of its prompt's blocks (the block holding
    the prompt's end included; the blocks past it hold the answer). The engine gives no finish reason
    before the blocks are stored; `request_finished` tells it after (`answer_of`).

    A request's later saves (the blocks its answer completes, a prompt's later chunks) name its session as
    `continues`: more of the same request, not a request of its own, whose gap from the first would pass for
    the session's pace; the policy gives them the first save's class and moves them with it when the
    answer is told."""

    session: str = ""
    transition: int = int(TransitionType.FIRST)
    prompt_types: tuple[int, ...] = ()

    def pairs(self, first: int, end: int) -> tuple[int, ...]:
        """The (block type, transition) pair of blocks first..end-1."""
        types, output = self.prompt_types, int(BlockType.OUTPUT)
        return tuple(pair_index(types[j] if j < len(types) else output, self.transition) for j in range(first, end))


def prompt_types(request: "Request", block_size: int) -> tuple[int, ...]:
    """The types of the prompt's blocks, by the type holding most of each block's tokens (the answer fills the
    last): from the spans the request's `kv_transfer_params` name, or all HISTORY when it names none, or
    ones that are not [[type, tokens], ...] adding up to the prompt (a bad value only loses the policy that
    knowledge: vLLM accepted the request already)."""
    params, n = request.kv_transfer_params, request.num_prompt_tokens
    spans = params.get(SPANS_PARAM) if isinstance(params, dict) else None
    valid = (isinstance(spans, list) and len(spans) <= MAX_SPANS
             and all(isinstance(span, (list, tuple)) and len(span) == 2 and all(type(v) is int for v in span)
                     and span[0] in _BLOCK_TYPES and span[1] >= 0 for span in spans)
             and sum(span[1] for span in spans) == n)
    runs = [(BlockType(t), k) for t, k in spans] if valid else [(BlockType.HISTORY, n)]
    return tuple(int(t) for t in majority_block_types(runs + [(BlockType.OUTPUT, block_size)], block_size))


def request_session(request: "Request") -> str:
    """The session the request names in its `kv_transfer_params` ("" when none, or not a string: the request
    was accepted by vLLM already, so a bad value only loses the policy that knowledge)."""
    params = request.kv_transfer_params
    session = params.get(SESSION_PARAM) if isinstance(params, dict) else None
    if not isinstance(session, str):
        return ""
    return session[:MAX_SESSION_CHARS]


def answer_of(request: "Request") -> tuple[str, int] | None:
    """(finish, output tokens) of a finished request for the eviction policy, None for one that did not end on
    its own (aborted, failed). `stop` is passed on only where the request says it ends the turn
    (STOP_ENDS_TURN_PARAM); `length` and the rest name no class of their own."""
    reason = request.get_finished_reason()
    name = str(reason) if reason is not None else ""
    if name in ("", "abort", "error"):
        return None
    params = request.kv_transfer_params
    if name == "stop" and not (isinstance(params, dict) and params.get(STOP_ENDS_TURN_PARAM) is True):
        name = ""
    return name, int(request.num_output_tokens)


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move: kvcluster keys and the vLLM block ids they belong in, in order; a save
    also carries the blocks' pairs and the request's session, for the eviction policy."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    pairs: tuple[int, ...] = ()
    session: str = ""
    continues: bool = False  # more blocks of the request an earlier save of it named the session of


@dataclass
class KVClusterMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    written: list[int] = field(default_factory=list)  # blocks this step's forward writes into (lending only)
    answers: list[tuple[str, str, int]] = field(default_factory=list)  # (session, finish, output tokens) of the
    #   requests that finished since the last step and named a session


@dataclass
class KVClusterWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: which blocks entered and left each worker's tiers."""

    reports: dict[int, RankReport]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVClusterWorkerMetadata)
        return KVClusterWorkerMetadata(self.reports | other.reports)


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: "Request"
    keys: list[BlockKey] = field(default_factory=list)  # chain of its full blocks so far
    saved: int = 0  # blocks handed to the worker for saving (or known stored)
    load_start: int = 0  # index of the first block of its last load
    no_load_from: int | None = None  # a load of this block failed: it and later ones are computed, not offered
    facts: RequestFacts | None = None  # set when first scheduled
    session_told: bool = False  # a save has named the request's session


class KVClusterConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = parse_config(dict(transfer.kv_connector_extra_config or {}))
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError("kv_transfer_config.kv_load_failure_policy must be 'recompute' for "
                              "KVClusterConnector: a block that fails its checksum is a miss to recompute")
        parallel = vllm_config.parallel_config
        executor = parallel.distributed_executor_backend
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("KVClusterConnector stores every layer of a block together; with pipeline "
                              "parallelism each stage holds only its own layers. Use pipeline_parallel_size=1")
        if executor not in ("uni", "mp", "ray"):
            raise ConfigError(f"KVClusterConnector runs with vLLM's 'uni' executor (one worker in the engine "
                              f"process), 'mp' or 'ray' (workers in processes of their own), not {executor!r}")
        self._in_process = executor == "uni"  # else the scheduler knows the workers' tiers from their reports
        self._workers = parallel.tensor_parallel_size
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(f"KVClusterConnector handles models with one KV cache group, this one has "
                              f"{len(groups)} (hybrid attention)")
        self._block_size = vllm_config.cache_config.block_size
        self._layer_names = list(groups[0].layer_names)
        self._page_bytes = groups[0].kv_cache_spec.page_size_bytes
        self._num_blocks = kv_cache_config.num_blocks
        block_bytes = self._page_bytes * len(self._layer_names)
        self._keys = KeySpace(model=config.model_fingerprint or self._fingerprint(vllm_config, block_bytes))
        self._engine = vllm_config.instance_id or str(id(vllm_config))
        # Where the blocks live: one store per worker (each holds its shard of every block); the scheduler
        # asks the worker's store itself when they share a process, else follows the workers' reports.
        self._shared: EngineStore | None = None
        self._holdings: WorkerHoldings | None = None
        self._index = None  # the cluster's block index, asked by a scheduler whose workers run elsewhere
        self._rank = 0
        if self._in_process:
            self._store_name = self._engine
            self._shared = shared_store(self._store_name, config, block_bytes)
        elif role == KVConnectorRole.SCHEDULER:
            self._holdings = WorkerHoldings(self._workers)
            for rank in range(self._workers):  # block files a fresh worker will adopt: promised before it reports
                files = files_held(for_rank(config, rank, self._workers))
                self._holdings.seed(rank, [shard_key(k, rank, self._workers) for k in files])
            self._index = None if config.cluster is None else open_cluster(config.cluster).index()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
            self._store_name = f"{self._engine}/tp{self._rank}"
            self._shared = shared_store(self._store_name, for_rank(config, self._rank, self._workers), block_bytes)
        self._store: ConnectorStore | None = self._shared.store if self._shared is not None else None
        self._cluster = config.cluster
        self._lend = config.cluster is not None and config.cluster.lend_paged_kv
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (first block, blocks) of the last match
        self._loads: dict[str, BlockTransfer] = {}  # loads for the next step's metadata
        self._issued: dict[str, BlockTransfer] = {}  # loads handed out whose outcome is not known yet
        self._answers: list[tuple[str, str, int]] = []  # finished requests' answers, for the next step's workers
        self._latest: dict[str, str] = {}  # session -> the request whose first save named it last: the policy
        #   takes a session's later parts and answer for its latest request's, so only that one's are sent
        # worker side
        self._async_loads, self._async_saves = config.async_loads, config.async_saves
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvcluster-load") if self._async_loads else None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvcluster-save") if self._async_saves else None
        self._loading: dict[str, tuple[BlockTransfer, Future]] = {}  # async loads in flight, by request
        self._paged: PagedKV | None = None  # vLLM's paged KV tensors, once registered
        self._in_place = False  # remote blocks read over NIXL straight into the paged KV (register_kv_caches)
        self._lending: Lending | None = None  # the paged KV lent as the node's hbm tier (register_kv_caches)
        self._load_errors: set[int] = set()  # reported to vLLM (which may ask before or after the save)
        self._failed_this_step: set[int] = set()  # vLLM blocks whose load failed in this step: never saved

    def _fingerprint(self, vllm_config: "VllmConfig", block_bytes: int) -> str:
        """What makes this engine's KV bytes what they are: the weights, the dtypes, the paged layout."""
        model, cache = vllm_config.model_config, vllm_config.cache_config
        load_format = getattr(vllm_config.load_config, "load_format", "")
        return (f"vllm|{model.model}|{model.revision}|{model.dtype}|{load_format}|{model.quantization}|"
                f"{cache.cache_dtype}|block{self._block_size}|{len(self._layer_names)}x{self._page_bytes}")

    # -- scheduler side ------------------------------------------------------------------------

    def _chain(self, tracked: _Tracked, blocks: int) -> list[BlockKey]:
        """Keys of the request's first `blocks` full blocks, extending the cached chain."""
        tokens = tracked.request.all_token_ids
        keys, bs = tracked.keys, self._block_size
        parent = keys[-1] if keys else self._keys.root(tracked.request.cache_salt or "")
        for j in range(len(keys), blocks):
            parent = self._keys.child(parent, tokens[j * bs:(j + 1) * bs])
            keys.append(parent)
        return keys[:blocks]

    def _track(self, request: "Request") -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = self._tracked[request.request_id] = _Tracked(request)
        return tracked

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        bs = self._block_size
        tracked = self._track(request)
        usable = (request.num_tokens - 1) // bs  # the last token is always computed: it yields the logits
        if tracked.no_load_from is not None:  # offered once and failed (corrupt, its tier gone): compute it
            usable = min(usable, tracked.no_load_from)
        start = num_computed_tokens // bs
        if start >= usable:
            return 0, False
        held = self._held(self._chain(tracked, usable)[start:usable])
        self._matched[request.request_id] = (start, held)
        return held * bs, self._async_loads and held > 0

    def _held(self, keys: list[BlockKey]) -> int:
        """How many leading blocks of `keys` every worker can load: from its own tiers, then the cluster's."""
        if self._holdings is None:
            return self._store.held(keys)
        n = self._holdings.held(keys)
        if n == len(keys) or self._index is None:
            return n
        rest, workers = keys[n:], self._workers
        try:
            runs = self._index.held_runs([[shard_key(k, r, workers) for k in rest] for r in range(workers)],
                                         timeout_s=self._cluster.timeout_s)
        except Exception as exc:  # noqa: BLE001 - an index that is gone or slow: nothing more is promised
            log.warning("kvcluster: the cluster's index did not answer (%s); only the workers' own tiers count",
                        type(exc).__name__)
            return n
        return n + min(runs)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        tracked = self._track(request)
        if num_external_tokens <= 0:
            return
        start, held = self._matched.pop(request.request_id)
        n = num_external_tokens // self._block_size
        if n > held:
            raise RuntimeError(f"vLLM asked to load {n} blocks of request {request.request_id}, "
                               f"the connector offered {held}")
        block_ids = blocks.get_block_ids()[0]
        keys = tracked.keys[start:start + n]
        load = BlockTransfer(request.request_id, tuple(keys), tuple(block_ids[start:start + n]))
        self._loads[request.request_id] = self._issued[request.request_id] = load
        tracked.load_start = start

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVClusterMetadata(loads=list(self._loads.values()), answers=self._answers)
        self._loads.clear()
        self._answers = []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id not in computed:
                continue
            if self._lend:  # the blocks the forward writes into stop holding what they held
                first, end = computed[req_id] // self._block_size, -(-(computed[req_id] + scheduled) // self._block_size)
                meta.written.extend(self._kv_cache_manager.get_block_ids(req_id)[0][first:end])
            if tracked.facts is None:  # first scheduled: whatever it did not compute came from a cached prefix
                request = tracked.request
                transition = TransitionType.APPEND if computed[req_id] else TransitionType.FIRST
                tracked.facts = RequestFacts(request_session(request), int(transition),
                                             prompt_types(request, self._block_size))
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            full = (computed[req_id] + scheduled - drafts) // self._block_size  # blocks complete after this step
            if full <= tracked.saved:
                continue
            keys = self._chain(tracked, full)
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            lo = tracked.saved
            facts = tracked.facts
            session, continues = facts.session, tracked.session_told
            if not continues and session:
                self._latest[session] = req_id
            elif continues and self._latest.get(session) != req_id:  # a newer request of its session saved since
                session, continues = "", False
            meta.saves.append(BlockTransfer(req_id, tuple(keys[lo:full]), tuple(block_ids[lo:full]),
                                            facts.pairs(lo, full), session, continues))
            tracked.saved, tracked.session_told = full, True
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """Blocks that failed to load will be recomputed: they are not offered to that request again (an
        asynchronous load that failed sends the request back to waiting, where it would be promised the same
        blocks), and their saving starts again from the first. Workers in processes of their own report here
        which blocks entered and left their tiers."""
        reported = connector_output.kv_connector_worker_meta
        if self._holdings is not None and isinstance(reported, KVClusterWorkerMetadata):
            for rank, report in sorted(reported.reports.items()):
                self._holdings.apply(rank, report)
        bad = connector_output.invalid_block_ids or set()
        for req_id, load in list(self._issued.items()):
            failed = next((j for j, b in enumerate(load.block_ids) if b in bad), None)
            tracked = self._tracked.get(req_id)
            if failed is not None and tracked is not None:
                first = tracked.load_start + failed
                tracked.no_load_from = first if tracked.no_load_from is None else min(first, tracked.no_load_from)
            if not self._async_loads or req_id in (connector_output.finished_recving or ()):
                del self._issued[req_id]  # its outcome is known: a sync load reports within its step
        if not bad:
            return
        for req_id, tracked in self._tracked.items():
            try:
                block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            except KeyError:  # holds no blocks now (preempted): its saves restart with it
                continue
            first = next((j for j, b in enumerate(block_ids[:tracked.saved]) if b in bad), None)
            if first is not None:
                tracked.saved = first

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saved blocks leave the paged KV by the end of each step (copied out, stored now or in the
        background), so vLLM may free the blocks now. The latest request of its session to save blocks has
        its answer told to the workers' stores with the next step (`answer_of`): the engine stored its
        blocks before it knew how the answer would end. An earlier request of the session, still running when
        a newer one saved (parallel agents under one user), tells nothing: the policy would take its answer
        for the newer one's."""
        tracked = self._tracked.pop(request.request_id, None)
        session = tracked.facts.session if tracked is not None and tracked.facts is not None else ""
        if session and self._latest.get(session) == request.request_id:
            del self._latest[session]
            answer = answer_of(request)
            if answer is not None:
                self._answers.append((session, *answer))
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._issued.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """The paged KV as byte pages; on a cluster, with pages of at least IN_PLACE_MIN_PAGE_BYTES, also registered
        with its NIXL readers, so blocks from other nodes' memory tiers are written straight into their pages (no
        staging buffer, no row, no scatter)."""
        self._paged = PagedKV([kv_caches[name] for name in self._layer_names], self._layer_names,
                              self._num_blocks, self._page_bytes)
        on_cluster = isinstance(self._store, ClusterStore)
        self._in_place = on_cluster and self._page_bytes >= IN_PLACE_MIN_PAGE_BYTES
        if self._in_place:
            for region in self._paged.regions:
                self._store.register(region)
        if self._lend and on_cluster:
            # with tensor parallelism each worker lends its shards, read by the same rank of an engine of the same shape
            suffix = "" if self._workers == 1 else f"/tp{self._rank}-of-{self._workers}"
            self._lending = self._shared.lending = self._store.lend(self._paged, suffix)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Sync loads land before the forward; async ones are read from the tiers on the loader thread, into
        rows of their own, and put in place by `get_finished` once read (the request waits meanwhile)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVClusterMetadata)
        self._failed_this_step = set()
        if self._lending is not None:
            self._lending.written(meta.written + [b for load in meta.loads for b in load.block_ids])
        for load in meta.loads:
            if self._loader is not None:
                self._loading[load.req_id] = (load, self._loader.submit(self._read, load))
                continue
            landing = self._paged.landing(len(load.keys))  # read straight into the rows `scatter` sends on
            fetched = self._fetch(load, landing)
            self._place(load, fetched)
            self._failed_this_step.update(load.block_ids[len(fetched[0]):])

    def _read(self, load: BlockTransfer) -> tuple[list, set[int]]:
        """An async load's tier reads (loader thread): the verified run of its blocks, in rows it owns."""
        return self._fetch(load, self._paged.new_rows(len(load.keys)))

    def _fetch(self, load: BlockTransfer, rows: torch.Tensor) -> tuple[list, set[int]]:
        """The verified run of the load's blocks in `rows`, and which of them are in their pages already (read
        over NIXL straight there, on a cluster; vLLM does not touch a loading request's blocks meanwhile)."""
        keys, out = self._stored(load.keys), [row.numpy() for row in rows]
        if self._in_place:
            return self._store.fetch_placed(keys, out, [self._paged.block_pages(b) for b in load.block_ids])
        return self._store.fetch(keys, out), set()

    def _stored(self, keys) -> list[BlockKey]:
        """The keys this worker's shards of the blocks are stored under (the blocks' own with one worker)."""
        if self._workers == 1:
            return list(keys)
        return [shard_key(k, self._rank, self._workers) for k in keys]

    def _place(self, load: BlockTransfer, fetched: tuple[list, set[int]]) -> None:
        """The loaded run into the paged KV (but the blocks already there); the blocks past it (corrupt, gone)
        are load errors to recompute."""
        payloads, placed = fetched
        n = len(payloads)
        rest = [j for j in range(n) if j not in placed]
        if rest:
            self._paged.scatter([load.block_ids[j] for j in rest], [payloads[j] for j in rest])
        self._shared.loaded_blocks += n
        if self._lending is not None:
            self._lending.lend(self._stored(load.keys[:n]), load.block_ids[:n])
        if n < len(load.keys):
            self._shared.failed_blocks += len(load.keys) - n
            self._load_errors.update(load.block_ids[n:])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads whose reads are done, now in place (their failed blocks are reported in this same pass:
        vLLM asks for the load errors right after). A read that raised is a miss of every block."""
        if self._loading:  # the loader needs the GIL: a step with nothing else to do would spin and starve it
            wait([f for _, f in self._loading.values()], timeout=LOAD_WAIT_S, return_when=FIRST_COMPLETED)
        done = set()
        for req_id, (load, future) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            try:
                fetched = future.result()
            except Exception:  # noqa: BLE001 - any failure of the read: recomputed, never served
                log.exception("kvcluster: async load of request %s failed; its blocks are recomputed", req_id)
                fetched = ([], set())
            self._place(load, fetched)
            done.add(req_id)
        self._shared.saving = [f for f in self._shared.saving if not f.done()]
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for per layer: a sync load is in place when `start_load_kv` returns, and a request
        loading asynchronously is not in this step's forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing per layer: `wait_for_save` stores each request's blocks, all layers, in one batch."""

    def wait_for_save(self):
        """Each request's blocks completed this step, in one store call: the bytes of those the tiers lack
        (gathered from the paged KV), and the ones held already (loaded, or stored by another request) as
        uses, with the request's pairs and session."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVClusterMetadata)
        for answer in meta.answers:  # before this step's saves, and after the requests' own (one saver thread)
            if self._saver is None:
                self._store.answered(*answer)
            else:
                self._saver.submit(self._store.answered, *answer).add_done_callback(_report)
            self._shared.answers_told += 1
        for save in meta.saves:
            keys = self._stored(save.keys)
            held = self._store.holds(keys)
            complete = 0
            todo: list[int] = []  # positions whose bytes the tiers lack
            for j, (block_id, here) in enumerate(zip(save.block_ids, held)):
                if block_id in self._failed_this_step:  # its bytes are not this key's: recomputed next step
                    break
                complete += 1
                if not here:
                    todo.append(j)
            if not complete:
                continue
            keys = keys[:complete]
            if self._lending is not None:
                self._lending.lend(keys, save.block_ids[:complete])
            payloads: list = [None] * complete
            if todo:  # with a saver: copied out now, as the blocks may be freed after this step
                into = None if self._saver is None else self._paged.new_rows(len(todo))
                rows = self._paged.gather([save.block_ids[j] for j in todo], into=into)
                for j, row in zip(todo, rows):
                    payloads[j] = row.numpy()
            args = (keys, payloads, list(save.pairs[:complete]) or None)
            named = {"session": save.session, "continues": save.continues}
            if self._saver is None:  # the rows are reused by the next gather: stored first
                self._store.store(*args, **named)
            else:
                future = self._saver.submit(self._store.store, *args, **named)
                future.add_done_callback(_report)
                self._shared.saving.append(future)
            self._shared.saved_blocks += len(todo)

    def build_connector_worker_meta(self) -> "KVClusterWorkerMetadata | None":
        """A worker in a process of its own tells the scheduler which blocks entered and left its tiers (all it
        holds, the first time)."""
        if self._lending is not None:  # the step's lent blocks, in one call: this is its last hook
            self._lending.flush()
        if self._in_process or self._shared is None:
            return None
        entered, left, full = self._store.residency_changes()
        if not (entered or left or full):
            return None
        block = self._stored  # its own inverse: the blocks' keys, as the scheduler chains them
        return KVClusterWorkerMetadata({self._rank: RankReport(block(entered), block(left), full)})

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        """Background reads and stores finish first: nothing handed to the saver is dropped. Then the worker
        copies what its memory tiers hold into its pfs tier, if it has one, so that the engine started next
        adopts it (`TieredStore.checkpoint`)."""
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        if self._shared is not None and self.role == KVConnectorRole.WORKER:
            try:
                kept = self._store.checkpoint()
            except Exception:  # a full or vanished directory: the next engine starts colder, nothing is wrong
                log.exception("kvcluster: the shutdown checkpoint into the pfs tier failed")
            else:
                if kept:
                    log.info("kvcluster: %d blocks of the memory tiers kept in the pfs tier", kept)
        if self._lending is not None:
            self._lending.close(self._cluster.timeout_s)
            self._lending = None
        if self._shared is not None:
            release_store(self._store_name)


def _report(future: Future) -> None:
    """Log a background store that raised (its blocks stay misses)."""
    if future.exception() is not None:
        log.error("kvcluster: a background store failed; its blocks stay misses", exc_info=future.exception())
