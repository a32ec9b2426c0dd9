"""benchmarks/hit_rate_unseen.py: what it scores is data no default was tuned on, and random gaps keep each
conversation's order; it and benchmarks/hit_rate.py answer missing data with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hit_rate_unseen import (  # noqa: E402
    TUNED_SHAREGPT_ENTRIES,
    as_mooncake,
    claude_code_half,
    unseen_sharegpt,
    with_random_gaps,
)

from kvcluster.block_types import BlockType  # noqa: E402
from kvcluster.errors import TraceError  # noqa: E402
from kvcluster.simulator import PreparedTrace, prepare  # noqa: E402
from kvcluster.traces import load_trace  # noqa: E402
from kvcluster.traces.split import session_part  # noqa: E402


def test_unseen_sharegpt_starts_at_the_first_conversation_wholly_after_the_tuned_entries(tmp_path) -> None:
    later = ["y_0", "z_0", "z_1", "w_0", "v_0", "v_1"]  # z and v are in the validation part, y and w are not
    assert [session_part(r) for r in "yzwv"] == ["tune", "validation", "tune", "validation"]
    ids = [f"c{i}_0" for i in range(TUNED_SHAREGPT_ENTRIES - 1)] + ["x_0", "x_1", "x_2"] + later
    source = tmp_path / "sharegpt.jsonl"
    source.write_text("".join(json.dumps({"id": i, "conversations": []}) + "\n" for i in ids))
    out = unseen_sharegpt(source, tmp_path / "unseen.jsonl")
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["z_0", "z_1", "v_0", "v_1"]


def test_random_gaps_keep_each_conversation_in_order_and_its_blocks_as_they_were() -> None:
    requests = [(5.0 * k + 30.0 * t, f"s{k}", tuple(range(100 * k, 100 * k + t + 1))) for k in range(20)
                for t in range(1 + k % 4)]
    requests.sort(key=lambda r: r[0])
    trace = PreparedTrace(name="t", block_size=16, blocks=tuple(b for _, _, b in requests),
                          types=tuple((2,) * len(b) for _, _, b in requests), transitions=(1,) * len(requests),
                          arrivals=tuple(t for t, _, _ in requests), input_tokens=(16,) * len(requests),
                          sessions=tuple(s for _, s, _ in requests), unique_blocks=100)
    timed = with_random_gaps(trace, seed=3)
    assert list(timed.arrivals) == sorted(timed.arrivals) and timed.arrivals != trace.arrivals
    assert sorted(zip(timed.sessions, timed.blocks)) == sorted(zip(trace.sessions, trace.blocks))
    for session in set(trace.sessions):
        mine = [b for s, b in zip(timed.sessions, timed.blocks) if s == session]
        assert mine == sorted(mine, key=len)  # each turn extends the one before, in the order they came
    assert with_random_gaps(trace, seed=3) == timed  # seeded: the same times every run


def test_as_mooncake_keeps_the_full_512_token_blocks_and_what_a_mooncake_trace_carries(tmp_path) -> None:
    # 64-token blocks, prefix-chained ids: request 1 continues request 0, request 2 shares its first 8 blocks only
    first = tuple(range(20))
    trace = PreparedTrace(name="t", block_size=64, blocks=(first, first + (20, 21, 22, 23), first[:8] + (30, 31)),
                          types=((1,) * 20, (1,) * 24, (1,) * 10), transitions=(0, 1, 2), arrivals=(0.0, 1.5, 2.0),
                          input_tokens=(1300, 1540, 650), sessions=("a", "a", "b"), unique_blocks=26,
                          output_tokens=(7, 8, 9))
    path = as_mooncake(trace, tmp_path / "t.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"timestamp": 0, "input_length": 1300, "output_length": 7, "hash_ids": [7, 15]},
                    {"timestamp": 1500, "input_length": 1540, "output_length": 8, "hash_ids": [7, 15, 23]},
                    {"timestamp": 2000, "input_length": 650, "output_length": 9, "hash_ids": [7]}]
    reread = prepare(load_trace(str(path)))
    assert [len(b) for b in reread.blocks] == [2, 3, 1] and reread.unique_blocks == 3
    assert reread.blocks[1][:2] == reread.blocks[0] and reread.blocks[2] == reread.blocks[0][:1]
    assert reread.sessions[0] == reread.sessions[1] != reread.sessions[2]  # inferred from the hash ids alone
    with pytest.raises(TraceError, match="48-token blocks do not tile"):
        as_mooncake(dataclasses.replace(trace, block_size=48), tmp_path / "untiled.jsonl")
    with pytest.raises(TraceError, match="system_prompt_blocks must be >= 0"):
        as_mooncake(trace, tmp_path / "negative.jsonl", system_prompt_blocks=-1)
    prompted = as_mooncake(trace, tmp_path / "system.jsonl", system_prompt_blocks=2)
    rows = [json.loads(line) for line in prompted.read_text().splitlines()]
    assert [(r["input_length"], r["hash_ids"]) for r in rows] == [(2324, [32, 33, 7, 15]), (2564, [32, 33, 7, 15, 23]),
                                                                  (1674, [32, 33, 7])]
    reread = prepare(load_trace(str(prompted)))
    assert reread.sessions[0] == reread.sessions[1] != reread.sessions[2]
    assert reread.types[2][:2] == (int(BlockType.SYSTEM),) * 2  # the prompt, seen in another session


def test_claude_code_halves_split_the_validation_sessions_by_name(tmp_path) -> None:
    source = tmp_path / "traces"
    source.mkdir()
    names = [f"trace_{i:04d}" for i in range(12)]
    for name in reversed(names):
        (source / f"{name}.json").write_text("{}")
    validation = [n for n in names if session_part(n, "claude-code") == "validation"]
    assert sorted(p.stem for p in claude_code_half(source, tmp_path / "even", 0).iterdir()) == validation[0::2]
    assert sorted(p.stem for p in claude_code_half(source, tmp_path / "odd", 1).iterdir()) == validation[1::2]


@pytest.mark.parametrize("script, first_trace", [("hit_rate_unseen", "sharegpt_v3/sharegpt_v3_subset.jsonl"),
                                                  ("hit_rate", "mooncake/synthetic_trace.jsonl"),
                                                  ("control_memory", "mooncake/synthetic_trace.jsonl"),
                                                  ("serving_commits", "mooncake/synthetic_trace.jsonl")])
def test_missing_data_is_a_clear_error_not_a_traceback(tmp_path, script, first_trace) -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    run = subprocess.run([sys.executable, str(path), "--json"], capture_output=True, text=True,
                         env={**os.environ, "KVCLUSTER_DATA": str(tmp_path)})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == f"{script}: trace not found: {tmp_path}/{first_trace}"
