"""Policies by name: `make_policy("lru", capacity)`."""

from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import EvictionPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {}
_BUILTIN = ("lru", "lfu", "arc", "s3fifo", "sieve", "bayes", "bayes_v1", "belady")


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make `cls` available under `cls.name`."""
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str, capacity: int, **kwargs) -> EvictionPolicy:
    """A new policy instance; options a policy does not take are an error."""
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](capacity, **kwargs)


for _module in _BUILTIN:
    importlib.import_module(f"{__package__}.{_module}")
