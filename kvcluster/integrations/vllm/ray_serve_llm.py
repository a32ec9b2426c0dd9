"""Ray Serve LLM with `KVClusterConnector`: a `server_cls` whose vLLM engine keeps a lone worker in-process.

Ray Serve LLM (`ray.serve.llm`) overwrites `distributed_executor_backend` whatever `engine_kwargs` say: "mp" on
CPU (the worker in a process of its own) and "ray" on GPUs (workers in Ray actors). With workers out of process
the connector's scheduler half knows their tiers only from their per-step reports, a step late. For an
engine of one worker this server runs vLLM's "uni" executor instead (the worker inside the engine-core
process, which AsyncLLM still starts next to the replica), where the scheduler asks the worker's store
itself; tensor-parallel engines keep Ray Serve LLM's executor.

    LLMConfig(..., server_cls="kvcluster.integrations.vllm.ray_serve_llm:KVClusterLLMServer",
              engine_kwargs={..., "kv_transfer_config": {...KVClusterConnector...}})

On CPU the replica also needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` in its env: otherwise vLLM's CPU platform
turns "uni" back into "mp" while it builds the config, and the connector refuses the engine.
"""

from __future__ import annotations

from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine


class KVClusterVLLMEngine(VLLMEngine):
    """Ray Serve LLM's vLLM engine, with a lone worker in the engine-core process."""

    def _prepare_engine_config(self, callback_ctx):
        engine_args, frontend_args, vllm_config = super()._prepare_engine_config(callback_ctx)
        parallel = vllm_config.parallel_config
        if parallel.world_size != 1:  # tensor parallel: the workers report their tiers to the scheduler
            return engine_args, frontend_args, vllm_config
        parallel.distributed_executor_backend = "uni"
        engine_args.distributed_executor_backend = "uni"
        return engine_args, frontend_args, vllm_config


class KVClusterLLMServer(LLMServer):
    """Ray Serve LLM's server over `KVClusterVLLMEngine` (pass it as `LLMConfig.server_cls`)."""

    _default_engine_cls = KVClusterVLLMEngine
