"""GPU check section sizing: the sizing engine's bytes against what a prefill leaves in the CUDA allocator."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch
from gpu_common import Plan, cuda, sync
from gpu_serving import random_tokens, served_model


@torch.inference_mode()
def prefill_bytes(loaded: Any, ids: torch.Tensor) -> tuple[int | None, int]:
    """(allocator delta, tensor bytes) of the cache one prefill of `ids` leaves behind."""
    from transformers import DynamicCache

    from kvcluster.sizing import cache_tensor_bytes

    gc.collect()
    sync()
    before = torch.cuda.memory_allocated() if cuda() else None
    cache = DynamicCache(config=loaded.model.config)
    out = loaded.model(input_ids=ids, cache=cache, use_cache=True)
    del out
    gc.collect()
    sync()
    delta = torch.cuda.memory_allocated() - before if before is not None else None
    tensors = cache_tensor_bytes(cache)
    del cache
    return delta, tensors


def section_sizing(plan: Plan, out: dict) -> None:
    """The sizing engine's bytes for N tokens vs what the allocator holds after a prefill of N tokens."""
    from kvcluster.sizing import size_model

    loaded, info = served_model(plan)
    out.update(model=info["model"], dtype=plan.dtype)
    n1, n2 = plan.sizing_tokens
    ids = torch.tensor([random_tokens(np.random.RandomState(7), n2)])
    prefill_bytes(loaded, ids[:, :n1])  # warm-up: workspaces made on first use are not the cache's
    rows = []
    for n in (n1, n2):
        delta, tensors = prefill_bytes(loaded, ids[:, :n])
        engine = size_model(loaded.spec, dtype=plan.dtype, context=n)
        measured = delta if delta is not None else tensors
        rows.append({"tokens": n, "measured_bytes": measured, "cache_tensor_bytes": tensors,
                     "engine_bytes_per_sequence": engine.bytes_per_sequence,
                     "engine_bytes_per_token_x_tokens": engine.bytes_per_token * n,
                     "measured_over_engine": round(measured / engine.bytes_per_sequence, 4)})
    out["measured_by"] = ("torch.cuda.memory_allocated() delta across the prefill" if cuda()
                          else "sum of the cache's tensor bytes (no CUDA allocator on the CPU)")
    out["rows"] = rows
    engine_bpt = size_model(loaded.spec, dtype=plan.dtype, context=n2).bytes_per_token
    slope = (rows[1]["measured_bytes"] - rows[0]["measured_bytes"]) / (n2 - n1)
    out.update(engine_bytes_per_token=engine_bpt, measured_bytes_per_token=slope,
               slope_over_engine=round(slope / engine_bpt, 4),
               exact=all(r["measured_bytes"] == r["engine_bytes_per_sequence"] for r in rows))


def summary_sizing(s: dict) -> str:
    last = s["rows"][-1]
    return (f"engine {s['engine_bytes_per_token']:,} B/token; measured {s['measured_bytes_per_token']:,.0f} B/token "
            f"({s['slope_over_engine']:.2%}); at {last['tokens']} tokens {last['measured_bytes']:,} B vs engine "
            f"{last['engine_bytes_per_sequence']:,} ({last['measured_over_engine']:.2%})")
