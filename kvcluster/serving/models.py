"""Loading the served model: a local HF checkpoint, or a named architecture with random weights.

A name resolves to `configs/models/NAME.json` (the same configs the sizing engine
reads), built with seeded random weights so every replica and every test run
holds the same model. A directory with `config.json` and weights loads with
`from_pretrained`, offline. Either way the tokenizer is the offline one from
`kvcluster.tokenizer` unless the checkpoint ships its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..model_spec import ModelSpec, load_model_spec, resolve_model_path
from ..tokenizer import load_tokenizer

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str  # the id clients send as `model`
    model: Any  # a transformers CausalLM in eval mode
    tokenizer: Any
    spec: ModelSpec
    dtype: str  # fp32 / bf16 / fp16: the KV cache is stored in this dtype
    fingerprint: str  # goes into every block key: equal keys must mean equal KV

    @property
    def context_window(self) -> int:
        return self.spec.max_position_embeddings or 2048

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None) or self.model.config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def load_model(name_or_path: str, dtype: str = "fp32", seed: int = 0, served_name: str | None = None,
               device: str = "cpu") -> LoadedModel:
    """Build or load the model; raises ConfigError naming what is wrong.

    `device` builds the weights there directly (random 8B weights made on the CPU and
    then moved would take minutes); random weights made on another device differ from
    the CPU's for the same seed, so the fingerprint names the device (not for "cpu").
    """
    from transformers import AutoModelForCausalLM

    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype!r}: choose one of {', '.join(TORCH_DTYPES)}")
    spec = load_model_spec(name_or_path)
    torch_dtype = TORCH_DTYPES[dtype]
    path = Path(name_or_path)
    if is_checkpoint(path):
        placement = {} if device == "cpu" else {"device_map": device}
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True, **placement)
    else:
        torch.manual_seed(seed)
        config = spec.hf_config
        config._attn_implementation = "eager" if _needs_eager(config) else "sdpa"
        with contextlib.nullcontext() if device == "cpu" else torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.eval()
    tokenizer = load_model_tokenizer(name_or_path)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"model {name_or_path!r} has {vocab} embeddings but its tokenizer has {len(tokenizer)} tokens")
    fingerprint = model_fingerprint(name_or_path, dtype, seed, device)
    return LoadedModel(served_name or spec.name, model, tokenizer, spec, dtype, fingerprint)


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and _has_weights(path)


def model_fingerprint(name_or_path: str, dtype: str, seed: int = 0, device: str = "cpu") -> str:
    """What makes two replicas' KV equal: weights' source, dtype, RoPE settings (and, for random weights, the
    device that drew them). Needs no weights loaded, so the ingress computes the same block keys as the replicas."""
    spec = load_model_spec(name_or_path)
    path = Path(name_or_path)
    if is_checkpoint(path):
        source = f"checkpoint:{path.resolve()}"
    else:
        config_text = resolve_model_path(name_or_path).read_text()
        source = f"random:{hashlib.sha256(config_text.encode()).hexdigest()[:16]}:seed{seed}"
    cfg = spec.hf_config
    rope = json.dumps(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None),
                      sort_keys=True, default=str)
    init = f"|init={torch.device(device).type}" if device != "cpu" and not is_checkpoint(path) else ""
    return f"{spec.name}|{source}|{dtype}|rope={rope}{init}"


def load_model_tokenizer(name_or_path: str):
    """The checkpoint's own tokenizer when it ships one, else the offline built-in one."""
    path = Path(name_or_path)
    return _checkpoint_tokenizer(path) if path.is_dir() else load_tokenizer()


def _needs_eager(config: Any) -> bool:
    """Sliding-window and MLA stacks run eager attention on CPU: the reference path transformers tests against."""
    return bool(getattr(config, "sliding_window", None)) or getattr(config, "kv_lora_rank", None) is not None


def _checkpoint_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return load_tokenizer()
