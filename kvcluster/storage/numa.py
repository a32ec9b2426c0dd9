"""Finding CXL expanders (CPU-less NUMA nodes) and binding memory to them with mbind(2)."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_BIND = 2
_MPOL_MF_MOVE = 2


def cpuless_numa_nodes(root: str = "/sys/devices/system/node") -> list[int]:
    """NUMA nodes that have memory but no CPUs: how Linux presents CXL Type-3 memory."""
    nodes = []
    for node in sorted(Path(root).glob("node[0-9]*")):
        try:
            cpus = (node / "cpulist").read_text().strip()
            mem_kb = int(next(l for l in (node / "meminfo").read_text().splitlines() if "MemTotal" in l).split()[-2])
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if not cpus and mem_kb > 0:
            nodes.append(int(node.name[4:]))
    return nodes


def bind_to_node(addr: int, length: int, node: int) -> None:
    """mbind the pages of [addr, addr + length) to `node`; raises OSError on failure."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise OSError(f"mbind syscall number unknown on {platform.machine()}")
    page = os.sysconf("SC_PAGE_SIZE")
    start = addr - addr % page
    length += addr - start
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(number, ctypes.c_void_p(start), ctypes.c_ulong(length), _MPOL_BIND,
                      ctypes.byref(mask), ctypes.c_ulong(node + 2), _MPOL_MF_MOVE)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
