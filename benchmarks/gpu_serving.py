"""GPU check section serving: TTFT with the prefix in DRAM against cold prefill, decode speed, exactness.

Exactness is judged against the same split prefilled: the bare model prefilling the cached prefix,
then the tail. In bf16 on a GPU one full prefill rounds differently from that split (other
kernel shapes), and a model with random weights has near-tied logits, so greedy outputs of the
two drift apart after a few tokens whether or not a cache is involved; both are reported.

Also the served model itself (built once, shared with the sizing section).
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from typing import Any

import numpy as np
import torch
from gpu_common import Plan, cuda, sync


class RunnerModel:
    """The model as the runner calls it, on any device and transformers version.

    The runner passes CPU input ids and `cache=` (transformers 5.24); this moves the
    ids to the model's device and names the cache argument the installed
    transformers takes (`past_key_values` in 5.17, where `cache=` would be
    swallowed by **kwargs and the restored prefix silently ignored).
    """

    def __init__(self, model: Any, device: str) -> None:
        self.model, self.device = model, torch.device(device)
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = next((k for k in ("cache", "past_key_values") if k in params), None)
        if self.cache_kwarg is None:
            raise RuntimeError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=")

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        if "cache" in kwargs and self.cache_kwarg != "cache":  # the runner itself already names it right
            kwargs[self.cache_kwarg] = kwargs.pop("cache")
        return self.model(input_ids=input_ids.to(self.device), **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (copies, pickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)


_MODEL: dict[str, Any] = {}


def served_model(plan: Plan) -> tuple[Any, dict]:
    """The plan's model, built once on its device with seeded random weights (a failure is kept, not retried)."""
    if "error" in _MODEL:
        raise RuntimeError(f"the model could not be built earlier: {_MODEL['error']}")
    if "loaded" not in _MODEL:
        import transformers

        from kvcluster.serving.models import load_model

        t0 = time.perf_counter()
        try:
            loaded = load_model(plan.model, dtype=plan.dtype, seed=0, device=plan.device)
        except Exception as exc:
            _MODEL["error"] = f"{type(exc).__name__}: {exc}"
            raise
        sync()
        view = RunnerModel(loaded.model, plan.device)
        weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        _MODEL["loaded"] = dataclasses.replace(loaded, model=view)
        _MODEL["info"] = {"model": plan.model, "dtype": plan.dtype, "build_s": round(time.perf_counter() - t0, 2),
                          "weights_gib": round(weights / 2**30, 2), "transformers": transformers.__version__,
                          "cache_kwarg": view.cache_kwarg,
                          "attn_implementation": getattr(loaded.model.config, "_attn_implementation", "?"),
                          "model_device": str(next(loaded.model.parameters()).device)}
    return _MODEL["loaded"], dict(_MODEL["info"])


def make_runner(loaded: Any, plan: Plan, store: Any):
    """A ModelRunner on the plan's model; it finds the model's device and cache argument itself."""
    from kvcluster.serving.runner import ModelRunner

    runner = ModelRunner(loaded, store, plan.block_tokens)
    if runner.device.type != torch.device(plan.device).type:
        raise RuntimeError(f"the runner sees the model on {runner.device}, the plan wants {plan.device}")
    return runner


def random_tokens(rng: np.random.RandomState, n: int) -> list[int]:
    return [int(t) for t in rng.randint(3, 32000, n)]  # ids every shipped tokenizer and model knows


def timed_request(runner: Any, ids: list[int], params: Any) -> dict:
    """One request through start/step/finish: TTFT (the runner's own clock), decode tokens/s, write-back time."""
    gen = runner.start(ids, params)
    t1 = time.perf_counter()
    while not gen.done:
        runner.step(gen)
    sync()
    t2 = time.perf_counter()
    runner.new_text(gen)
    runner.finish(gen)
    steps = len(gen.output_ids) - 1
    return {"ttft_s": round(gen.ttft_s, 5), "fetch_s": round(gen.fetch_s, 5), "cached_tokens": gen.cached_tokens,
            "decode_tokens_per_s": round(steps / (t2 - t1), 2) if steps else None,
            "write_back_s": round(time.perf_counter() - t2, 4), "stored_blocks": gen.stored_blocks,
            "output_ids": list(gen.output_ids)}


@torch.inference_mode()
def raw_greedy(loaded: Any, ids: list[int], steps: int) -> dict:
    """The bare model with a fresh DynamicCache, greedy: the decode reference, and a third output to compare."""
    from transformers import DynamicCache

    model = loaded.model
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    out = [int(torch.argmax(logits))]
    t1 = time.perf_counter()
    for _ in range(steps - 1):
        logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        out.append(int(torch.argmax(logits)))
    sync()
    t2 = time.perf_counter()
    return {"ttft_s": round(t1 - t0, 5), "decode_tokens_per_s": round((steps - 1) / (t2 - t1), 2) if steps > 1
            else None, "output_ids": out}


