"""What every benchmark shares: best-of timing, same-run reference ratios, and stdout that is only JSON.

Timing. A figure on a shared machine is only as good as its reference measured
beside it: `interleaved` runs a backend and its reference in turn each round (so
both see the same moments of a machine whose bandwidth swings within seconds),
and the ratio between them (`versus`) is what a benchmark reports. The best of N
rounds is the figure least disturbed by other work; `timings` keeps every round
where a median or a tail is wanted.

JSON. `JsonOutput(True)` points fd 1 at stderr for the rest of the process and
keeps the real stdout for the report alone: Ray's raylet lines, C++ libraries
(NIXL, UCX) and child processes all write to fd 1, and none of them may reach
`benchmark --json | jq`. fd 1 is not restored, because Ray's threads and atexit
handlers still write after the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Mapping

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed operation: `setup` runs untimed before each call, `check` untimed on each call's result."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    check: Callable[[Any], Any] | None = None


def _case(case: Case | Callable[[], Any]) -> Case:
    return case if isinstance(case, Case) else Case(case)


def _timed(case: Case, sync: Callable[[], Any] | None, clock: Clock) -> float:
    if case.setup is not None:
        case.setup()
    if sync is not None:  # queued device work must not be billed to this call
        sync()
    t0 = clock()
    result = case.fn()
    if sync is not None:  # nor may this call's own device work escape it
        sync()
    seconds = clock() - t0
    if case.check is not None:
        case.check(result)
    return seconds


def timings(fn: Case | Callable[[], Any], repeat: int, *, warmup: int = 0, sync: Callable[[], Any] | None = None,
            clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of `repeat` calls, after `warmup` untimed ones (first-use costs are not the figure)."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    case = _case(fn)
    for _ in range(warmup):
        _timed(case, sync, clock)
    return [_timed(case, sync, clock) for _ in range(repeat)]


def best_of(fn: Case | Callable[[], Any], repeat: int, *, setup: Callable[[], Any] | None = None, warmup: int = 0,
            sync: Callable[[], Any] | None = None, clock: Clock = time.perf_counter) -> float:
    """The fastest of `repeat` timed calls of `fn`: the run least disturbed by anything else on the machine."""
    case = _case(fn)
    if setup is not None:
        case = dataclasses.replace(case, setup=setup)
    return min(timings(case, repeat, warmup=warmup, sync=sync, clock=clock))


def interleaved(cases: Mapping[str, Case | Callable[[], Any]], repeat: int, *, rotate: bool = True,
                sync: Callable[[], Any] | None = None, clock: Clock = time.perf_counter) -> dict[str, list[float]]:
    """Every case's seconds per round, the cases run in turn within each round.

    With `rotate`, each round starts one case later, so none always runs right after
    the same other one (which warms or cools the caches it uses): a fixed order put
    the same copy 15-20% apart depending on its place.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    names = list(cases)
    runs = {name: _case(cases[name]) for name in names}
    out: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        for j in range(len(names)):
            name = names[(round_ + j) % len(names)] if rotate else names[j]
            out[name].append(_timed(runs[name], sync, clock))
    return out


def best_interleaved(cases: Mapping[str, Case | Callable[[], Any]], repeat: int, *, rotate: bool = True,
                     sync: Callable[[], Any] | None = None, clock: Clock = time.perf_counter) -> dict[str, float]:
    """Each case's best round of `interleaved`."""
    return {name: min(ts) for name, ts in interleaved(cases, repeat, rotate=rotate, sync=sync, clock=clock).items()}


def ratio(reference_s: float, seconds: float) -> float:
    """How a measured time compares with its same-run reference: above 1 is faster than the reference."""
    return reference_s / seconds


def versus(seconds: float, ref_seconds: float, nbytes: int, ref: str, goal: float) -> dict:
    """A throughput next to its same-run reference on the same bytes, and whether it meets `goal` (a ratio)."""
    r = ratio(ref_seconds, seconds)
    return {"gbps": round(nbytes / seconds / 1e9, 3), "ref": ref, "ref_gbps": round(nbytes / ref_seconds / 1e9, 3),
            "ratio": round(r, 3), "goal": goal, "meets_goal": r >= goal}


class JsonOutput:
    """A benchmark's `--json` mode: from construction on, only `emit` writes to the real stdout.

    Built with `enabled=False` it changes nothing and `emit` refuses, so a benchmark
    builds one right after parsing its flags either way.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._out = None
        if enabled:
            self._out = os.fdopen(os.dup(1), "w")  # os.dup: not inherited by child processes
            os.dup2(2, 1)
            sys.stdout.flush()  # what Python buffered before this point is not the report either

    def emit(self, report: Any, indent: int | None = None) -> None:
        """Write `report` as one JSON document (and a newline) to the real stdout."""
        if self._out is None:
            raise RuntimeError("JsonOutput.emit without --json: print the table instead")
        self._out.write(json.dumps(report, indent=indent) + "\n")
        self._out.flush()
