"""What every section of the GPU check shares: the run's plan, the device, timing, buffers and keys.

Timing is the benchmarks' harness with a device sync around each call (CUDA copies
are asynchronous: without it a call would be billed for work queued before it, or
leave its own unbilled) and one untimed warm-up (first use allocates and compiles).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from harness import best_of
from harness import versus as _versus

DRY_LABEL = "cpu (dry run, not a GPU result)"
GOAL = 0.8  # backend / reference throughput the tiers aim for


class Skip(Exception):
    """A part that cannot run here: reported with its reason, never a crash."""



@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run: real ones on a GPU, tiny ones for the dry run."""

    dry: bool
    device: str  # torch device of HBM, the model and its cache
    label: str  # goes on every figure
    model: str
    dtype: str
    block_tokens: int
    blocks: int  # blocks per batch in the tier moves
    repeat: int
    prompt_tokens: int
    prefix_tokens: int  # of the prompt, in DRAM before the timed request
    decode_tokens: int
    requests: int  # timed cold/warm request pairs
    sizing_tokens: tuple[int, int]
    budgets: dict[str, float]


def full_plan(label: str) -> Plan:
    return Plan(False, "cuda", label, "llama-3.1-8b", "bf16", 16, 128, 5, 2048, 1984, 64, 3, (1024, 4096),
                {"hbm": 40, "paged": 40, "nvme": 60, "nixl": 60, "serving": 240, "sizing": 60})


def dry_plan() -> Plan:
    return Plan(True, "cpu", DRY_LABEL, "kvcluster-tiny-llama", "bf16", 16, 16, 2, 64, 48, 8, 2, (64, 160),
                {"hbm": 30, "paged": 20, "nvme": 30, "nixl": 30, "serving": 120, "sizing": 30})



# ---- timing --------------------------------------------------------------------------------------------


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()



def best_s(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    """Fastest of `repeat` timed runs after one untimed warm-up (setup runs untimed before each)."""
    return best_of(fn, repeat, setup=setup, warmup=1, sync=sync)


def versus(seconds: float, ref_seconds: float, nbytes: int, ref: str) -> dict:
    """A backend's throughput next to its same-run reference on the same bytes, against the tiers' goal."""
    return _versus(seconds, ref_seconds, nbytes, ref, GOAL)


# ---- buffers and keys ----------------------------------------------------------------------------------


def host_blocks(n: int, block: int, seed: int | None = None) -> torch.Tensor:
    """`n` blocks of host memory, pinned where CUDA is (the DRAM tier's kind of memory)."""
    t = torch.empty((n, block), dtype=torch.uint8, pin_memory=cuda())
    if seed is not None:
        t.numpy()[:] = np.random.default_rng(seed).integers(0, 256, (n, block), dtype=np.uint8)
    return t


def block_keys(tag: str, n: int) -> list:
    from kvcluster.keys import KeySpace

    return KeySpace(model=f"gpu-check-{tag}").chain_hash_ids(list(range(n)), cache_salt=tag)


def block_bytes(plan: Plan) -> int:
    """One block of the served model in the plan's dtype (2 MiB for Llama-3.1-8B in bf16)."""
    from kvcluster.model_spec import load_model_spec
    from kvcluster.storage.layout import layout_for

    return layout_for(load_model_spec(plan.model), plan.block_tokens, plan.dtype).nbytes()
