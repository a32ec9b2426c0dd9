"""The background runs beside the suite (tests/background.py): one after another, each waited for by its test,
and a command that cannot start reported at once, not after its ceiling."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from background import BackgroundRun, Chain


def test_runs_go_one_after_another_and_report_their_output() -> None:
    first = BackgroundRun("first", [sys.executable, "-c", "import time; time.sleep(0.5); print('one')"])
    second = BackgroundRun("second", [sys.executable, "-c", "import sys; print('two'); sys.exit(3)"])
    chain = Chain([first, second])
    try:
        assert first.wait(ceiling_s=120)[:2] == (0, "one\n")
        code, stdout, _ = second.wait(ceiling_s=120)
        assert (code, stdout) == (3, "two\n")
        assert second.began >= first.began + 0.4  # started once the first had ended (it slept 0.5 s)
    finally:
        chain.stop()


def test_a_command_that_cannot_start_is_reported_at_once_and_the_next_still_runs() -> None:
    missing = BackgroundRun("missing", ["/nonexistent/python", "-V"])
    after = BackgroundRun("after", [sys.executable, "-c", "print('ran')"])
    chain = Chain([missing, after])
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="missing: /nonexistent/python -V could not start"):
            missing.wait(ceiling_s=600)
        assert time.monotonic() - began < 60  # not the ceiling
        assert after.wait(ceiling_s=120)[:2] == (0, "ran\n")
    finally:
        chain.stop()


def test_a_run_past_its_ceiling_is_a_timeout_and_stop_ends_it() -> None:
    slow = BackgroundRun("slow", [sys.executable, "-c", "import time; time.sleep(600)"])
    chain = Chain([slow])
    try:
        assert slow.started.wait(timeout=120)
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(ceiling_s=1)
    finally:
        chain.stop()
    assert slow.process.poll() is not None
