"""The CPU features that change what vLLM's CPU build runs, read the way vLLM reads them, and a switch to hide them.

vLLM's CPU build picks its kernels by CPU feature: AMX tiles (Intel Sapphire Rapids and later) get kernels of
their own (16-bit weights only), AVX-512 and AVX2 others. A test that needs one of them skips where it is missing,
with one of the reasons below, so that a suite passes on every x86-64 CPU vLLM runs on; the suite's wrapper
(tests/engine_verdict.py) accepts exactly these reasons as skips. `KVCLUSTER_HIDE_CPU_FEATURES` (comma
separated, e.g. `amx_tile`) makes the tests behave as on a CPU without them, so a machine with AMX can prove
that the suite passes without it. Run as `python -m kvcluster.cpu_features` to print the line `.ci/run` ends with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HIDE_ENV = "KVCLUSTER_HIDE_CPU_FEATURES"
# the features that decide which tests run, as /proc/cpuinfo names them
DECIDING = ("amx_tile", "avx512f", "avx2")
NO_AMX = "hardware: the CPU has no AMX tiles (vLLM's AMX kernels cannot run)"
HARDWARE_SKIP_REASONS = (NO_AMX,)


def hidden() -> frozenset[str]:
    """The features the environment hides from the tests."""
    return frozenset(f.strip() for f in os.environ.get(HIDE_ENV, "").split(",") if f.strip())


def cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags (every core of a machine has the same); none where the file is missing."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _amx_as_torch_sees_it() -> bool:
    """AMX tiles as torch (and so vLLM's CPU build, which asks torch) detects them: the CPU and the kernel's
    permission to use them, not just the cpuinfo flag."""
    try:
        import torch
    except ImportError:
        return "amx_tile" in cpuinfo_flags()
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def has(feature: str) -> bool:
    """Whether the tests may count on `feature` (an entry of DECIDING): present and not hidden."""
    if feature in hidden():
        return False
    if feature == "amx_tile":
        return _amx_as_torch_sees_it()
    return feature in cpuinfo_flags()


def has_amx() -> bool:
    return has("amx_tile")


def summary() -> str:
    """One line: each deciding feature, present or not, and whether the switch hid it."""
    parts = []
    for feature in DECIDING:
        if feature in hidden():
            parts.append(f"{feature}=hidden ({HIDE_ENV})")
        else:
            parts.append(f"{feature}={'yes' if has(feature) else 'no'}")
    return "CPU features that decided which tests ran: " + ", ".join(parts)


if __name__ == "__main__":
    print(summary())
    sys.exit(0)
