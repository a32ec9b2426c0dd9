"""Trace loaders on the real shared files and on small fixtures; classification rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcluster.block_types import BlockType, TransitionType
from kvcluster.errors import TraceError
from kvcluster.keys import KeySpace
from kvcluster.paths import shared_data_dir
from kvcluster.simulator import prepare
from kvcluster.traces import detect_format, load_trace
from kvcluster.traces.classify import HashTraceClassifier, block_types_from_roles

DATA = shared_data_dir()
FIXTURES = Path(__file__).parent / "fixtures" / "traces"
needs_data = pytest.mark.skipif(not DATA.exists(), reason="shared data not present")


@needs_data
def test_mooncake_counts() -> None:
    trace = load_trace(str(DATA / "mooncake" / "synthetic_trace.jsonl"))
    assert trace.format == "mooncake" and trace.block_size == 512
    assert (len(trace.requests), trace.block_refs, trace.unique_blocks) == (3993, 121_877, 43_924)
    assert not trace.skipped
    assert {r.transition for r in trace.requests} >= {TransitionType.FIRST, TransitionType.APPEND, TransitionType.FORK}


@needs_data
def test_claude_code_sessions_merge_into_one_timeline() -> None:
    files = sorted((DATA / "weka_claude_code_traces").glob("*.json"))
    assert len(files) == 44
    trace = load_trace(str(files[0]))
    assert trace.format == "claude-code" and trace.block_size == 64
    assert {r.transition for r in trace.requests[1:]} <= {TransitionType.AGENT_STEP, TransitionType.APPEND, TransitionType.FORK}
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)


def test_claude_code_sessions_share_only_the_system_prefix(tmp_path: Path) -> None:
    import json

    for k in range(2):
        doc = {"id": f"trace_{k}", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 128, "system_tokens": 64,
               "requests": [{"t": 0.0, "type": "n", "in": 320, "out": 10, "hash_ids": [1, 2, 3, 4, 5], "stop": "tool_use"},
                            {"t": 5.0, "type": "n", "in": 384, "out": 10, "hash_ids": [1, 2, 3, 4, 5, 6], "stop": "end_turn"}]}
        (tmp_path / f"trace_{k}.json").write_text(json.dumps(doc))
    trace = load_trace(str(tmp_path))
    a, b = [r for r in trace.requests if r.arrival_s == 0.0], [r for r in trace.requests if r.arrival_s == 60.0]
    assert a[0].block_keys[:3] == b[0].block_keys[:3] and a[0].block_keys[3] != b[0].block_keys[3]
    second = [r for r in trace.requests if r.arrival_s == 5.0][0]
    assert second.transition is TransitionType.AGENT_STEP
    assert second.block_types[-1] is BlockType.OUTPUT or second.block_types[-1] is BlockType.TOOL


@needs_data
def test_sharegpt_and_swe_agent_tokenize_with_the_offline_tokenizer() -> None:
    share = load_trace(str(DATA / "sharegpt_v3" / "sharegpt_v3_subset.jsonl"), max_records=20)
    assert share.format == "sharegpt" and share.block_size == 16 and share.requests
    assert {t for r in share.requests for t in r.block_types} >= {BlockType.HISTORY, BlockType.OUTPUT}
    swe = load_trace(str(DATA / "swe_agent_trajectories" / "test_data"))
    assert swe.format == "swe-agent"
    assert {r.transition for r in swe.requests} == {TransitionType.FIRST, TransitionType.AGENT_STEP}
    assert BlockType.TOOL in {t for r in swe.requests for t in r.block_types}
    assert prepare(swe).infinite_hit_rate() > 0.5  # agent turns re-send their whole history


@needs_data
def test_azure_is_arrivals_only() -> None:
    trace = load_trace(str(DATA / "azure_llm_inference_2023" / "AzureLLMInferenceTrace_code.csv"))
    assert len(trace.requests) == 8819 and prepare(trace).infinite_hit_rate() == 0.0


def test_bailian_fixture_sessions_and_bad_lines() -> None:
    trace = load_trace(str(FIXTURES / "bailian.jsonl"))
    assert trace.format == "bailian" and len(trace.requests) == 4
    assert trace.skipped[0].endswith("bailian.jsonl:4: not JSON (Expecting value)")
    assert ":6:" in trace.skipped[1]
    by_time = {r.arrival_s: r for r in trace.requests}
    assert by_time[2.0].transition is TransitionType.APPEND and by_time[2.0].session == by_time[0.0].session
    assert by_time[3.0].transition is TransitionType.APPEND
    assert by_time[2.0].block_types[0] is BlockType.SYSTEM  # hash 1 is shared with chat 2, another session
    with pytest.raises(TraceError, match="bailian.jsonl:4"):
        load_trace(str(FIXTURES / "bailian.jsonl"), strict=True)


def test_lmsys_fixture() -> None:
    trace = load_trace(str(FIXTURES / "lmsys.jsonl"), block_size=4)
    assert trace.format == "lmsys" and len(trace.skipped) == 1 and "lmsys.jsonl:3" in trace.skipped[0]
    turns = [r for r in trace.requests if r.session == "c1"]
    assert [r.transition for r in turns] == [TransitionType.FIRST, TransitionType.APPEND]
    assert turns[1].block_keys[: len(turns[0].block_keys)] == turns[0].block_keys


def test_format_errors() -> None:
    with pytest.raises(TraceError, match="trace not found"):
        load_trace("/nonexistent/trace.jsonl")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(str(FIXTURES / "lmsys.jsonl"), format="csv2")
    with pytest.raises(TraceError, match="cannot tell the format"):
        detect_format(__file__)


def test_hash_classifier_rules() -> None:
    space = KeySpace()
    c = HashTraceClassifier(block_size=16)
    sys_prompt = space.chain_hash_ids([1, 2])
    s1, t1, _ = c.classify(sys_prompt + space.chain_hash_ids([1, 2, 3])[2:], None, 16)
    assert t1 is TransitionType.FIRST
    first = space.chain_hash_ids([1, 2, 3])
    s2, t2, types2 = c.classify(space.chain_hash_ids([1, 2, 3, 4, 5]), None, 16)
    assert (s2, t2) == (s1, TransitionType.APPEND) and types2[3] is BlockType.OUTPUT and types2[4] is BlockType.HISTORY
    s3, t3, types3 = c.classify(space.chain_hash_ids([1, 2, 9]), None, 16)
    assert t3 is TransitionType.FORK and s3 != s1
    _, _, types4 = c.classify(space.chain_hash_ids([1, 2, 10]), None, 16)
    assert types4[0] is BlockType.SYSTEM  # blocks 1, 2 now seen in two sessions
    _, t5, types5 = c.classify(first, "agent", 16, stop="tool_use")
    _, t6, types6 = c.classify(space.chain_hash_ids([1, 2, 3, 7, 8]), "agent", 16)
    assert t5 is TransitionType.FIRST and t6 is TransitionType.AGENT_STEP and types6[4] is BlockType.TOOL


def test_block_type_is_the_majority_role() -> None:
    toks = [BlockType.SYSTEM] * 3 + [BlockType.HISTORY] * 5 + [BlockType.OUTPUT] * 2
    assert block_types_from_roles(toks, 4) == (BlockType.SYSTEM, BlockType.HISTORY)
