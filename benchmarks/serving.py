"""Serving with the tiered KV cache vs without it, each against its reference in the same run.

1. ttft: a 2,048-token prompt whose 1,984-token prefix sits in the dram tier,
   against cold prefill of the same prompt (and the first token must agree).
2. hit_overhead: lookup + load + cache build of a hot dram (and hbm) hit, per
   request, model compute excluded; next to a plain memcpy of the same bytes.
3. replay: multi-turn replays of ShareGPT conversations and SWE-agent
   trajectories (../shared/data), one client, turn after turn: requests/s and
   TTFT p50/p99 with the cache (hbm + dram) vs without.

The model is the embedded default (kvcluster-tiny-llama, 57M parameters, random
weights, fp32) running the real runner in this process; run with
OMP_NUM_THREADS=1 (OpenMP spin-waiting on a busy 2-core box distorts small
forwards).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serving.py [--json] [--repeat 5] [--replay-requests 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from harness import JsonOutput, timings

from kvcluster.paths import shared_data_dir
from kvcluster.serving.block_store import LocalBlockStore
from kvcluster.serving.models import load_model
from kvcluster.serving.runner import ModelRunner
from kvcluster.serving.sampling import SamplingParams
from kvcluster.storage import dram_backend, hbm_backend
from kvcluster.storage.tiered import TieredStore
from kvcluster.traces.sharegpt import ShareGPTLoader
from kvcluster.traces.swe_agent import SWEAgentLoader
from kvcluster.traces.text import turn_prompts

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def store_of(runner: ModelRunner, tiers: list[tuple[str, int]]) -> LocalBlockStore:
    block = runner.layout.nbytes()
    make = {"hbm": hbm_backend, "dram": dram_backend}
    return LocalBlockStore(TieredStore([make[name](blocks, block) for name, blocks in tiers], block))


def prime(runner: ModelRunner, prefix: list[int]) -> None:
    """Store exactly the full blocks of `prefix` (one request, one token out, written back)."""
    runner.complete(prefix, FIRST)


def bench_ttft(loaded, repeat: int, prompt_tokens: int = 2048, cached_tokens: int = 1984) -> dict:
    rng = np.random.RandomState(0)
    prompt = [int(t) for t in rng.randint(3, 32000, prompt_tokens)]
    cold = ModelRunner(loaded)
    warm = ModelRunner(loaded)
    warm.store = store_of(warm, [("dram", 4 * prompt_tokens // 16)])
    prime(warm, prompt[:cached_tokens])
    cold_s, warm_s, same = [], [], True
    cold.start(prompt[:64], FIRST)  # warm up allocator and kernels
    for _ in range(repeat):
        c = cold.start(prompt, FIRST)
        w = warm.start(prompt, FIRST)  # start only: nothing is written back, so the hit stays 1,984 tokens
        assert w.cached_tokens == cached_tokens, w.cached_tokens
        cold_s.append(c.ttft_s)
        warm_s.append(w.ttft_s)
        same &= c.output_ids == w.output_ids
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "tier": "dram",
            "cold_ttft_s_p50": statistics.median(cold_s), "cached_ttft_s_p50": statistics.median(warm_s),
            "speedup": statistics.median(cold_s) / statistics.median(warm_s), "goal": 15.0,
            "first_token_equal": same, "runs": repeat}


def bench_hit_overhead(loaded, repeat: int, prefixes=(256, 1024, 1984)) -> list[dict]:
    rows = []
    rng = np.random.RandomState(1)
    for tier in ("dram", "hbm"):
        for n in prefixes:
            runner = ModelRunner(loaded)
            runner.store = store_of(runner, [(tier, 2 * n // 16 + 8)])
            prompt = [int(t) for t in rng.randint(3, 32000, n + 1)]
            prime(runner, prompt[:n])
            times = []
            for _ in range(repeat):
                gen = runner.start(prompt, FIRST)  # fetch_s: lookup + load + cache build, before any model compute
                assert gen.cached_tokens == n
                times.append(gen.fetch_s)
            nbytes = n // 16 * runner.layout.nbytes()
            src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            copies = timings(lambda: np.copyto(dst, src), repeat)  # noqa: B023 - called at once
            rows.append({"tier": tier, "cached_tokens": n, "bytes": nbytes, "p50_ms": pct(times, 50) * 1e3,
                         "p99_ms": pct(times, 99) * 1e3, "memcpy_p50_ms": pct(copies, 50) * 1e3,
                         "vs_memcpy": pct(times, 50) / pct(copies, 50), "goal_p50_ms": 1.0})
    return rows


def replay_requests(dataset: str, limit: int, max_prompt: int) -> list[tuple[str, list[int], int]]:
    """(session, prompt ids, answer tokens) in conversation order, turns that fit the window."""
    if dataset == "sharegpt":
        convs, _ = ShareGPTLoader().conversations(shared_data_dir() / "sharegpt_v3" / "sharegpt_v3_subset.jsonl",
                                                  max_records=400)
    else:
        convs, _ = SWEAgentLoader().conversations(shared_data_dir() / "swe_agent_trajectories")
    out = []
    for conv, turns in zip(convs, turn_prompts(convs)):
        fitting = [(p, a) for p, a in turns if len(p) <= max_prompt]
        if len(fitting) < 2:  # a replay of reuse needs at least two turns
            continue
        out += [(conv.session, p, a) for p, a in fitting]
        if len(out) >= limit:
            break
    return out[:limit]


def bench_replay(loaded, dataset: str, limit: int, max_new: int) -> dict:
    requests = replay_requests(dataset, limit, loaded.context_window - max_new)
    results = {}
    for mode in ("no_cache", "cache"):
        runner = ModelRunner(loaded)
        if mode == "cache":
            runner.store = store_of(runner, [("hbm", 1024), ("dram", 8192)])
        ttfts, cached, prompt_tokens = [], 0, 0
        t0 = time.perf_counter()
        for _, prompt, answer in requests:
            gen = runner.complete(prompt, SamplingParams(max_tokens=max(1, min(answer, max_new)), temperature=0.0,
                                                         ignore_eos=True))
            ttfts.append(gen.ttft_s)
            cached += gen.cached_tokens
            prompt_tokens += len(prompt)
        wall = time.perf_counter() - t0
        results[mode] = {"requests_per_s": len(requests) / wall, "ttft_p50_s": pct(ttfts, 50),
                         "ttft_p99_s": pct(ttfts, 99), "wall_s": wall, "cached_token_frac": cached / prompt_tokens}
    return {"dataset": dataset, "requests": len(requests), "sessions": len({s for s, _, _ in requests}),
            "mean_prompt_tokens": statistics.mean(len(p) for _, p, _ in requests), "max_new_tokens": max_new,
            **results, "speedup_requests_per_s": results["cache"]["requests_per_s"] / results["no_cache"]["requests_per_s"],
            "goal": 1.7}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--replay-requests", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", default="kvcluster-tiny-llama")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--ttft-tokens", type=int, default=2048,
                        help="ttft's prompt; all but its last 64 tokens (rounded to 16-token blocks) are cached")
    parser.add_argument("--hit-prefixes", default="256,1024,1984", help="hit_overhead's cached prefixes (tokens)")
    parser.add_argument("--replay-datasets", default="sharegpt,swe-agent",
                        help="replayed datasets (SWE-agent's prompts are 2.5k tokens from the first turn)")
    args = parser.parse_args()
    prefixes = tuple(int(n) for n in args.hit_prefixes.split(","))
    if set(args.replay_datasets.split(",")) - {"sharegpt", "swe-agent"}:
        parser.error("--replay-datasets: sharegpt, swe-agent or both")
    if args.ttft_tokens < 80 or any(n < 16 or n % 16 for n in prefixes):
        parser.error("--ttft-tokens must be >= 80 and --hit-prefixes multiples of 16")
    out = JsonOutput(args.json)
    loaded = load_model(args.model)
    cached = (args.ttft_tokens - 64) // 16 * 16
    report = {"model": args.model, "torch_threads": torch.get_num_threads(),
              "ttft": bench_ttft(loaded, args.repeat, args.ttft_tokens, cached),
              "hit_overhead": bench_hit_overhead(loaded, 4 * args.repeat, prefixes)}
    if not args.skip_replay:
        report["replay"] = [bench_replay(loaded, d, args.replay_requests, args.max_new_tokens)
                            for d in args.replay_datasets.split(",")]
    if out.enabled:
        out.emit(report, indent=1)
        return
    t = report["ttft"]
    print(f"ttft {t['prompt_tokens']:,}-token prompt, {t['cached_tokens']:,} cached in dram: "
          f"cold {t['cold_ttft_s_p50']*1e3:.0f} ms, cached {t['cached_ttft_s_p50']*1e3:.0f} ms, {t['speedup']:.1f}x (goal 15x), same first token: {t['first_token_equal']}")
    for r in report["hit_overhead"]:
        print(f"hot {r['tier']} hit, {r['cached_tokens']} tokens ({r['bytes'] >> 10} KiB): p50 {r['p50_ms']:.2f} ms, "
              f"p99 {r['p99_ms']:.2f} ms; memcpy of the same bytes {r['memcpy_p50_ms']:.2f} ms")
    for r in report.get("replay", []):
        print(f"replay {r['dataset']} ({r['requests']} requests, {r['sessions']} sessions): "
              f"{r['cache']['requests_per_s']:.2f} vs {r['no_cache']['requests_per_s']:.2f} req/s = "
              f"{r['speedup_requests_per_s']:.2f}x (goal 1.7x); TTFT p50 {r['cache']['ttft_p50_s']*1e3:.0f} vs "
              f"{r['no_cache']['ttft_p50_s']*1e3:.0f} ms, p99 {r['cache']['ttft_p99_s']*1e3:.0f} vs "
              f"{r['no_cache']['ttft_p99_s']*1e3:.0f} ms; cached {r['cache']['cached_token_frac']:.0%} of prompt tokens")


if __name__ == "__main__":
    main()
