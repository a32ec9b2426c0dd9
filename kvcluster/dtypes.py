"""Element sizes of the dtypes a KV cache is stored in."""

from __future__ import annotations

from .errors import ConfigError

_DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

DTYPE_CHOICES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")


def dtype_bytes(name: str) -> int:
    """Bytes per element of `name` (fp32, bf16, fp16, fp8 and their torch spellings)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPE_BYTES[key]


def canonical_dtype(name: str) -> str:
    """The short name (fp32/bf16/fp16/fp8) for any accepted spelling."""
    size = dtype_bytes(name)
    key = str(name).lower().removeprefix("torch.")
    if size == 1:
        return "fp8"
    if size == 4:
        return "fp32"
    return "bf16" if "b" in key else "fp16"
