"""`KVClusterConnector`: kvcluster's tiers under vLLM's paged KV cache (vLLM's KV connector API, v1).

One kvcluster block is one vLLM block (128 tokens on CPU) of every attention layer: the block's bytes of
each layer's paged tensor, layer after layer, keyed by kvcluster's chained block key (`KeySpace`: the
token ids, the model fingerprint and the request's `cache_salt`), so equal keys mean equal KV and
tenants never share a block. vLLM's own prefix cache stays the first tier; the connector answers what
comes past it.

Scheduler side: `get_num_new_matched_tokens` counts the leading run of the request's blocks past vLLM's
local hit that the store holds, in any tier; `build_connector_meta` hands the worker that load and the
blocks each scheduled request completes this step. Worker side: `start_load_kv` reads each request's
run with one batched, checksummed fetch and copies it into the paged tensors before the forward;
`wait_for_save` gathers each request's new full blocks from the paged tensors after the forward and
stores them in one batch. A block whose bytes fail their checksum (or vanished since the lookup) ends
the run: it and the blocks after it are reported through `get_block_ids_with_load_errors`, and vLLM
(`kv_load_failure_policy="recompute"`, required) recomputes them. Loads and saves are synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import ConfigError
from ...keys import BlockKey, KeySpace
from .paged_kv import PagedKV
from .store import EngineStore, parse_config, release_store, shared_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move: kvcluster keys and the vLLM block ids they belong in, in order."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]


@dataclass
class KVClusterMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: "Request"
    keys: list[BlockKey] = field(default_factory=list)  # chain of its full blocks so far
    saved: int = 0  # blocks handed to the worker for saving (or known stored)


class KVClusterConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = parse_config(dict(transfer.kv_connector_extra_config or {}))
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError("kv_transfer_config.kv_load_failure_policy must be 'recompute' for "
                              "KVClusterConnector: a block that fails its checksum is a miss to recompute")
        executor = vllm_config.parallel_config.distributed_executor_backend
        if executor != "uni":
            raise ConfigError(
                f"KVClusterConnector keeps its store in the engine-core process, next to one in-process worker; "
                f"this engine runs its workers through the {executor!r} executor (other processes), where the "
                f"scheduler could not see what the workers store. Use one worker in the engine process: "
                f"distributed_executor_backend='uni' with tensor_parallel_size=1 (on CPU vLLM picks 'mp' unless "
                f"VLLM_ENABLE_V1_MULTIPROCESSING=0)")
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
        self._shared: EngineStore = shared_store(self._engine, config, block_bytes)
        self._store = self._shared.store
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (first block, blocks) of the last match
        self._loads: dict[str, BlockTransfer] = {}
        # worker side
        self._paged: PagedKV | None = None  # vLLM's paged KV tensors, once registered
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
        usable = (request.num_tokens - 1) // bs  # the last token is always computed: it yields the logits
        start = num_computed_tokens // bs
        if start >= usable:
            return 0, False
        keys = self._chain(self._track(request), usable)
        held = self._shared.held(keys[start:usable])
        self._matched[request.request_id] = (start, held)
        return held * bs, False

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
        self._loads[request.request_id] = BlockTransfer(request.request_id, tuple(keys),
                                                        tuple(block_ids[start:start + n]))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVClusterMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id not in computed:
                continue
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            full = (computed[req_id] + scheduled - drafts) // self._block_size  # blocks complete after this step
            if full <= tracked.saved:
                continue
            keys = self._chain(tracked, full)
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            lo = tracked.saved
            meta.saves.append(BlockTransfer(req_id, tuple(keys[lo:full]), tuple(block_ids[lo:full])))
            tracked.saved = full
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """Blocks that failed to load will be recomputed: let their saving start again from the first."""
        bad = connector_output.invalid_block_ids
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
        """Saves are done by the end of each step, so vLLM may free the blocks now."""
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._paged = PagedKV([kv_caches[name] for name in self._layer_names], self._layer_names,
                              self._num_blocks, self._page_bytes)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVClusterMetadata)
        self._failed_this_step = set()
        for load in meta.loads:
            landing = self._paged.landing(len(load.keys))  # read straight into the rows `scatter` sends on
            payloads = self._store.fetch(load.keys, [row.numpy() for row in landing])
            n = len(payloads)
            if n:
                self._paged.scatter(load.block_ids[:n], payloads)
            self._shared.loaded_blocks += n
            if n < len(load.keys):
                self._shared.failed_blocks += len(load.keys) - n
                self._load_errors.update(load.block_ids[n:])
                self._failed_this_step.update(load.block_ids[n:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Every load finished in `start_load_kv`, before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing per layer: `wait_for_save` stores each request's blocks, all layers, in one batch."""

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVClusterMetadata)
        manager = self._shared.local.tiered.manager
        for save in meta.saves:
            todo = []
            for key, block_id in zip(save.keys, save.block_ids):
                if block_id in self._failed_this_step:  # its bytes are not this key's: recomputed next step
                    break
                if manager.tier_of(key) is None:
                    todo.append((key, block_id))
            if todo:
                rows = self._paged.gather([b for _, b in todo])  # reused by the next gather: stored first
                self._store.store([k for k, _ in todo], [row.numpy() for row in rows])
                self._shared.saved_blocks += len(todo)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        release_store(self._engine)
