"""Traces without times (ShareGPT, LMSYS, SWE-agent) are timed by a seeded random clock by default: Poisson
conversation starts and log-normal think times fitted to the Claude Code traces; the old fixed clock only behind
--fixed-clock (docs/traces.md)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from kvcluster import cli
from kvcluster.traces import UNTIMED_FORMATS, TraceClock, load_trace
from kvcluster.traces.text import (SESSION_GAP_S, THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA, TURN_GAP_S)

from data_support import require_data, require_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
import hit_rate  # noqa: E402
import think_time_fit  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
SHAREGPT = str(FIXTURES / "sharegpt.jsonl")  # 5 lines, 4 conversations (kv1 in two parts), 11 gpt turns
LMSYS = str(FIXTURES / "lmsys.jsonl")
needs_tokenizer = pytest.mark.usefixtures("offline_tokenizer")
Z90 = 1.2815516  # the standard normal's 90% quantile


@pytest.fixture(scope="module")
def offline_tokenizer() -> Path:
    return require_tokenizer()


def arrivals(path: str, clock: TraceClock | None = None) -> list[tuple[str, float]]:
    return [(r.session, r.arrival_s) for r in load_trace(path, block_size=4, clock=clock).requests]


def turn_gaps(timed: list[tuple[str, float]]) -> list[float]:
    last: dict[str, float] = {}
    gaps = []
    for session, at in timed:
        if session in last:
            gaps.append(at - last[session])
        last[session] = at
    return gaps


# ---------------------------------------------------------------- the clock itself


def test_the_default_clock_is_random_and_seeded() -> None:
    assert TraceClock() == TraceClock(fixed=False, seed=0)
    shape = [3, 1, 4, 1, 5, 9, 2, 6]
    once = TraceClock().times(shape)
    assert once == TraceClock(seed=0).times(shape)  # same seed: the same times, to the bit
    assert TraceClock(seed=1).times(shape) != once
    assert [len(t) for t in once] == shape and once[0][0] == 0.0  # the first conversation opens the trace
    starts = [t[0] for t in once]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    gaps = [b - a for t in once for a, b in zip(t, t[1:])]
    assert all(g > 0 for g in gaps) and len({round(g, 9) for g in gaps}) == len(gaps)  # no fixed step


def test_the_fixed_clock_is_the_old_one() -> None:
    assert TraceClock(fixed=True).times([2, 0, 3]) == [[0.0, TURN_GAP_S], [], [2 * SESSION_GAP_S,
                                                                              2 * SESSION_GAP_S + TURN_GAP_S,
                                                                              2 * SESSION_GAP_S + 2 * TURN_GAP_S]]


def test_think_times_follow_the_fitted_log_normal() -> None:
    """20,000 draws (seed 0, so the figures are the same every run): the log gaps' median and 10/90% quantiles
    lie within 0.05 of the fit's MU and MU -/+ 1.28 SIGMA. Their sampling error is about 0.011 and 0.015, so any
    seed would pass; a think time off by 5% (0.049 in log) or a sigma off by 4% would not."""
    (one,) = TraceClock(seed=0).times([20_001])
    logs = sorted(math.log(b - a) for a, b in zip(one, one[1:]))
    q = statistics.quantiles(logs, n=10)
    assert statistics.median(logs) == pytest.approx(THINK_TIME_LOG_MU, abs=0.05)
    assert q[0] == pytest.approx(THINK_TIME_LOG_MU - Z90 * THINK_TIME_LOG_SIGMA, abs=0.05)
    assert q[-1] == pytest.approx(THINK_TIME_LOG_MU + Z90 * THINK_TIME_LOG_SIGMA, abs=0.05)
    assert math.exp(THINK_TIME_LOG_MU) == pytest.approx(24.15, abs=0.01)  # the median think time, in s


def test_conversations_start_as_a_poisson_process() -> None:
    """Exponential gaps of mean SESSION_GAP_S: over 20,000 the mean within 3% (sampling error 0.7%), and the
    share of gaps under the mean within 0.02 of 1 - 1/e (error 0.003)."""
    starts = [t[0] for t in TraceClock(seed=0).times([1] * 20_001)]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert statistics.fmean(gaps) == pytest.approx(SESSION_GAP_S, rel=0.03)
    assert sum(g < SESSION_GAP_S for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.02)


def test_the_constants_are_the_fit_to_the_claude_code_traces() -> None:
    """scripts/think_time_fit.py on the shared Claude Code sessions gives exactly the constants text.py holds."""
    files = sorted(f for folder in think_time_fit.FOLDERS for f in require_data(folder).glob("*.json"))
    gaps = [g for per_stop in think_time_fit.session_gaps(files).values() for g in per_stop]
    fitted = think_time_fit.fit(gaps)
    assert (len(files), fitted["gaps"]) == (144, 7450)
    assert (fitted["mu"], fitted["sigma"]) == (THINK_TIME_LOG_MU, THINK_TIME_LOG_SIGMA)


# ---------------------------------------------------------------- the loaders


@needs_tokenizer
def test_text_traces_load_with_random_seeded_times_by_default() -> None:
    assert set(UNTIMED_FORMATS) == {"sharegpt", "lmsys", "swe-agent"}
    default = arrivals(SHAREGPT)
    assert default == arrivals(SHAREGPT, TraceClock(seed=0)) == arrivals(SHAREGPT)  # same seed, identical trace
    assert arrivals(SHAREGPT, TraceClock(seed=1)) != default
    assert sorted(s for s, _ in default) == sorted(s for s, _ in arrivals(SHAREGPT, TraceClock(seed=1)))
    fixed = arrivals(SHAREGPT, TraceClock(fixed=True))
    assert [t for _, t in fixed] == [0.0, 5.0, 10.0, 15.0, 30.0, 35.0, 40.0, 45.0, 60.0, 70.0, 90.0]
    assert set(turn_gaps(fixed)) == {TURN_GAP_S}
    gaps = turn_gaps(default)
    assert len(gaps) == 7 and TURN_GAP_S not in gaps and len(set(gaps)) == 7
    assert [t for _, t in default] == sorted(t for _, t in default)
    lmsys = arrivals(LMSYS)
    assert lmsys == arrivals(LMSYS) != arrivals(LMSYS, TraceClock(fixed=True))


@needs_tokenizer
def test_swe_agent_steps_are_timed_by_the_clock_too() -> None:
    path = str(require_data("swe_agent_trajectories", "test_data"))
    default = [(r.session, r.arrival_s) for r in load_trace(path).requests]
    fixed = [(r.session, r.arrival_s) for r in load_trace(path, clock=TraceClock(fixed=True)).requests]
    assert set(turn_gaps(fixed)) == {TURN_GAP_S} and TURN_GAP_S not in turn_gaps(default)
    assert default == [(r.session, r.arrival_s) for r in load_trace(path).requests]


def test_traces_with_their_own_times_ignore_the_clock() -> None:
    path = str(FIXTURES / "bailian.jsonl")
    own = load_trace(path)
    assert own == load_trace(path, clock=TraceClock(fixed=True)) == load_trace(path, clock=TraceClock(seed=5))


# ---------------------------------------------------------------- the command line and the benchmarks


def test_replay_help_names_the_fixed_clock_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fixed-clock time traces without times" in text and "turns 30 s apart" in text
    assert "--clock-seed N seed of the random clock" in text


@needs_tokenizer
@pytest.mark.parametrize("flags, clock", [([], TraceClock()), (["--clock-seed", "3"], TraceClock(seed=3)),
                                          (["--fixed-clock"], TraceClock(fixed=True))])
def test_replay_of_a_sharegpt_file_uses_random_think_times_unless_told(monkeypatch, capsys, flags, clock) -> None:
    import kvcluster.simulator as simulator

    seen = []
    real = simulator.prepare

    def spy(trace):
        seen.append([(r.session, r.arrival_s) for r in trace.requests])
        return real(trace)

    monkeypatch.setattr(simulator, "prepare", spy)
    code = cli.main(["replay", SHAREGPT, "--block-size", "4", "--policy", "bayes", "--capacity-frac", "0.5", "--json",
                     *flags])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and seen == [arrivals(SHAREGPT, clock)]
    assert report["clock"] == clock.describe()
    assert report["clock"].startswith("fixed" if clock.fixed else f"random (seed {clock.seed})")


def test_the_benchmarks_take_the_same_flags() -> None:
    parser = argparse.ArgumentParser()
    hit_rate.add_clock_options(parser)
    assert hit_rate.clock_from(parser.parse_args([])) == TraceClock()
    assert hit_rate.clock_from(parser.parse_args(["--fixed-clock", "--clock-seed", "2"])) == TraceClock(True, 2)
    clock = TraceClock(fixed=True)
    kwargs = {label: kw for label, _, kw in hit_rate.traces(10, clock)}
    assert kwargs["sharegpt"] == {"max_records": 10, "clock": clock} and kwargs["swe-agent"] == {"clock": clock}
    assert "clock" not in {k for label, _, kw in hit_rate.traces(10) for k in kw}  # the loaders' default