@torch.inference_mode()
def restored_bytes_exact(runner: Any, prefix: list[int]) -> dict:
    """The prefix's blocks as the store hands them back vs the KV a fresh prefill of the same prefix computes, byte
    for byte: whether the tiers return exactly what the model would compute (same shapes, same kernels)."""
    model = runner.loaded.model
    keys = runner.block_keys(prefix)
    fetched = runner.store.fetch(keys)
    cache = runner.codec.new_cache()
    model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
    fresh = runner.codec.encode(cache, 0, len(keys))
    equal = [np.array_equal(np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a), b)
             for a, b in zip(fetched, fresh)]
    return {"blocks": len(keys), "fetched": len(fetched), "bytes_equal": len(fetched) == len(keys) and all(equal),
            "first_unequal_block": next((j for j, e in enumerate(equal) if not e), None)}


@torch.inference_mode()
def split_greedy(loaded: Any, prefix: list[int], tail: list[int], steps: int) -> list[int]:
    """Greedy output of the bare model prefilling `prefix`, then `tail`, then decoding: the split a cached prefix
    takes. Same shapes, same kernels: a restored prefix must give exactly this, in any dtype."""
    from transformers import DynamicCache

    model = loaded.model
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
    logits = model(input_ids=torch.tensor([tail]), cache=cache, use_cache=True).logits[0, -1]
    out = [int(torch.argmax(logits))]
    for _ in range(steps - 1):
        logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        out.append(int(torch.argmax(logits)))
    return out


def dram_read(dram: Any, runner: Any, ids: list[int], prefix: int, repeat: int) -> dict:
    """The fetch's parts apart: the dram tier's verified read of the prefix into the runner's landing rows, and
    their upload (one DMA from pinned memory where the model is on a GPU)."""
    from gpu_common import best_s

    keys = runner.block_keys(ids[:prefix])
    rows = runner.codec.landing(len(keys))
    nbytes = rows.nbytes
    read_s = best_s(lambda: dram.read_verified(keys, list(rows)), repeat)
    up_s = best_s(lambda: runner.codec._device_rows(list(rows)), repeat)
    device_rows = runner.codec.landing(len(keys), on_device=True)  # what the runner fetches into on a GPU
    to_device_s = best_s(lambda: dram.read_verified(keys, list(device_rows)), repeat)
    return {"blocks": len(keys), "bytes": nbytes, "verified_read_gbps": round(nbytes / read_s / 1e9, 3),
            "upload_gbps": round(nbytes / up_s / 1e9, 3), "read_workers": dram._workers.workers,
            "upload": "one DMA from pinned landing rows" if cuda() else "clone on the CPU (no CUDA)",
            "verified_read_to_device_rows_gbps": round(nbytes / to_device_s / 1e9, 3),
            "to_device_rows": "DMA per block from the pinned slots, verified on the device" if cuda()
            else "host rows (no CUDA)"}


