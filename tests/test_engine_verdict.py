"""The engine suite's verdict (tests/engine_verdict.py): hardware skips pass, every other skip fails, and a
broken vLLM install fails the run; the switch that hides CPU features (kvcluster.cpu_features)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import background
import pytest
from engine_verdict import problems, skip_reasons

from kvcluster import cpu_features

PASSED_WITH_AMX_SKIP = """\
..........s..........
=========================== short test summary info ============================
SKIPPED [1] tests/vllm_engine/test_vllm_connector.py:564: {reason}
20 passed, 1 skipped, 3 warnings in 281.05s (0:04:41)
"""


def test_a_skip_for_a_missing_cpu_feature_passes() -> None:
    output = PASSED_WITH_AMX_SKIP.format(reason=cpu_features.NO_AMX)
    assert skip_reasons(output) == [(1, cpu_features.NO_AMX)]
    assert problems(0, output) == []


def test_a_skip_for_any_other_reason_fails() -> None:
    output = PASSED_WITH_AMX_SKIP.format(reason="could not import 'vllm': No module named 'vllm._C'")
    assert problems(0, output) == [
        "1 skipped for a reason that is not a missing CPU feature: \"could not import 'vllm': No module named "
        "'vllm._C'\""]


def test_skips_without_their_reasons_listed_fail() -> None:
    """A run without -rs (or -ra) cannot show its skips are hardware ones."""
    output = "..........s..........\n20 passed, 1 skipped in 281.05s\n"
    assert problems(0, output) == ["1 skipped, but 0 skip reasons listed (run pytest with -rs)"]


def test_a_failed_or_empty_run_fails() -> None:
    assert problems(1, "19 passed, 1 failed in 200.00s\n") == [
        "the run exited 1", "outcomes other than passed or a hardware skip: {'passed': 19, 'failed': 1}"]
    assert problems(5, "no tests ran in 0.01s\n") == ["the run exited 5", "no test passed"]


def test_the_switch_hides_amx_from_the_tests(monkeypatch) -> None:
    """On a CPU with AMX the switch makes the tests behave as on one without (the run passes that way: .ci/run
    with KVCLUSTER_HIDE_CPU_FEATURES=amx_tile); without the switch torch's detection decides."""
    fake_torch = types.SimpleNamespace(cpu=types.SimpleNamespace(_is_amx_tile_supported=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.delenv(cpu_features.HIDE_ENV, raising=False)
    assert cpu_features.has_amx()
    assert "amx_tile=yes" in cpu_features.summary()
    monkeypatch.setenv(cpu_features.HIDE_ENV, "avx512f, amx_tile")
    assert not cpu_features.has_amx() and not cpu_features.has("avx512f")
    assert cpu_features.summary().startswith("CPU features that decided which tests ran: amx_tile=hidden "
                                             f"({cpu_features.HIDE_ENV}), avx512f=hidden")


def test_cpuinfo_flags_are_read_from_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features.cpuinfo_flags(cpuinfo) == {"fpu", "avx2", "amx_tile"}
    assert cpu_features.cpuinfo_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(not background.ENGINE_PYTHON.exists(), reason="no .venv-vllm: run `bash scripts/setup.sh`")
@pytest.mark.parametrize("error,expected", [
    ("ModuleNotFoundError(\"No module named 'vllm._C'\")",  # importorskip turns it into a skip
     "skipped for a reason that is not a missing CPU feature: 'vLLM is not installed here"),
    ("ImportError('vllm/_C.abi3.so: cannot open shared object file')",  # pytest reports a collection error
     "the run exited 2"),
])
def test_a_broken_vllm_install_fails_the_engine_suite(tmp_path: Path, error: str, expected: str) -> None:
    """The engine suite, as the main suite runs it, in its venv with a `vllm` that fails to import: its tests
    skip or error, and the verdict refuses the run."""
    broken = tmp_path / "vllm"
    broken.mkdir()
    (broken / "__init__.py").write_text(f"raise {error}\n")
    run = background.engine_suite()
    env = {**os.environ, **run.env, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(list(run.command), cwd=background.REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    found = problems(done.returncode, done.stdout)
    assert any(expected in p for p in found), "\n".join(found) + "\n" + done.stdout + done.stderr
    assert "no test passed" in found
