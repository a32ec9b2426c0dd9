"""start_ray: a node start that only missed Ray's fixed startup deadline is run again, its leftovers killed."""

from __future__ import annotations

import subprocess
import time

import pytest

from kvcluster.actors.ray_start import STARTUP_TIMEOUT, start_ray
from kvcluster.process_tree import descendants

RAY_MESSAGE = ("The current node timed out during startup. This could happen because some of the raylet failed "
               "to startup or the GCS has become overloaded.")
assert STARTUP_TIMEOUT in RAY_MESSAGE


class FlakyStart:
    """Fails like a Ray start that missed its deadline `misses` times, each leaving a process behind."""

    def __init__(self, misses: int, error: str = RAY_MESSAGE) -> None:
        self.misses, self.error, self.calls, self.left = misses, error, 0, []

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.misses:
            self.left.append(subprocess.Popen(["sleep", "600"]))  # a raylet that was still starting
            raise Exception(self.error)
        return "started"


def test_a_missed_startup_deadline_is_started_again_and_what_it_left_is_killed() -> None:
    start = FlakyStart(misses=2)
    assert start_ray(start) == "started"
    assert start.calls == 3
    for proc in start.left:
        assert proc.wait(timeout=60) == -9  # killed, and reaped here
    assert not {p.pid for p in start.left} & descendants()


def test_other_errors_and_a_start_that_keeps_missing_are_raised() -> None:
    other = FlakyStart(misses=1, error="address already in use")
    with pytest.raises(Exception, match="address already in use"):
        start_ray(other)
    assert other.calls == 1
    other.left[0].kill()
    other.left[0].wait()

    stuck = FlakyStart(misses=5)
    with pytest.raises(Exception, match=STARTUP_TIMEOUT):
        start_ray(stuck, tries=3)
    assert stuck.calls == 3
    assert stuck.left[-1].poll() is None  # the last try's processes are the caller's to clean up, as without a retry
    stuck.left[-1].kill()
    stuck.left[-1].wait()


def test_descendants_sees_grandchildren() -> None:
    shell = subprocess.Popen(["bash", "-c", "sleep 600 & wait"])
    try:
        deadline = time.monotonic() + 120
        while not descendants(shell.pid):  # until bash has started its sleep
            assert time.monotonic() < deadline, "bash did not start its child"
            time.sleep(0.01)
        assert shell.pid in descendants()
        (sleep,) = descendants(shell.pid)
        assert sleep in descendants()
    finally:
        shell.kill()
        shell.wait()
    subprocess.run(["kill", "-9", str(sleep)], check=False)
