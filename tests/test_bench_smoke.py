"""benchmarks/smoke.py: a benchmark passes only with exactly one JSON document on stdout and exit status 0, and
every file in benchmarks/ has an entry, so none is left out of the smoke run."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parents[1] / "benchmarks" / "smoke.py"
_spec = importlib.util.spec_from_file_location("bench_smoke", SMOKE)
smoke = sys.modules["bench_smoke"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)


@pytest.mark.parametrize("stdout, expected", [
    ('{"rows": [1, 2]}\n', {"rows": [1, 2]}),
    ('\n  [{"a": 1}, {"b": 2}]  \n\n', [{"a": 1}, {"b": 2}]),
    ("0.5", 0.5),
])
def test_one_json_document_passes(stdout: str, expected: object) -> None:
    assert smoke.one_json_document(stdout) == expected


@pytest.mark.parametrize("stdout, says", [
    ("", "empty"),
    (" \n\t\n", "empty"),
    ('{"a": 1}\n{"a": 2}\n', "more than one"),
    ('[1]\n[2]', "more than one"),
    ('{"a": 1}\nraylet started\n', "more than one"),
    ("| backend | batch |\n|---|---|\n", "not JSON"),
    ("INFO worker.py: connecting\n{\"a\": 1}\n", "not JSON"),
    ('{"a": 1', "not JSON"),
])
def test_anything_else_is_refused_with_the_reason(stdout: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        smoke.one_json_document(stdout)


def test_a_file_without_an_entry_is_named(tmp_path: Path) -> None:
    for name in ("tier_bandwidth.py", "new_bench.py", "new_tool.sh", "RESULTS.md"):
        (tmp_path / name).write_text("")
    (tmp_path / "gpu_wheels").mkdir()
    files = smoke.benchmark_files(tmp_path)
    assert files == ["new_bench.py", "new_tool.sh", "tier_bandwidth.py"]
    assert smoke.unlisted(files) == ["new_bench.py", "new_tool.sh"]


def test_every_benchmark_here_has_an_entry() -> None:
    assert smoke.unlisted(smoke.benchmark_files()) == []


def fake(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_bench.py"
    script.write_text(textwrap.dedent(body))
    return script


@pytest.mark.parametrize("body, says", [
    ("import sys\nprint('[1]'); print('[2]')\n", "more than one"),
    ("import sys\nprint('boom at step 3', file=sys.stderr); sys.exit(3)\n", "exit status 3\nboom at step 3"),
    ("raise RuntimeError('the backend moved')\n", "RuntimeError: the backend moved"),
    ("pass\n", "empty"),
])
def test_a_run_fails_with_what_went_wrong(tmp_path: Path, body: str, says: str) -> None:
    problem = smoke.smoke_one(fake(tmp_path, body), smoke.Entry(), 60, tmp_path)
    assert problem is not None and says in problem, problem


def test_a_run_with_one_document_passes(tmp_path: Path) -> None:
    script = fake(tmp_path, "import sys\nprint('noise', file=sys.stderr); print('{\"ok\": true}')\n")
    assert smoke.smoke_one(script, smoke.Entry(), 60, tmp_path) is None


def test_every_entry_names_a_file_here() -> None:
    assert sorted(set(smoke.ENTRIES) - set(smoke.benchmark_files())) == []


def test_a_run_past_its_time_is_stopped_and_named(tmp_path: Path) -> None:
    script = fake(tmp_path, "import sys, time\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    problem = smoke.smoke_one(script, smoke.Entry(), 1, tmp_path)
    assert problem is not None and problem.startswith("ran past 1 s") and "started" in problem, problem


@pytest.mark.timeout(120)  # a server left alive holds the benchmark's stdout open: without the fix this hangs
@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_stopped_run_takes_the_servers_it_started_in_their_own_sessions(tmp_path: Path, monkeypatch,
                                                                          ignores_sigterm: bool) -> None:
    """A benchmark that starts a server in a session of its own (as `serve run` is started) and then runs past
    its time: the server goes too, by SIGTERM, or by SIGKILL when it ignores SIGTERM."""
    monkeypatch.setattr(smoke, "STOP_GRACE_S", 2.0)
    pid_file = tmp_path / "server.pid"
    server = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)" \
        if ignores_sigterm else "import time; time.sleep(600)"
    script = fake(tmp_path, f"""
        import subprocess, sys, time
        server = subprocess.Popen([sys.executable, "-c", {server!r}], start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(server.pid))
        print('started', file=sys.stderr, flush=True)
        time.sleep(600)
        """)
    problem = smoke.smoke_one(script, smoke.Entry(), 3, tmp_path)
    assert problem is not None and problem.startswith("ran past 3 s"), problem
    pid = int(pid_file.read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"), "the server outlived its benchmark"


@pytest.mark.timeout(120)
def test_a_server_started_while_the_benchmark_is_being_stopped_goes_too(tmp_path: Path, monkeypatch) -> None:
    """The race behind a server that outlived its benchmark: the benchmark starts the server (in a session of its
    own) just after the stop has listed the processes below it, then dies of SIGTERM, and the server, now a child
    of init, is no longer below anything. Here the first listing lets the benchmark go on and start it; the stop
    must freeze the benchmark first, so that no server starts, or find the one that did."""
    import os
    import subprocess
    import time

    monkeypatch.setattr(smoke, "STOP_GRACE_S", 2.0)
    go, pid_file = tmp_path / "go", tmp_path / "server.pid"
    server = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    script = fake(tmp_path, f"""
        import os, subprocess, sys, time
        print('waiting', file=sys.stderr, flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        server = subprocess.Popen([sys.executable, "-c", {server!r}], start_new_session=True)
        open({str(pid_file)!r} + ".tmp", "w").write(str(server.pid))
        os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(600)
        """)
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr.readline().strip() == "waiting"
    listed = smoke.descendants

    def listing_then_the_server_starts(root=None):
        first = listed(root)
        if not go.exists():
            go.touch()
            deadline = time.monotonic() + 5  # the benchmark, unless frozen, starts its server meanwhile
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return first

    monkeypatch.setattr(smoke, "descendants", listing_then_the_server_starts)
    smoke.stop(proc)
    proc.wait(timeout=60)
    if pid_file.exists():
        pid = int(pid_file.read_text())
        stat = Path(f"/proc/{pid}/stat")
        alive = stat.exists() and not stat.read_text().split(") ")[1].startswith("Z")
        if alive:
            os.kill(pid, 9)
        assert not alive, "the server started during the stop outlived its benchmark"
