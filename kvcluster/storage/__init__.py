"""Tier storage backends: one batched interface, six media (see DESIGN.md's tier table)."""

from .base import StorageBackend, StorageError, checksum
from .layout import BlockLayout, layout_for
from .memory import MemoryPoolBackend, cxl_backend, dram_backend, hbm_backend
from .nvme import NVMeBackend
from .pfs import PFSBackend
from .lent import LentDirectory
from .rdma import NixlPeerPool, NixlRegionLender, RDMABackend

__all__ = [
    "BlockLayout", "LentDirectory", "MemoryPoolBackend", "NVMeBackend", "NixlPeerPool", "NixlRegionLender",
    "PFSBackend", "RDMABackend",
    "StorageBackend", "StorageError", "checksum", "cxl_backend", "dram_backend", "hbm_backend", "layout_for",
]
