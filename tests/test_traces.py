"""Trace loaders on the shared files and on small fixtures; malformed records; classification rules."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from kvcluster.block_types import BlockType, TransitionType
from kvcluster.errors import ConfigError, TraceError
from kvcluster.keys import KeySpace
from kvcluster.traces import TRACE_FORMATS, detect_format, load_trace
from kvcluster.traces.base import Trace
from kvcluster.traces.classify import SHARED_BRANCHES, PrefixClassifier, majority_block_types
from kvcluster.traces.sharegpt import root_id

from data_support import require_data, require_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
needs_tokenizer = pytest.mark.usefixtures("offline_tokenizer")  # missing: fails under CI, skips elsewhere
S, H, T, O = BlockType.SYSTEM, BlockType.HISTORY, BlockType.TOOL, BlockType.OUTPUT
FIRST, APPEND, FORK, STEP = TransitionType.FIRST, TransitionType.APPEND, TransitionType.FORK, TransitionType.AGENT_STEP


@pytest.fixture(scope="module")
def offline_tokenizer() -> Path:
    return require_tokenizer()


def infinite_hits(trace: Trace) -> int:
    """Requests in order: leading keys already seen (an infinite prefix cache's hits)."""
    seen: set = set()
    hits = 0
    for r in trace.requests:
        for k in r.block_keys:
            if k not in seen:
                break
            hits += 1
        seen.update(r.block_keys)
    return hits


def by_session(trace: Trace) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in trace.requests:
        out.setdefault(r.session, []).append(r)
    return out


# ---------------------------------------------------------------- shared data


def test_mooncake_counts_keys_and_order() -> None:
    path = require_data("mooncake", "synthetic_trace.jsonl")
    started = time.perf_counter()
    trace = load_trace(str(path))
    elapsed = time.perf_counter() - started
    assert trace.format == "mooncake" and trace.block_size == 512 and not trace.skipped
    assert (len(trace.requests), trace.block_refs, trace.unique_blocks) == (3993, 121_877, 43_924)
    assert infinite_hits(trace) == 121_877 - 43_924  # every reference after a block's first: the published 64.0%
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    space = KeySpace(model="trace:mooncake")
    for line, r in zip(lines[:50], trace.requests):  # one request per line, in file order, one key per hash id
        assert r.block_keys == tuple(space.chain_hash_ids(line["hash_ids"]))
        assert (r.arrival_s, r.input_tokens, r.output_tokens) == (line["timestamp"] / 1000, line["input_length"],
                                                                  line["output_length"])
    assert [r.input_tokens for r in trace.requests] == [line["input_length"] for line in lines]
    assert {r.transition for r in trace.requests} == {FIRST, APPEND, FORK}
    assert all(len(r.block_types) == len(r.block_keys) for r in trace.requests)
    assert elapsed < 5.0  # ~0.35 s here


def test_claude_code_directory_merges_44_sessions() -> None:
    folder = require_data("weka_claude_code_traces")
    started = time.perf_counter()
    trace = load_trace(str(folder))
    elapsed = time.perf_counter() - started
    files = sorted(folder.glob("*.json"))
    assert len(files) == 44 and trace.format == "claude-code" and trace.block_size == 64 and not trace.skipped
    sessions = by_session(trace)
    assert {f.stem for f in files} <= set(sessions) and len([s for s in sessions if "/" not in s]) == 44
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    for k, f in enumerate(files):
        assert sessions[f.stem][0].arrival_s == pytest.approx(k * 60.0)
    firsts = [sessions[f.stem][0] for f in files]
    assert len({r.block_keys[0] for r in firsts}) == 1  # one shared tools+system prefix
    assert firsts[0].transition is FIRST and {r.transition for r in firsts[1:]} == {FORK}
    doc = json.loads(files[0].read_text())
    n = (doc["tool_tokens"] + doc["system_tokens"]) // 64
    assert firsts[0].block_types[:n] == (S,) * n and firsts[0].block_types[n] is not S
    assert {r.transition for r in trace.requests} == {FIRST, APPEND, FORK, STEP}
    assert {t for r in trace.requests for t in r.block_types} == {S, H, T, O}
    assert trace.block_refs == 5_547_205 and infinite_hits(trace) == 5_333_836  # 96.2%: sessions re-send their past
    assert elapsed < 10.0  # ~1.7 s here


def test_claude_code_single_file() -> None:
    path = require_data("weka_claude_code_traces", "trace_0017.json")
    trace = load_trace(str(path))
    assert trace.format == "claude-code" and trace.name == "trace_0017"
    sub = [r for r in trace.requests if r.session.startswith("trace_0017/")]
    assert len(sub) == 11 and sub[1].transition is STEP and sub[1].stop == "tool_use"
    steps = [r for r in trace.requests if r.session == "trace_0017"][1:]
    assert (sum(r.transition is STEP for r in steps), len(steps)) == (243, 253)  # agent steps: all but 10


@needs_tokenizer
def test_sharegpt_turns_extend_each_other() -> None:
    path = require_data("sharegpt_v3", "sharegpt_v3_subset.jsonl")
    trace = load_trace(str(path), max_records=30)
    assert trace.format == "sharegpt" and trace.block_size == 16 and trace.requests
    with open(path) as f:
        roots = {root_id(json.loads(next(f))["id"]) for _ in range(30)}
    sessions = by_session(trace)
    assert set(sessions) <= roots and len(sessions) >= len(roots) - 3  # parts joined per root
    for turns in sessions.values():
        assert turns[0].transition in (FIRST, FORK) and all(t.transition is APPEND for t in turns[1:])
        for a, b in zip(turns, turns[1:]):
            assert b.block_keys[: len(a.block_keys)] == a.block_keys
            assert b.input_tokens >= a.input_tokens + a.output_tokens
    assert {t for r in trace.requests for t in r.block_types} >= {H, O}


@needs_tokenizer
def test_swe_agent_steps_and_roles() -> None:
    trace = load_trace(str(require_data("swe_agent_trajectories", "test_data")))
    assert trace.format == "swe-agent" and not trace.skipped
    sessions = by_session(trace)
    assert len(sessions) == 3
    for turns in sessions.values():
        assert turns[0].transition in (FIRST, FORK) and {t.transition for t in turns[1:]} == {STEP}
        assert turns[0].block_types[0] is S
    assert {t for r in trace.requests for t in r.block_types} == {S, H, T, O}
    assert (infinite_hits(trace), trace.block_refs) == (12_711, 14_706)  # every step re-sends the whole history
    one = load_trace(str(next(require_data("swe_agent_trajectories", "demo").rglob("*.traj"))))
    assert one.format == "swe-agent" and one.requests


def test_azure_is_arrivals_and_lengths_only() -> None:
    path = require_data("azure_llm_inference_2023", "AzureLLMInferenceTrace_code.csv")
    trace = load_trace(str(path))
    assert trace.format == "azure" and trace.block_size == 16 and len(trace.requests) == 8819
    assert infinite_hits(trace) == 0 and trace.unique_blocks == trace.block_refs
    assert all(len(r.block_keys) == math.ceil(r.input_tokens / 16) for r in trace.requests)
    assert trace.requests[0].arrival_s == 0.0 and trace.requests[-1].arrival_s == pytest.approx(3435.6, abs=1)


def test_auto_detection_of_the_shared_files() -> None:
    cases = {
        "mooncake/synthetic_trace.jsonl": "mooncake",
        "weka_claude_code_traces": "claude-code",
        "weka_claude_code_traces/trace_0001.json": "claude-code",
        "sharegpt_v3/sharegpt_v3_subset.jsonl": "sharegpt",
        "swe_agent_trajectories": "swe-agent",
        "azure_llm_inference_2023/AzureLLMInferenceTrace_conv.csv": "azure",
    }
    for rel, fmt in cases.items():
        assert detect_format(str(require_data(rel))) == fmt, rel


# ---------------------------------------------------------------- fixtures


def test_bailian_fixture_sessions_transitions_and_bad_lines() -> None:
    path = FIXTURES / "bailian.jsonl"
    trace = load_trace(str(path))
    assert trace.format == "bailian" and trace.block_size == 16 and len(trace.requests) == 7
    assert trace.skipped == (f"{path}:4: not JSON (Expecting value)",
                             f"{path}:6: needs chat_id, timestamp >= 0 (s), input_length/output_length >= 0 "
                             "and hash_ids: [int]")
    at = {r.arrival_s: r for r in trace.requests}
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.0, 3.0, 3.5, 5.0, 6.0]  # sorted by time
    assert {at[t].session for t in (0.0, 2.0, 3.0, 3.5)} == {"1"} and at[1.0].session == "2"
    assert at[5.0].session == at[6.0].session == "99"  # parent outside the file: siblings share it
    assert [at[t].transition for t in (0.0, 1.0, 2.0, 3.0, 3.5, 5.0, 6.0)] == [FIRST, FORK, APPEND, APPEND, APPEND,
                                                                               FIRST, FORK]
    assert at[1.0].block_types == (S, H)  # hash 1 was chat 1's: another session
    assert at[2.0].block_types[0] is S and at[3.0].block_types == (S, H, H, H, O, H)  # tokens 64-80: chat 3's answer
    with pytest.raises(TraceError, match="bailian.jsonl:4: not JSON"):
        load_trace(str(path), strict=True)


