"""Eviction policies behind one interface; `make_policy(name, capacity)` builds one."""

from .base import FAR, EvictionPolicy, RequestContext
from .registry import POLICIES, make_policy, policy_names

__all__ = ["FAR", "EvictionPolicy", "POLICIES", "RequestContext", "make_policy", "policy_names"]
