"""benchmarks/vllm_replay.py's choice of turns and its options, without vLLM (the replay itself needs .venv-vllm)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def replay():
    env = dict(os.environ)  # the script sets vLLM's and OpenMP's variables for itself on import
    sys.path.insert(0, str(BENCH))
    try:
        import vllm_replay
    finally:
        sys.path.remove(str(BENCH))
        os.environ.clear()
        os.environ.update(env)
    return vllm_replay


def test_turns_are_capped_per_conversation_and_interleaved_by_arrival(replay) -> None:
    requests = [("a", [1] * 10, 3), ("a", [1] * 20, 3), ("a", [1] * 30, 3),
                ("b", [2] * 10, 4), ("b", [2] * 20, 4),
                ("c", [3] * 10, 5)]
    turns = replay.select_turns(requests, conversations=2, max_turns=2)
    assert [(t.session, t.index, len(t.prompt), t.answer_tokens) for t in turns] == [
        ("a", 0, 10, 3), ("b", 0, 10, 4), ("a", 1, 20, 3), ("b", 1, 20, 4)]


def test_working_set_counts_shared_prefix_blocks_once(replay) -> None:
    first = replay.Turn("a", 0, list(range(3, 3 + 256)), 1)  # 2 full blocks
    second = replay.Turn("a", 1, list(range(3, 3 + 300)), 1)  # the same 2 and a partial one
    other = replay.Turn("b", 0, list(range(500, 500 + 130)), 1)  # 1 full block of its own
    assert replay.working_set_blocks([first, second, other]) == 3


@pytest.mark.parametrize("argv, message", [
    (["--kv-blocks", "32"], "--kv-blocks must be >= 33"),
    (["--conversations", "0"], "must be >= 1"),
    (["--ttft-prompts", "-1"], "--ttft-prompts must be >= 0"),
])
def test_bad_options_are_errors_naming_them(replay, argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        replay.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