@needs_tokenizer
def test_lmsys_fixture() -> None:
    path = FIXTURES / "lmsys.jsonl"
    trace = load_trace(str(path), block_size=4)
    assert trace.format == "lmsys" and trace.block_size == 4
    assert trace.skipped == (f"{path}:3: needs conversation_id and conversation: [{{role: str, content: str}}]",)
    sessions = by_session(trace)
    assert [r.transition for r in sessions["c1"]] == [FIRST, APPEND]
    first, second = sessions["c1"]
    assert second.block_keys[: len(first.block_keys)] == first.block_keys and O in second.block_types
    assert second.output_tokens > 0 and second.input_tokens > first.input_tokens + first.output_tokens
    c4, c5 = sessions["c4"][0], sessions["c5"][0]
    assert c4.transition is FIRST and c5.transition is FORK  # same system prompt
    shared = next(i for i, (a, b) in enumerate(zip(c4.block_keys, c5.block_keys)) if a != b)
    assert shared == 9 and c5.block_types[:4] == (S,) * 4  # the same system turn: its first 9 whole 4-token blocks


@needs_tokenizer
def test_sharegpt_json_array_and_joined_parts(tmp_path: Path) -> None:
    entries = [{"id": "abc_0", "conversations": [{"from": "human", "value": "Tell me about prefix caching in detail."},
                                                 {"from": "gpt", "value": "It keeps the KV of shared prefixes."}]},
               {"id": "abc_1", "conversations": [{"from": "human", "value": 3}]},
               {"id": "abc_2", "conversations": [{"from": "gpt", "value": "And it evicts by recency, mostly."},
                                                 {"from": "human", "value": "Which policy is best?"},
                                                 {"from": "gpt", "value": "It depends on the reuse pattern."}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    trace = load_trace(str(path), block_size=4)
    assert trace.format == "sharegpt" and trace.skipped[0].startswith(f"{path}:record 1: needs id")
    turns = by_session(trace)["abc"]  # parts 0 and 2 joined; the gpt-first part answers part 0
    assert [t.transition for t in turns] == [FIRST, APPEND, APPEND]
    assert turns[2].block_keys[: len(turns[1].block_keys)] == turns[1].block_keys


def test_claude_code_shared_prefix_replaces_leading_local_ids(tmp_path: Path) -> None:
    def request(t, ids, n_in, stop="tool_use", out=64):
        return {"t": t, "type": "n", "model": "m", "in": n_in, "out": out, "hash_ids": ids, "stop": stop}

    a = {"id": "a", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 128, "system_tokens": 100,
         "requests": [request(0.0, [1, 2, 3, 4, 5], 330), request(5.0, [1, 2, 3, 4, 5, 6, 7], 451, "end_turn", 10),
                      request(9.0, [1, 2, 9, 10], 260, ""),
                      {"t": 10.0, "type": "subagent", "agent_id": "x1", "subagent_type": "Explore", "tool_tokens": 64,
                       "system_tokens": 64, "requests": [request(0.0, [50, 51, 52], 200)]},
                      {"t": 12.0, "type": "n", "hash_ids": "broken"}]}
    b = {"id": "b", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 128, "system_tokens": 100,
         "requests": [request(0.0, [1, 2, 3, 4], 260)]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    trace = load_trace(str(tmp_path))
    assert trace.skipped == (f"{tmp_path / 'a.json'}:record 4: needs hash_ids: [int] and token counts in/out >= 0",)
    s = by_session(trace)
    a0, a1, a2 = s["a"]
    (b0,) = s["b"]
    assert b0.arrival_s == 60.0 and s["a/x1"][0].arrival_s == 10.0
    assert a0.block_keys[:3] == b0.block_keys[:3]  # floor(228 / 64) = 3 shared blocks ...
    assert a0.block_keys[3] != b0.block_keys[3]  # ... not the 4th (it holds session tokens); equal local ids
    assert a2.block_keys[:2] == b0.block_keys[:2] and a2.block_keys[2] != b0.block_keys[2]  # diverged at 2
    assert b0.transition is FORK and b0.block_types == (S, S, S, H)
    assert a1.transition is STEP and a1.stop == "tool_use"
    assert a1.block_types == (S, S, S, H, H, O, T)  # tokens 330-394 are a0's answer, then the tool result
    assert a2.transition is FORK and a2.stop == "end_turn"
    assert (a0.finish, a1.finish, a2.finish, b0.finish) == ("tool_use", "end_turn", "", "tool_use")  # their own
    sub = s["a/x1"][0]
    assert sub.transition is FIRST and sub.block_types[:2] == (S, S) and sub.block_keys[0] != a0.block_keys[0]
    with pytest.raises(TraceError, match="a.json:record 4"):
        load_trace(str(tmp_path), strict=True)


# ---------------------------------------------------------------- malformed records, formats, errors


def test_malformed_jsonl_lines_are_reported_with_their_line(tmp_path: Path) -> None:
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    lines = [json.dumps(good), "", "{broken", "[1, 2]", json.dumps({**good, "timestamp": -5}),
             json.dumps({**good, "hash_ids": [1, True]}), json.dumps({**good, "timestamp": 2000})]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = load_trace(str(path), format="mooncake")
    assert len(trace.requests) == 2
    assert [s.split(": ")[0] for s in trace.skipped] == [f"{path}:{n}" for n in (3, 4, 5, 6)]
    assert trace.skipped[0] == f"{path}:3: not JSON (Expecting property name enclosed in double quotes)"
    assert trace.skipped[1] == f"{path}:4: not a JSON object"
    with pytest.raises(TraceError) as caught:
        load_trace(str(path), strict=True)
    assert str(caught.value) == trace.skipped[0]
    assert len(load_trace(str(path), max_records=1).requests) == 1


def test_malformed_csv_rows_and_json_files(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "yesterday,1,1\n2023-11-16 18:15:47.0000000,-3,1\n2023-11-16 18:15:48.1805900,16,2\n")
    trace = load_trace(str(csv))
    assert trace.format == "azure" and [len(r.block_keys) for r in trace.requests] == [24, 1]
    assert [s.split(": ")[0] for s in trace.skipped] == [f"{csv}:3", f"{csv}:4"]
    assert trace.requests[1].arrival_s == pytest.approx(1.5)
    folder = tmp_path / "cc"
    folder.mkdir()
    (folder / "s1.json").write_text('{"requests": [], "hash_id_scope": "local", "block_size": 64}')
    (folder / "s2.json").write_text('{"requests": [')
    trace = load_trace(str(folder), format="claude-code")
    assert len(trace.skipped) == 1 and trace.skipped[0].startswith(f"{folder / 's2.json'}:1: not JSON")


def test_format_errors() -> None:
    with pytest.raises(TraceError, match="trace not found"):
        load_trace("/nonexistent/trace.jsonl")
    with pytest.raises(TraceError, match="unknown trace format 'csv2'; choose auto or one of mooncake"):
        load_trace(str(FIXTURES / "lmsys.jsonl"), format="csv2")
    with pytest.raises(TraceError, match="cannot tell the format"):
        detect_format(__file__)
    with pytest.raises(TraceError, match="positive"):
        load_trace(str(FIXTURES / "lmsys.jsonl"), block_size=0)
    with pytest.raises(TraceError, match="512-token blocks"):
        load_trace(str(FIXTURES / "bailian.jsonl"), format="mooncake", block_size=16)
    assert TRACE_FORMATS == ["mooncake", "bailian", "claude-code", "sharegpt", "swe-agent", "lmsys", "azure"]


def test_auto_detection_of_fixtures() -> None:
    assert detect_format(str(FIXTURES / "bailian.jsonl")) == "bailian"
    assert detect_format(str(FIXTURES / "lmsys.jsonl")) == "lmsys"


# ---------------------------------------------------------------- classification rules


def chain(*ids: int) -> tuple:
    return tuple(KeySpace().chain_hash_ids(ids))


def test_inferred_sessions_first_append_fork() -> None:
    c = PrefixClassifier(16)
    one = c.label(chain(1, 2, 3), input_tokens=48, output_tokens=16)
    assert one.transition is FIRST and one.block_types == (H, H, H)
    two = c.label(chain(1, 2, 3, 4, 5), input_tokens=80)
    assert (two.session, two.transition) == (one.session, APPEND)
    assert two.block_types == (H, H, H, O, H)  # tokens 48-64 are the previous answer
    fork = c.label(chain(1, 2, 9), input_tokens=48)
    assert fork.transition is FORK and fork.session != one.session
    assert fork.block_types == (S, S, H)  # seen before in another session
    assert c.label(chain(7), input_tokens=16).transition is FIRST
    partial = c.label(chain(20, 21), input_tokens=20)  # one full block, then a partial one
    grown = c.label(chain(20, 22, 23), input_tokens=48)  # the partial block was rewritten
    assert (grown.session, grown.transition) == (partial.session, APPEND)


def test_a_prefix_many_requests_branch_from_is_no_session_of_its_own() -> None:
    """First messages that fit in the partial block after a system prompt end their full blocks on it: once
    SHARED_BRANCHES blocks have followed it, such a request opens a session of its own, and a conversation with
    blocks of its own is still continued."""
    c = PrefixClassifier(16)
    opened = [c.label(chain(1, 2, 100 + k), input_tokens=40, output_tokens=8) for k in range(SHARED_BRANCHES + 3)]
    assert {lab.session for lab in opened[:SHARED_BRANCHES]} == {opened[0].session}  # no telling them apart yet
    assert [lab.transition for lab in opened[SHARED_BRANCHES:]] == [FORK] * 3
    assert len({lab.session for lab in opened[SHARED_BRANCHES - 1:]}) == 4
    assert opened[-1].block_types == (S, S, H)  # the prompt is now another session's too
    own = c.label(chain(1, 2, 200, 201), input_tokens=64, output_tokens=16)
    assert own.transition is FORK and own.session not in {lab.session for lab in opened}
    grown = c.label(chain(1, 2, 200, 201, 202, 203), input_tokens=96)
    assert (grown.session, grown.transition) == (own.session, APPEND)


def test_explicit_sessions_agent_steps_and_system_blocks() -> None:
    c = PrefixClassifier(16)
    a1 = c.label(chain(1, 2), "a", input_tokens=32, output_tokens=16, stop="tool_use")
    a2 = c.label(chain(1, 2, 3, 4), "a", input_tokens=64, output_tokens=4)
    assert a1.transition is FIRST and a2.transition is STEP and a2.stop_before == "tool_use"
    assert a2.block_types == (H, H, O, T)  # answer, then the tool result
    a3 = c.label(chain(1, 2, 3, 4, 5), "a", input_tokens=80)
    assert a3.transition is APPEND and a3.block_types == (H, H, O, T, H)  # seen blocks keep their type
    b1 = c.label(chain(1, 2, 8), "b", input_tokens=48)
    assert b1.transition is FORK and b1.block_types == (S, S, H)
    a4 = c.label(chain(1, 2, 3, 4, 5, 6), "a", input_tokens=96)
    assert a4.transition is APPEND and a4.block_types[:3] == (S, S, O)  # now shared with b
    assert c.label(chain(1, 2, 99), "a", input_tokens=48).transition is FORK
    assert c.label(chain(30), "a", input_tokens=16).transition is FIRST  # starts over
    c.label(chain(30, 31, 32), "c", input_tokens=48)
    assert c.label(chain(30, 31, 40, 41), "c", input_tokens=64).transition is APPEND  # last block re-tokenized
    agent = PrefixClassifier(16, agent=True)
    agent.label(chain(1), "x", input_tokens=16)
    assert agent.label(chain(50), "x", input_tokens=16).transition is STEP
    assert c.label(chain(60, 61), "d", known=(O, T)).block_types == (O, T)


def test_block_type_is_the_majority_of_its_tokens() -> None:
    spans = [(S, 3), (H, 5), (O, 2), (T, 6), (H, 1)]
    assert majority_block_types(spans, 4) == [S, H, O, T]  # block 2 is OOTT: a tie goes to the earliest
    assert majority_block_types([(S, 2), (H, 2), (O, 33)], 4) == [S] + [O] * 8
    assert majority_block_types([(H, 3)], 4) == []


# ---------------------------------------------------------------- tokenizer


@needs_tokenizer
def test_offline_tokenizer_is_mistral_32k() -> None:
    from kvcluster.tokenizer import load_fast_tokenizer, load_tokenizer

    tok = load_tokenizer()
    assert len(tok) == 32000 and tok("Hello world")["input_ids"] == [1, 22557, 1526]
    assert load_fast_tokenizer().get_vocab_size() == 32000


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_tests_needing_the_tokenizer_fail_under_ci_and_skip_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      ci: str, outcome: type) -> None:
    monkeypatch.setenv("KVCLUSTER_TOKENIZER_DIR", str(tmp_path))
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome) as missing:
        require_tokenizer()
    assert str(tmp_path / "tokenizer.json") in str(missing.value) and "scripts/fetch_tokenizer.py" in str(missing.value)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert require_tokenizer() == tmp_path


def test_missing_tokenizer_says_how_to_set_it_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcluster.tokenizer import load_tokenizer

    monkeypatch.setenv("KVCLUSTER_TOKENIZER_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="fetch_tokenizer.py"):
        load_tokenizer()
