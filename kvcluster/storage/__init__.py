"""Tier storage backends: one batched interface, six media (see DESIGN.md's tier table).

Each name loads its module on first use (PEP 562): a process that only reads files or plans
(a node controller, the pool manager, a file tier) never imports torch, which the memory and
peer-memory tiers need and which costs a Ray worker seconds and ~200 MB to load.
"""

from importlib import import_module

_HOME = {
    "StorageBackend": "base", "StorageError": "base", "checksum": "base",
    "BlockLayout": "layout", "layout_for": "layout",
    "MemoryPoolBackend": "memory", "cxl_backend": "memory", "dram_backend": "memory", "hbm_backend": "memory",
    "NVMeBackend": "nvme", "SlabInUse": "slab_owner", "PFSBackend": "pfs", "LentDirectory": "lent",
    "NixlPeerPool": "rdma", "NixlRegionLender": "rdma", "RDMABackend": "rdma",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
