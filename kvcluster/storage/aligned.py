"""Page-aligned host buffers, so blocks can go to and from disk without a bounce copy.

Why: O_DIRECT (and GPUDirect Storage's host path) needs the buffer address and
length aligned to the device's block size. numpy and torch hand out large arrays
a few bytes past a page boundary, so every block a tier pool or a read returned
had to be copied into an aligned staging buffer first, and that copy, running
beside the disk I/O on another core, slowed the I/O by a quarter (measured in
benchmarks/RESULTS.md).
Pools and read results allocated here are aligned, and the NVMe tier writes and
reads them in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

PAGE = 4096


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """An uninitialized uint8 array of `nbytes` whose first byte sits on an `align` boundary."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]


def aligned_host_tensor(rows: int, row_bytes: int, *, pin: bool = False, align: int = PAGE) -> torch.Tensor:
    """A (rows, row_bytes) uint8 CPU tensor starting on an `align` boundary (rows too, when row_bytes is a multiple).

    A view into a slightly larger allocation; `pin` pins it (CUDA hosts), as a tier pool is.
    """
    import torch

    flat = torch.empty(rows * row_bytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = -flat.data_ptr() % align
    return flat[skip : skip + rows * row_bytes].view(rows, row_bytes)


def is_aligned(view: np.ndarray, align: int = PAGE) -> bool:
    """Whether a contiguous byte view can be the buffer of an O_DIRECT transfer as it is."""
    return view.flags.c_contiguous and view.ctypes.data % align == 0 and view.nbytes % align == 0