@torch.inference_mode()
def first_token_gap(runner: Any, ids: list[int], prefix: int) -> dict:
    """Next-token logits after the restored prefix vs after a full prefill: how far apart the two paths are."""
    model = runner.loaded.model
    payloads = runner.store.fetch(runner.block_keys(ids[:prefix]))
    warm = model(input_ids=torch.tensor([ids[len(payloads) * runner.block_tokens:]]),
                 cache=runner.codec.decode(payloads), use_cache=True).logits[0, -1].float()
    cold = model(input_ids=torch.tensor([ids]), cache=runner.codec.new_cache(), use_cache=True).logits[0, -1].float()
    top2 = torch.topk(cold, 2).values
    return {"max_abs_diff": float((warm - cold).abs().max()), "cold_top1_minus_top2": float(top2[0] - top2[1]),
            "same_argmax": int(torch.argmax(warm)) == int(torch.argmax(cold)), "restored_blocks": len(payloads)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def section_serving(plan: Plan, out: dict) -> None:
    """TTFT with the prompt's prefix in DRAM vs cold prefill, decode tokens/s, greedy equality."""
    from kvcluster.serving.block_store import LocalBlockStore
    from kvcluster.serving.sampling import SamplingParams
    from kvcluster.storage import dram_backend, layout_for
    from kvcluster.storage.tiered import TieredStore

    loaded, info = served_model(plan)
    out.update(info)
    out.update(prompt_tokens=plan.prompt_tokens, prefix_tokens=plan.prefix_tokens, decode_tokens=plan.decode_tokens,
               block_tokens=plan.block_tokens)
    block = layout_for(loaded.spec, plan.block_tokens, plan.dtype).nbytes()
    slots = (plan.prompt_tokens + plan.decode_tokens) // plan.block_tokens * (plan.requests + 2) + 8
    dram = dram_backend(slots, block)
    out["store"] = f"TieredStore([dram]): {slots} x {block >> 10} KiB, {dram.medium}"
    cold, warm = make_runner(loaded, plan, None), make_runner(loaded, plan, LocalBlockStore(TieredStore([dram], block)))
    greedy = SamplingParams(max_tokens=plan.decode_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.RandomState(0)
    prefix = random_tokens(rng, plan.prefix_tokens)
    tails = [random_tokens(rng, plan.prompt_tokens - plan.prefix_tokens) for _ in range(plan.requests + 1)]
    one = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    cold.complete(prefix + tails[0], one)  # warm-up: kernels and allocator at these lengths
    seeded = warm.complete(prefix, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out["prefix_blocks_in_dram"] = seeded.stored_blocks
    runs = []
    for tail in tails[1:]:  # a new tail each time: the cached part is exactly the prefix
        c, w = timed_request(cold, prefix + tail, greedy), timed_request(warm, prefix + tail, greedy)
        runs.append({"cold": c, "warm": w, "greedy_equal": c["output_ids"] == w["output_ids"],
                     "first_divergence": first_divergence(c["output_ids"], w["output_ids"])})
        out["runs"] = runs
    summarise_runs(out, runs, plan)
    split = split_greedy(loaded, prefix, tails[1], plan.decode_tokens)
    out["exact"] = {"warm_equals_split_prefill": split == runs[0]["warm"]["output_ids"],
                    "first_divergence": first_divergence(split, runs[0]["warm"]["output_ids"]),
                    "reference": "the bare model prefilling the cached prefix, then the tail, then greedy decoding"}
    out["exact"]["restored_kv"] = restored_bytes_exact(warm, prefix)
    out["fetch_parts"] = dram_read(dram, warm, prefix + tails[1], plan.prefix_tokens, plan.repeat)
    ref = raw_greedy(loaded, prefix + tails[1], plan.decode_tokens)
    runner_tps = out["decode_tokens_per_s_cold"]
    out["raw_model_reference"] = {k: v for k, v in ref.items() if k != "output_ids"} | {
        "greedy_equal_to_cold_runner": ref["output_ids"] == runs[0]["cold"]["output_ids"],
        "runner_decode_vs_raw": round(runner_tps / ref["decode_tokens_per_s"], 3)
        if runner_tps and ref["decode_tokens_per_s"] else None}
    out["first_token_logits"] = first_token_gap(warm, prefix + tails[1], plan.prefix_tokens)
    drop_equal_outputs(runs)
    if cuda():
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def summarise_runs(out: dict, runs: list[dict], plan: Plan) -> None:
    """Medians over the timed pairs, and whether every pair's greedy output matched."""
    med = lambda side, key: round(statistics.median(r[side][key] for r in runs), 5)  # noqa: E731
    cold_ttft, warm_ttft = med("cold", "ttft_s"), med("warm", "ttft_s")
    out["ttft_cold_s"], out["ttft_prefix_in_dram_s"] = cold_ttft, warm_ttft
    out["ttft_speedup"] = round(cold_ttft / warm_ttft, 2)
    out["fetch_s"] = med("warm", "fetch_s")
    out["cached_tokens"] = [r["warm"]["cached_tokens"] for r in runs]
    out["prefix_fully_cached"] = all(t == plan.prefix_tokens for t in out["cached_tokens"])
    out["decode_tokens_per_s_cold"], out["decode_tokens_per_s_warm"] = (
        med("cold", "decode_tokens_per_s"), med("warm", "decode_tokens_per_s"))
    out["greedy_equal"] = all(r["greedy_equal"] for r in runs)


def drop_equal_outputs(runs: list[dict]) -> None:
    """The full id lists stay in the report only where cold and warm differ."""
    for r in runs:
        if r["greedy_equal"]:
            r["cold"].pop("output_ids")
            r["warm"].pop("output_ids")


def summary_serving(s: dict) -> str:
    ref = s["raw_model_reference"]
    return (f"{s['model']} {s['dtype']}: TTFT cold {s['ttft_cold_s'] * 1e3:.1f} ms, {s['prefix_tokens']}/"
            f"{s['prompt_tokens']} in DRAM {s['ttft_prefix_in_dram_s'] * 1e3:.1f} ms ({s['ttft_speedup']:.1f}x); "
            f"decode {s['decode_tokens_per_s_cold']:.1f} tok/s vs bare model {ref['decode_tokens_per_s']:.1f} "
            f"({ref['runner_decode_vs_raw']:.0%}); restored KV bytes equal a fresh prefill's: "
            f"{s['exact']['restored_kv']['bytes_equal']}; output equals the same split prefilled: "
            f"{s['exact']['warm_equals_split_prefill']}, equals one full prefill: {s['greedy_equal']}; "
            f"dram read {s['fetch_parts']['verified_read_gbps']:.1f} GB/s + upload {s['fetch_parts']['upload_gbps']:.1f}, "
            f"straight to the device {s['fetch_parts']['verified_read_to_device_rows_gbps']:.1f}")
