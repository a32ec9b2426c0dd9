"""Ray Serve LLM with `KVClusterConnector`: a `server_cls` whose vLLM engine keeps its one worker in-process.

Ray Serve LLM (`ray.serve.llm`) overwrites `distributed_executor_backend` whatever `engine_kwargs` say: "mp" on
CPU (the worker in a process of its own) and "ray" on GPUs (workers in Ray actors). The connector keeps its
store in the engine-core process, shared by its scheduler and worker halves, so it refuses both. This server
runs the same engine with vLLM's "uni" executor instead (the worker inside the engine-core process, which
AsyncLLM still starts next to the replica), for one worker per engine: tensor and pipeline parallel 1.

    LLMConfig(..., server_cls="kvcluster.integrations.vllm.ray_serve_llm:KVClusterLLMServer",
              engine_kwargs={..., "kv_transfer_config": {...KVClusterConnector...}})

On CPU the replica also needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` in its env: otherwise vLLM's CPU platform
turns "uni" back into "mp" while it builds the config, and the connector refuses the engine.
"""

from __future__ import annotations

from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

from ...errors import ConfigError


class KVClusterVLLMEngine(VLLMEngine):
    """Ray Serve LLM's vLLM engine with its one worker in the engine-core process."""

    def _prepare_engine_config(self, callback_ctx):
        engine_args, frontend_args, vllm_config = super()._prepare_engine_config(callback_ctx)
        parallel = vllm_config.parallel_config
        if parallel.world_size != 1:
            raise ConfigError(
                f"KVClusterVLLMEngine runs one worker per engine (tensor x pipeline parallel 1), this config "
                f"asks for {parallel.world_size}: KVClusterConnector's store lives in the engine-core process")
        parallel.distributed_executor_backend = "uni"
        engine_args.distributed_executor_backend = "uni"
        return engine_args, frontend_args, vllm_config


class KVClusterLLMServer(LLMServer):
    """Ray Serve LLM's server over `KVClusterVLLMEngine` (pass it as `LLMConfig.server_cls`)."""

    _default_engine_cls = KVClusterVLLMEngine
