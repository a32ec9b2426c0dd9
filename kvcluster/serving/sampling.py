"""Choosing the next token: greedy at temperature 0, else temperature + nucleus (top_p) sampling."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: keep the smallest set of tokens with this mass.")
    stop: tuple[str, ...] = Field((), max_length=4, description="Generation ends before any of these strings.")
    seed: int | None = Field(None, description="Makes sampled output repeatable.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token (benchmarks).")


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
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
