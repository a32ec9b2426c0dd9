"""The tuning/validation split (kvcluster/traces/split.py) and the benchmarks that quote figures on it: the split
is by session, disjoint, complete and fixed, and what hit_rate.py, gap_headroom.py and hit_rate_unseen.py report by
default is read from validation-part sessions only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hit_rate  # noqa: E402
import hit_rate_unseen  # noqa: E402
from data_support import require_data, require_tokenizer  # noqa: E402

from kvcluster.block_types import BlockType, TransitionType  # noqa: E402
from kvcluster.errors import TraceError  # noqa: E402
from kvcluster.paths import shared_data_dir  # noqa: E402
from kvcluster.traces import Trace, TraceRequest  # noqa: E402
from kvcluster.traces.split import part, parts_of, session_part, sessions_in  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _trace(sessions: list[str], format: str = "sharegpt") -> Trace:
    requests = tuple(TraceRequest(float(i), s, (), (), TransitionType.FIRST, 16, 0) for i, s in enumerate(sessions))
    return Trace("t", format, 16, requests)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), max_size=40))
def test_the_parts_split_a_trace_by_session_disjoint_complete_and_in_order(sessions: list[str]) -> None:
    trace = _trace(sessions)
    tune, validation = part(trace, "tune"), part(trace, "validation")
    assert {r.session for r in tune.requests}.isdisjoint(r.session for r in validation.requests)
    assert sorted(tune.requests + validation.requests, key=lambda r: r.arrival_s) == list(trace.requests)
    assert part(trace, "all") == trace
    for r in validation.requests:
        assert session_part(r.session) == "validation"


def test_a_sessions_part_is_fixed_by_its_id_alone() -> None:
    # pinned: a change of hash, salt or bucket count re-cuts every trace, and every quoted figure with it
    assert [session_part(s) for s in ("QWJhYvA", "i6IyJda", "A5AbcES", "hRPPgZT", "s1", "s2")] == [
        "tune", "tune", "tune", "validation", "tune", "validation"]
    script = "from kvcluster.traces.split import session_part; print(session_part('hRPPgZT'), session_part('s1'))"
    for seed in ("1", "2"):  # not Python's hash(): the same in every process
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.split()
        assert out == ["validation", "tune"]


def test_a_claude_code_sub_agent_goes_with_its_parent_session() -> None:
    parents = [f"trace_{i:04d}" for i in range(40)]
    trace = _trace([s for p in parents for s in (p, f"{p}/agent-a", f"{p}/subagent3")], "claude-code")
    for which in ("tune", "validation"):
        got = part(trace, which)
        assert {r.session.split("/")[0] for r in got.requests} == {p for p in parents if session_part(p) == which}
    assert sessions_in(trace) == set(parents)
    swe = _trace(["demo/a/x.traj", "demo/a/y.traj"], "swe-agent")  # another format's '/' is part of the id
    assert parts_of(sessions_in(swe), "swe-agent") == parts_of(["demo/a/x.traj", "demo/a/y.traj"])


def test_a_trace_without_sessions_or_an_unknown_part_is_refused_naming_the_field() -> None:
    with pytest.raises(TraceError, match="--part: unknown part 'train'"):
        part(_trace(["a"]), "train", "--part")
    with pytest.raises(TraceError, match="without a session"):
        part(_trace(["a", ""]), "validation")


def test_hit_rate_quotes_the_validation_part_of_the_whole_sharegpt_file() -> None:
    assert hit_rate.PARTS[0] == hit_rate.REPORTED_PART == "validation"
    sharegpt = {label: kwargs for label, _, kwargs in hit_rate.traces()}["sharegpt"]
    assert sharegpt.get("max_records") is None  # the whole file, not the lines the old defaults were tuned on


@pytest.mark.parametrize("label", hit_rate.TRACES)
def test_the_reported_part_of_every_shared_trace_holds_validation_sessions_only(label: str) -> None:
    require_tokenizer()
    path, kwargs = {lb: (p, kw) for lb, p, kw in hit_rate.traces()}[label]
    require_data(Path(path).relative_to(shared_data_dir()).as_posix())
    [(which, trace)] = hit_rate.load_parts(path, (hit_rate.REPORTED_PART,), smoke=True, **kwargs)
    assert which == "validation" and trace.requests
    assert {session_part(s, trace.format) for s in sessions_in(trace)} == {"validation"}


def test_hit_rate_labels_every_row_with_its_part_the_validation_first() -> None:
    require_tokenizer()
    require_data("swe_agent_trajectories")
    run = subprocess.run([sys.executable, str(BENCHMARKS / "hit_rate.py"), "--smoke", "--json", "--traces",
                          "swe-agent", "--policies", "lru,belady"], capture_output=True, text=True, check=True)
    rows = json.loads(run.stdout)
    assert [r["part"] for r in rows[::len(hit_rate.FRACTIONS)]] == ["validation", "tune", "all"]


def test_gap_headroom_measures_the_validation_part_by_default() -> None:
    import gap_headroom

    parser_defaults = subprocess.run([sys.executable, str(BENCHMARKS / "gap_headroom.py"), "--help"],
                                     capture_output=True, text=True, check=True).stdout
    assert "default validation" in " ".join(parser_defaults.split())
    assert gap_headroom.REPORTED_PART == "validation"


def test_hit_rate_unseen_reads_validation_sessions_only(tmp_path) -> None:
    ids = [f"c{i}_0" for i in range(hit_rate_unseen.TUNED_SHAREGPT_ENTRIES)] + [f"r{i}_{k}" for i in range(60)
                                                                                for k in range(2)]
    source = tmp_path / "sharegpt.jsonl"
    source.write_text("".join(json.dumps({"id": i, "conversations": []}) + "\n" for i in ids))
    kept = [json.loads(line)["id"] for line in hit_rate_unseen.unseen_sharegpt(source, tmp_path / "u.jsonl")
            .read_text().splitlines()]
    assert kept and {session_part(i.rsplit("_", 1)[0]) for i in kept} == {"validation"}
    assert kept == [i for i in ids[hit_rate_unseen.TUNED_SHAREGPT_ENTRIES:] if session_part(i.rsplit("_", 1)[0])
                    == "validation"]
    cc = tmp_path / "cc"
    cc.mkdir()
    for i in range(30):
        (cc / f"trace_{i:04d}.json").write_text("{}")
    halves = [{p.stem for p in hit_rate_unseen.claude_code_half(cc, tmp_path / f"h{k}", k).iterdir()}
              for k in (0, 1)]
    assert halves[0] and halves[1] and halves[0].isdisjoint(halves[1])
    assert halves[0] | halves[1] == {f"trace_{i:04d}" for i in range(30) if session_part(f"trace_{i:04d}",
                                                                                          "claude-code") == "validation"}


def test_block_types_are_not_needed_to_split() -> None:
    trace = Trace("t", "mooncake", 512, (TraceRequest(0.0, "s1", (b"k",), (BlockType.HISTORY,),
                                                     TransitionType.FIRST, 512, 1),))
    assert part(trace, "tune").requests == trace.requests  # s1 is in the tuning part (pinned above)
