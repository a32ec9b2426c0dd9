"""Every benchmark at its smallest size (`benchmarks/smoke.py`) runs from the main suite, so that
`.venv/bin/python -m pytest -q` (the README's test command, which CI runs) fails on a benchmark that no longer
runs or whose `--json` output is not one JSON document.

The run starts in the background once the engine suite has ended (`tests/background.py`, from `conftest.py`):
most of a small benchmark run waits on process starts, and the main suite's Ray modules leave a core idle
then. This test, ordered last, waits for it and fails with its report. `tests/test_bench_smoke.py` tests the
runner itself.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parents[1] / "benchmarks" / "smoke.py"
if "bench_smoke" not in sys.modules:  # the module tests/test_bench_smoke.py loads too
    _spec = importlib.util.spec_from_file_location("bench_smoke", SMOKE)
    sys.modules["bench_smoke"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["bench_smoke"])
smoke = sys.modules["bench_smoke"]

pytestmark = pytest.mark.timeout(2700)


def test_every_benchmark_runs_at_its_smallest_size(background_runs) -> None:
    assert "benchmark-smoke" in background_runs, "the smoke run was not started at collection (conftest.py)"
    returncode, stdout, output = background_runs["benchmark-smoke"].wait(ceiling_s=1200)
    assert returncode == 0, output
    summary = re.search(r"smoke: (\d+) of (\d+) passed or skipped", stdout)
    files = smoke.benchmark_files()
    assert summary is not None, output
    assert int(summary[1]) == int(summary[2]) == len(files), output
    ran = re.findall(r"^ok   (\S+) ", stdout, re.MULTILINE)
    assert sorted(ran) == sorted(n for n in files if not (smoke.ENTRIES[n].skip or smoke.ENTRIES[n].part_of)), output
