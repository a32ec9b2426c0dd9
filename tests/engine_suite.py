"""The vLLM engine's suite (tests/vllm_engine/, in .venv-vllm) as a background run beside the main suite.

Why in the background: the engine suite spends much of its time waiting (engine starts, Serve
deployments coming up, workers given their exit grace), and the main suite waits on Ray
sessions of its own; run one after the other they took 23 minutes, side by side 18 on two cores.
`pytest_collection_finish` starts it once the run is known to include
`tests/test_vllm_engine.py`, that test (ordered last) waits for it, and a run that ends first
stops it with everything it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvcluster.process_tree import descendants, kill

REPO = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ENGINE_TESTS = "tests/vllm_engine"


@dataclass
class EngineSuite:
    process: subprocess.Popen
    output_path: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, ceiling_s: float) -> tuple[int, str, str]:
        """(exit status, stdout, stdout + stderr) once the run has ended; TimeoutExpired past `ceiling_s` from its
        start (not from this call: the main suite ran beside it meanwhile)."""
        code = self.process.wait(timeout=max(1.0, self.started + ceiling_s - time.monotonic()))
        stdout = self.output_path.read_text(errors="replace")
        stderr = self.output_path.with_suffix(".err").read_text(errors="replace")
        shutil.rmtree(self.output_path.parent, ignore_errors=True)
        return code, stdout, stdout + stderr

    def stop(self) -> None:
        """The run and every process below it (engine workers, Ray sessions), if it is still going."""
        if self.process.poll() is None:
            kill(descendants(self.process.pid) | {self.process.pid}, signal.SIGKILL)
            self.process.wait()
        shutil.rmtree(self.output_path.parent, ignore_errors=True)


def start() -> EngineSuite:
    """Start the engine suite, its output in files (a pipe nobody reads while the main suite runs would fill)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvc-engine-suite-"))
    out = scratch / "pytest.out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the engine's CPU kernels: one thread per process
    with open(out, "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
        process = subprocess.Popen([str(ENGINE_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    ENGINE_TESTS], cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    return EngineSuite(process, out)
