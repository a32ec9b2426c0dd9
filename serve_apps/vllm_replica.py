"""A Serve replica that runs a vLLM engine with `KVClusterConnector`, speaking the ingress's replica protocol.

The OpenAI front (serve_apps/ingress.py) tokenizes and checks each request and calls `generate(job)` on a
replica; this one hands the token ids to vLLM (in-process, driven by `EngineLoop`) and streams the same events
kvcluster's own replica does: one `start` (prompt tokens, and `cached_tokens`: the prompt tokens vLLM did not
compute, from its own prefix cache or loaded by the connector from kvcluster's tiers, as vLLM reports them in
`RequestOutput.num_cached_tokens`), text `delta`s with their log-probabilities, one `end`. vLLM detokenizes,
applies stop strings and samples; the front renders OpenAI bodies and usage from the events.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from ray import serve

from kvcluster.actors import metrics
from kvcluster.paths import configs_dir
from kvcluster.serving.sampling import SamplingParams
from kvcluster.tokenizer import tokenizer_dir

from .vllm_config import DTYPES, VLLMAppConfig
from .vllm_engine_loop import EngineLoop
from .vllm_router import SessionAffinityRouter

CONNECTOR_MODULE = "kvcluster.integrations.vllm.connector"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_source(model: str, root: Path | None = None) -> tuple[str, str]:
    """(model path, vLLM load_format): a checkpoint directory as it is, or a configs/models name written out as
    a directory of its config and the offline tokenizer, with random weights.

    The written directory is named by a digest of what it holds (under `root`, default the temp dir), so every
    start of the same model finds the same path: the connector's block keys include the model's path
    (`KVClusterConnector._fingerprint`), and a restarted app must compute the keys its pfs tier's files carry."""
    if Path(model).is_dir():
        return model, "auto"
    config = json.loads((configs_dir() / "models" / f"{model}.json").read_text())
    files = {"config.json": json.dumps({k: v for k, v in config.items() if not k.startswith("_")}).encode()}
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            files[name] = (tokenizer_dir() / name).read_bytes()
    digest = hashlib.sha256(b"".join(n.encode() + b"\0" + data for n, data in sorted(files.items()))).hexdigest()
    dest = (root or Path(tempfile.gettempdir())) / "kvcluster-models" / f"{model}-{digest[:16]}"
    if not (dest / "config.json").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=dest.parent))
        for name, data in files.items():
            (staging / name).write_bytes(data)
        try:
            os.rename(staging, dest)  # atomic: a replica starting beside this one sees all of it or none
        except OSError:  # another replica wrote it first: the same bytes
            shutil.rmtree(staging, ignore_errors=True)
    return str(dest), "dummy"


def transfer_config(cfg: VLLMAppConfig) -> dict | None:
    """vLLM's kv_transfer_config that loads kvcluster's connector (the form a Ray Serve LLM user puts in
    `LLMConfig(engine_kwargs={"kv_transfer_config": ...})`)."""
    if cfg.connector is None:
        return None
    return {"kv_connector": "KVClusterConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": cfg.connector.model_dump(exclude_none=True)}


def vllm_sampling(params: SamplingParams, session: str = "", spans=()):
    """The front's sampling parameters as vLLM's, streamed as deltas. The session (the API's `user`) and the
    prompt's roles (`spans`: (block type, tokens) of the rendered chat) travel in `kv_transfer_params` to
    kvcluster's connector, whose eviction policy classes the request's blocks by them, and with a session, that a
    `stop` ends the turn (this front calls no tools), so the policy learns how each answer ended."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from kvcluster.integrations.vllm.connector import SESSION_PARAM, SPANS_PARAM, STOP_ENDS_TURN_PARAM

    facts = ({SESSION_PARAM: session, STOP_ENDS_TURN_PARAM: True} if session else {}) | (
        {SPANS_PARAM: [[int(t), int(n)] for t, n in spans]} if spans else {})
    return VLLMSamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_tokens=params.min_tokens, stop=list(params.stop), seed=params.seed, ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs, output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": facts} if facts else None)


def entry(token: int, position: dict, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One token's (id, log-probability, the `top` most likely (id, log-probability)) from vLLM's {id: Logprob}
    of its position (which holds the top ranks and the token itself)."""
    best = sorted((lp.rank, i, lp.logprob) for i, lp in position.items() if lp.rank is not None and lp.rank <= top)
    return int(token), float(position[token].logprob), [(int(i), float(v)) for _, i, v in best]


def entries(tokens, positions, top: int | None) -> list:
    """The front's log-probability entries of `tokens`; none when they were not asked for."""
    if top is None or not positions:
        return []
    return [entry(t, p, top) for t, p in zip(tokens, positions)]


def tier_stats(backend) -> dict:
    """One tier of the engine's own store: its counters (gets, misses, corrupt reads, ...) and, for nvme, the slab
    this engine claimed (`PATH/r{i}`: replicas on one node each own one)."""
    from kvcluster.storage.nvme import NVMeBackend

    stats = backend.stats()
    return {**stats, "slab": str(backend.path)} if isinstance(backend, NVMeBackend) else stats


