"""Time to first token of a prompt whose prefix is recomputed, served by vLLM's own prefix cache, or loaded
by `KVClusterConnector` from kvcluster's dram tier (vLLM's cache reset) and from the file tier in a fresh
engine: the figures the README's vLLM section quotes.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv-vllm/bin/python -m kvcluster.integrations.vllm.ttft --tokens 1000 --prompts 5 --json

With `--tensor-parallel N` every engine runs N workers (vLLM's "mp" executor), each saving and loading its
shard of the blocks; on a CPU with one NUMA node vLLM needs their cores named, e.g.
`VLLM_CPU_OMP_THREADS_BIND="0|1"` for two.

The model is kvcluster's tiny Llama config with random weights (vLLM's load_format="dummy", seeded, so every
engine has the same ones) and the offline tokenizer. Each figure is the median over `--prompts` distinct random prompts, one
request at a time, `max_tokens=1`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ...paths import configs_dir
from ...tokenizer import tokenizer_dir


def model_dir(dest: Path) -> Path:
    """kvcluster's tiny Llama config and the offline tokenizer, as a directory vLLM can open."""
    config = json.loads((configs_dir() / "models" / "kvcluster-tiny-llama.json").read_text())
    config.pop("_source", None)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, dest / name)
    return dest


def _engine(model: Path, tiers: list[dict] | None, workers: int = 1):
    from vllm import LLM

    kw = {} if workers == 1 else {"tensor_parallel_size": workers, "distributed_executor_backend": "mp"}
    if tiers is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVClusterConnector", "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": tiers}}
    return LLM(model=str(model), load_format="dummy", enforce_eager=True, dtype="float32", seed=0,
               enable_prefix_caching=True, max_model_len=4096, **kw)


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def measure(tokens: int, prompts: int, work: Path, workers: int = 1) -> dict:
    model = model_dir(work / "model")
    rng = random.Random(11)
    batch = [[rng.randrange(3, 32000) for _ in range(tokens)] for _ in range(prompts)]
    warmup = [rng.randrange(3, 32000) for _ in range(tokens)]
    runs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}

    def record(name: str, llm, prompt: list[int]) -> None:
        seconds, hit = _ttft(llm, prompt)
        runs.setdefault(name, []).append(seconds)
        cached[name] = hit

    llm = _engine(model, None, workers)
    _ttft(llm, warmup)
    for p in batch:
        record("recomputed", llm, p)
        record("vllm_prefix_cache", llm, p)
    _close(llm)

    pfs = [{"kind": "pfs", "capacity": f"{tokens * prompts // 64 + 64}MiB", "path": str(work / "pfs")}]
    dram = [{"kind": "dram", "capacity": f"{tokens * prompts // 64 + 64}MiB"}]
    llm = _engine(model, dram, workers)
    _ttft(llm, warmup)
    for p in batch:
        record("recomputed_and_saved_dram", llm, p)
    llm.reset_prefix_cache()
    for p in batch:
        record("kvcluster_dram", llm, p)
    _close(llm)

    llm = _engine(model, pfs, workers)
    for p in batch:
        _ttft(llm, p)  # writes the block files
    _close(llm)
    llm = _engine(model, pfs, workers)  # a fresh engine: the prefix comes from the files
    _ttft(llm, warmup)
    for p in batch:
        record("kvcluster_pfs_fresh_engine", llm, p)
    _close(llm)
    return {"prompt_tokens": tokens, "prompts": prompts, "tensor_parallel": workers,
            "ttft_p50_s": {k: round(statistics.median(v), 4) for k, v in runs.items()},
            "cached_tokens": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length in tokens")
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts per figure")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="workers per engine (vLLM's tensor parallel)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.tokens < 129 or args.prompts < 1 or args.tensor_parallel < 1:
        parser.error("--tokens must be > 128 (one vLLM block), --prompts and --tensor-parallel >= 1")
    report = None
    if args.json:  # vLLM logs to stdout, here and in its worker processes: only the report goes there
        sys.stdout.flush()
        report = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    with tempfile.TemporaryDirectory(prefix="kvcluster-vllm-ttft-") as work:
        result = measure(args.tokens, args.prompts, Path(work), args.tensor_parallel)
    if report is not None:
        sys.stdout.flush()
        report.write(json.dumps(result) + "\n")
        report.flush()
    else:
        for name, seconds in result["ttft_p50_s"].items():
            print(f"{name:30s} {seconds * 1000:8.1f} ms  (cached tokens {result['cached_tokens'][name]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
