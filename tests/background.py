"""Runs beside the main suite, one after another: the vLLM engine's suite, then every benchmark's smoke run.

Why in the background: both spend much of their time waiting (engine starts, Ray sessions,
Serve deployments), and so does the main suite on Ray sessions of its own; one after the
other they leave a core idle for minutes. Why one after the other: the engine suite keeps
both cores busy for its first minutes, and the smoke run fills the core the main suite's
Ray modules leave idle once it has ended. `conftest.py` starts the chain once the session
is collected, when the run includes the test that waits for each run
(`tests/test_vllm_engine.py`, `tests/test_every_benchmark_runs.py`, ordered last); a session
that ends first stops the chain with everything it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvcluster.process_tree import descendants, kill

REPO = Path(__file__).resolve().parent.parent
CORE_PYTHON = REPO / ".venv" / "bin" / "python"
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


@dataclass
class BackgroundRun:
    """One command whose output goes to files (a pipe nobody reads while the main suite runs would fill)."""

    name: str
    command: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started: threading.Event = field(default_factory=threading.Event)
    began: float = 0.0
    scratch: Path | None = None
    failed_to_start: str | None = None

    def start(self) -> None:
        """Starts the command; a command that cannot start (no such interpreter) is recorded, for `wait` to
        report at once rather than after its ceiling."""
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kvc-{self.name}-"))
        try:
            with open(self.scratch / "run.out", "w") as stdout, open(self.scratch / "run.err", "w") as stderr:
                self.process = subprocess.Popen(list(self.command), cwd=REPO, env={**os.environ, **self.env},
                                                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
        except OSError as exc:
            self.failed_to_start = f"{self.name}: {' '.join(self.command)} could not start: {exc}"
        self.began = time.monotonic()
        self.started.set()

    def wait(self, ceiling_s: float) -> tuple[int, str, str]:
        """(exit status, stdout, stdout + stderr) once the run has ended. subprocess.TimeoutExpired past
        `ceiling_s` from its start (not from this call: the main suite ran beside it meanwhile); TimeoutError
        when it never started, RuntimeError when it could not."""
        if not self.started.wait(timeout=ceiling_s):
            raise TimeoutError(f"{self.name}: never started (the run before it in the chain did not end)")
        if self.process is None:
            raise RuntimeError(self.failed_to_start or f"{self.name}: stopped before it started")
        code = self.process.wait(timeout=max(1.0, self.began + ceiling_s - time.monotonic()))
        stdout = (self.scratch / "run.out").read_text(errors="replace")
        stderr = (self.scratch / "run.err").read_text(errors="replace")
        shutil.rmtree(self.scratch, ignore_errors=True)
        return code, stdout, stdout + stderr

    def stop(self) -> None:
        """The run and every process below it (engine workers, Ray sessions), if it is still going."""
        if self.process is not None and self.process.poll() is None:
            kill(descendants(self.process.pid) | {self.process.pid}, signal.SIGKILL)
            self.process.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


class Chain:
    """Runs started one after another, each once the one before it has ended, by a thread of this process."""

    def __init__(self, runs: Sequence[BackgroundRun]) -> None:
        self.runs = {run.name: run for run in runs}
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._go, name="background-runs", daemon=True)
        self._thread.start()

    def _go(self) -> None:
        for run in self.runs.values():
            with self._lock:
                if self._stopped.is_set():
                    return
                run.start()
            if run.process is not None:
                run.process.wait()

    def stop(self) -> None:
        """No run starts any more; the one going is stopped with what it started."""
        with self._lock:
            self._stopped.set()
        for run in self.runs.values():
            run.stop()


def engine_suite() -> BackgroundRun:
    """The vLLM engine's tests (tests/vllm_engine/) in .venv-vllm; one OpenMP thread per engine process."""
    return BackgroundRun("engine-suite", [str(ENGINE_PYTHON), "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                                          "tests/vllm_engine"], {"OMP_NUM_THREADS": "1"})


def benchmark_smoke() -> BackgroundRun:
    """Every benchmark at its smallest size (`benchmarks/smoke.py`), one at a time: beside the main suite."""
    return BackgroundRun("benchmark-smoke", [str(CORE_PYTHON), "benchmarks/smoke.py", "--jobs", "1"])