class VLLMReplica:
    def __init__(self, config: dict) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        self.cfg = VLLMAppConfig.model_validate(config)
        model, load_format = model_source(self.cfg.model)
        transfer = transfer_config(self.cfg)
        started = time.perf_counter()
        args = EngineArgs(model=model, load_format=load_format, dtype=DTYPES[self.cfg.dtype], seed=self.cfg.seed,
                          served_model_name=self.cfg.name, enforce_eager=True, enable_prefix_caching=True,
                          max_model_len=self.cfg.max_model_len, max_num_seqs=self.cfg.max_ongoing_requests,
                          num_gpu_blocks_override=self.cfg.kv_cache_blocks,
                          distributed_executor_backend="uni",
                          kv_transfer_config=None if transfer is None else KVTransferConfig(**transfer))
        engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.ENGINE_CONTEXT)
        self.startup_s = time.perf_counter() - started
        self.block_size = engine.vllm_config.cache_config.block_size
        self.loop = EngineLoop(engine)
        self.served = 0

    async def generate(self, request: dict, prefer_node: str | None = None) -> AsyncIterator[dict]:
        """Stream one request's events (the ingress's protocol; `prefer_node` is kvcluster's router's and
        unused here)."""
        params = SamplingParams.model_validate(request["params"])
        prompt_ids = list(request["prompt_ids"])
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        request_id = uuid.uuid4().hex
        started = time.perf_counter()
        sampling = vllm_sampling(params, request.get("session", ""), request.get("spans", ()))
        queue = self.loop.submit(request_id, prompt, sampling)
        first, done, completion = True, False, 0
        try:
            while not done:
                out = await queue.get()
                if isinstance(out, Exception):
                    if first:  # refused before any token: the client's request (a 400 at the front)
                        yield {"type": "error", "message": f"vLLM refused the request: {out}"}
                        done = True
                        return
                    raise out
                if first:
                    first = False
                    yield self._start(out, prompt_ids, params, time.perf_counter() - started)
                done = out.finished
                choice = out.outputs[0]
                completion += len(choice.token_ids)
                lps = entries(choice.token_ids, choice.logprobs, params.logprobs)
                if choice.text or lps:
                    yield {"type": "delta", "text": choice.text, "logprobs": lps}
                if done:
                    yield {"type": "end", "finish_reason": choice.finish_reason or "stop",
                           "completion_tokens": completion, "stored_blocks": 0, "logprobs": []}
        finally:
            if not done:
                self.loop.abort(request_id)
            self.served += 1

    def _start(self, out, prompt_ids: list[int], params: SamplingParams, ttft_s: float) -> dict:
        cached = int(out.num_cached_tokens or 0)
        metrics.ttft().observe(ttft_s, {"model": self.cfg.name})
        metrics.cached_tokens().observe(cached, {"model": self.cfg.name})
        prompt_lps = None
        if out.prompt_logprobs:  # vLLM's first position is None: the first token has no log-probability
            prompt_lps = entries(prompt_ids[1:], list(out.prompt_logprobs)[1:], params.prompt_logprobs)
        return {"type": "start", "prompt_tokens": len(prompt_ids), "cached_tokens": cached,
                "prompt_logprobs": prompt_lps, "ttft_s": ttft_s, "node": self._node()}

    def _node(self) -> str | None:
        """The cluster node this replica's engine stores on (None: no cluster), which the front reports in a
        header of every answer."""
        from kvcluster.integrations.vllm.store import engine_stores

        stores = list(engine_stores().values())
        return getattr(stores[0].store, "node", None) if stores else None

    def info(self) -> dict:
        """What an operator (or a test) asks a replica: the engine's block size, its start time, the
        connector's counters and each of its own tiers' (`tier_stats`)."""
        from kvcluster.integrations.vllm.store import engine_stores

        stores = list(engine_stores().values())
        named = ("loaded_blocks", "saved_blocks", "failed_blocks", "answers_told")
        counts = {k: getattr(stores[0], k) for k in named} if stores else {}
        if stores:  # sessions whose pace the connector's policy learns (the API's `user`)
            counts["sessions"] = stores[0].local.tiered.manager.sessions_known()
            counts["tiers"] = [tier_stats(backend) for backend in stores[0].local.tiered.backends]
            cluster = stores[0].store
            if cluster is not stores[0].local:  # on a cluster: blocks served per tier, the shared files' counts
                counts["cluster"] = dict(getattr(cluster, "counters", {}))
                shared = getattr(cluster, "shared", None)
                if shared is not None:
                    counts["shared"] = shared.stats()
        return {"pid": os.getpid(), "served": self.served, "block_size": self.block_size,
                "startup_s": self.startup_s, "node": self._node(), "connector": counts}

    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"the vLLM engine failed: {self.loop.error!r}")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()
            loop.engine.engine_core.shutdown()  # the connector releases its store


def replica_deployment(cfg: VLLMAppConfig):
    """VLLMReplica as a Serve deployment: `num_replicas` engines, each in its own process with vLLM's engine
    core inside it (the connector needs that), routed by session (serve_apps/vllm_router.py)."""
    from ray.serve.config import RequestRouterConfig

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_space_gib),
           "OMP_NUM_THREADS": str(cfg.omp_threads)}
    return serve.deployment(
        VLLMReplica,
        name="VLLMReplica",
        num_replicas=cfg.num_replicas,
        **({} if cfg.max_replicas_per_node is None else {"max_replicas_per_node": cfg.max_replicas_per_node}),
        ray_actor_options={"num_cpus": cfg.replica_cpus, "runtime_env": {"env_vars": env}},
        max_ongoing_requests=cfg.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=SessionAffinityRouter,
            request_router_kwargs={"block_tokens": cfg.route_tokens, "root_seed": cfg.root_seed}),
        health_check_period_s=10,
    )
