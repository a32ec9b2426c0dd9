"""Choosing the next token: greedy at temperature 0, else temperature, top_k and nucleus (top_p) sampling.

Log-probabilities reported to clients are the model's raw distribution (log-softmax
of the logits before temperature, top_k or top_p), as vLLM reports them by default.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: keep the smallest set of tokens with this mass.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens only; 0: all.")
    min_tokens: int = Field(0, ge=0, description="Neither end-of-sequence nor a stop string ends the answer before "
                                                 "this many tokens.")
    stop: tuple[str, ...] = Field((), max_length=4, description="Generation ends before any of these strings.")
    seed: int | None = Field(None, description="Makes sampled output repeatable.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token (benchmarks).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Report each output token's log-probability and "
                                                               "this many most likely alternatives; None: none.")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="The same for every prompt token (needs a "
                                                                      "prefill of the whole prompt: no cache).")


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's random stream, on the device the logits live on."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from the last position's logits `[vocab]`."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits.float()
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the `top` most likely (id, log-probability)) under the raw logits `[vocab]`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(logp, top)
        alternatives = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logp[token]), alternatives
