"""benchmarks/harness.py: best-of timing picks the right round, and --json stdout holds nothing but the report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py"
_spec = importlib.util.spec_from_file_location("bench_harness", HARNESS)
harness = sys.modules["bench_harness"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

REPORT = {"rows": [{"batch_bytes": 4194304, "ratio": 0.93}], "ok": True, "name": "noisy"}

# Noise from every writer a benchmark's process has: Python's print, a C-level write to fd 1, libc's
# buffered stdio (flushed at exit, after the report), a child process, and an atexit handler.
NOISY = textwrap.dedent(f"""
    import atexit, ctypes, importlib.util, os, subprocess, sys
    spec = importlib.util.spec_from_file_location("harness", {str(HARNESS)!r})
    harness = sys.modules["harness"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    print("python noise before", flush=False)
    out = harness.JsonOutput("--json" in sys.argv)
    print("python noise")
    os.write(1, b"c-level noise\\n")
    ctypes.CDLL(None).puts(b"libc buffered noise")
    subprocess.run(["sh", "-c", "echo child noise"], check=True)
    atexit.register(lambda: print("atexit noise"))
    if out.enabled:
        out.emit({REPORT!r}, indent=1)
    else:
        print("a table for people")
""")


def run_noisy(*args: str) -> subprocess.CompletedProcess:
    """The noisy program, its stdout block-buffered as in any pipe (what it printed before --json took
    effect is still in Python's buffer then, and must not reach stdout either)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", NOISY, *args], capture_output=True, text=True, timeout=60, env=env)


def test_json_mode_stdout_is_only_the_report() -> None:
    done = run_noisy("--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == REPORT
    for noise in ("python noise before", "python noise", "c-level noise", "libc buffered noise", "child noise",
                  "atexit noise"):
        assert noise in done.stderr.splitlines(), (noise, done.stderr)


def test_without_json_nothing_is_redirected() -> None:
    done = run_noisy()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for noise in ("python noise before", "python noise", "c-level noise", "child noise", "a table for people",
                  "atexit noise"):
        assert noise in lines, (noise, done.stdout)
    with pytest.raises(RuntimeError, match="without --json"):
        harness.JsonOutput(False).emit({})


class FakeClock:
    """A clock that moves only when a timed call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def takes(self, durations: list[float]):
        left = list(durations)

        def fn() -> float:
            d = left.pop(0)
            self.now += d
            return d
        return fn


def test_best_of_is_the_fastest_round_without_warmup_setup_or_check() -> None:
    clock = FakeClock()
    checked = []
    best = harness.best_of(harness.Case(clock.takes([0.001, 0.5, 0.25, 0.375]), check=checked.append), 3,
                           setup=lambda: setattr(clock, "now", clock.now + 100.0), warmup=1, clock=clock)
    assert best == 0.25  # the warm-up's 0.001 and the setups' 100 s are not timed
    assert checked == [0.001, 0.5, 0.25, 0.375]  # every call's result was checked, the warm-up's too


def test_timings_keep_every_round_in_order() -> None:
    clock = FakeClock()
    assert harness.timings(clock.takes([0.5, 0.25, 0.125]), 3, clock=clock) == [0.5, 0.25, 0.125]


def test_best_of_real_sleeps_is_the_shortest_sleep() -> None:
    sleeps = iter([0.12, 0.03, 0.09])
    best = harness.best_of(lambda: time.sleep(next(sleeps)), 3)
    assert 0.03 <= best < 0.09  # a sleep never returns early; a late one would have to be 60 ms late


def test_interleaved_rotates_the_order_each_round() -> None:
    order: list[str] = []
    cases = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = harness.interleaved(cases, 3)
    assert order == list("abc" + "bca" + "cab")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    order.clear()
    harness.interleaved(cases, 2, rotate=False)
    assert order == list("abcabc")


def test_best_interleaved_takes_each_cases_own_best() -> None:
    clock = FakeClock()
    cases = {"backend": clock.takes([0.5, 0.25]), "reference": clock.takes([0.125, 0.375])}
    assert harness.best_interleaved(cases, 2, clock=clock) == {"backend": 0.25, "reference": 0.125}


def test_versus_puts_a_figure_next_to_its_reference() -> None:
    assert harness.ratio(1.0, 2.0) == 0.5
    assert harness.versus(2.0, 1.0, 4_000_000_000, "numpy copy", 0.8) == {
        "gbps": 2.0, "ref": "numpy copy", "ref_gbps": 4.0, "ratio": 0.5, "goal": 0.8, "meets_goal": False}
    assert harness.versus(1.0, 0.9, 1_000_000_000, "x", 0.8)["meets_goal"] is True


def test_repeat_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="repeat must be at least 1, got 0"):
        harness.best_of(lambda: None, 0)
    with pytest.raises(ValueError, match="repeat must be at least 1"):
        harness.interleaved({"a": lambda: None}, 0)
