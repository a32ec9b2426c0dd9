"""Every benchmark at its smallest size, two at a time: a benchmark that no longer runs fails CI, not a release.

The benchmarks are found by listing this directory (`*.py`, `*.sh`), and each must
have an entry in `ENTRIES`: the arguments that make it small, why it is skipped,
or which benchmark it is a part of. A file without one fails the run before
anything starts, so a new benchmark cannot be forgotten. Each runs as a
subprocess with `--json`; it passes when it exits 0 and its stdout is exactly one
JSON document.
Figures at these sizes mean nothing; only that the code still runs is checked.

    .venv/bin/python benchmarks/smoke.py [--only a,b] [--timeout-s 300] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvcluster.process_tree import descendants, kill  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CORE = ".venv/bin/python"
VLLM = ".venv-vllm/bin/python"
STDERR_TAIL = 2000
STOP_GRACE_S = 10.0  # a benchmark past its time: seconds between SIGTERM and SIGKILL


@dataclass(frozen=True)
class Entry:
    """How the smoke run treats one file: run it (`args` after the script, with the interpreter `python` for a
    .py), skip it (`skip`: why), or leave it to the benchmark it is a part of (`part_of`). `first`: one of the
    longest runs, started before the others so that none is left running alone at the end."""

    args: tuple[str, ...] = ()
    python: str = CORE
    skip: str | None = None
    part_of: str | None = None
    first: bool = False


def run(*args: str, python: str = CORE, first: bool = False) -> Entry:
    return Entry(args=("--json", *args), python=python, first=first)


ENTRIES: dict[str, Entry] = {
    "actor_path.py": run("--requests", "3", "--blocks", "2", "--block-kib", "4"),
    "aiperf.sh": Entry(skip="needs NVIDIA AIPerf (its own 1.2 GB venv from a registry) and a served endpoint"),
    "aiperf_support.py": Entry(part_of="aiperf.sh"),
    "checksum_kernel.py": run("--repeat", "1"),
    "control_memory.py": run("--passes", "2", "--smoke"),
    "cluster_sim.py": run("--nodes", "1,2", "--policies", "lru", "--max-requests", "30"),
    "control_scale.py": run("--writers", "1", "--requests", "2", "--blocks", "2", "--trials", "1",
                            "--decide-requests", "10", "--decide-capacity", "64", "--route-requests", "40"),
    "control_plane.py": run("--tracked", "2000", "--request-blocks", "8", "--requests", "5"),
    "first_command.py": Entry(skip="one vLLM Serve app start takes 80 s alone and past 300 s beside another benchmark "
                                   "on 2 cores; what it shows is tested in tests/vllm_engine (a clean shutdown's "
                                   "checkpoint into pfs, loaded by a fresh engine) and tests/test_vllm_model_source.py"),
    "gap_headroom.py": run("--smoke"),
    "informed_oracle.py": Entry(part_of="gap_headroom.py"),
    "gpu_check.py": Entry(part_of="gpu_check.sh"),
    "gpu_check.sh": Entry(skip="its --dry-run (every section on the CPU) runs in tests/test_gpu_check.py, which "
                               "checks its report and which CI runs next: a second run here would add 70-110 s"),
    "gpu_common.py": Entry(part_of="gpu_check.sh"),
    "gpu_nixl.py": Entry(part_of="gpu_check.sh"),
    "gpu_paged.py": Entry(part_of="gpu_check.sh"),
    "gpu_serving.py": Entry(part_of="gpu_check.sh"),
    "gpu_sizing.py": Entry(part_of="gpu_check.sh"),
    "gpu_tiers.py": Entry(part_of="gpu_check.sh"),
    "harness.py": Entry(part_of="every benchmark (the shared timing and JSON helpers)"),
    "hit_rate.py": run("--smoke"),
    "hit_rate_unseen.py": run("--smoke"),
    "index_lookup.py": run("--blocks", "500", "--prompt-blocks", "4", "--lookups", "10", "--inflight", "2",
                           "--shards", "1,2"),
    "move_round.py": run("--rounds", "1", "--warmup", "1", "--blocks", "2", "--block-kib", "4", "--variants", "3-tier",
                         first=True),
    "node_move.py": run("--blocks", "2", "--block-kib", "4", "--repeat", "1"),
    "paged_nixl.py": run("--blocks", "1", "--layers", "2", "--repeat", "1"),
    "pool_threads.py": run("--repeat", "1"),
    "replay_speed.py": run("--repeat", "1"),
    "replica_fetch.py": run("--blocks", "2", "--block-kib", "4", "--repeat", "1"),
    "serving.py": run("--repeat", "1", "--replay-requests", "2", "--max-new-tokens", "2", "--ttft-tokens", "128",
                      "--hit-prefixes", "32,64", "--replay-datasets", "sharegpt"),
    "serving_commits.py": run("--smoke"),
    "smoke.py": Entry(part_of="CI (this runner)"),
    "soak.py": run("--seconds", "2", "--clients", "1", "--conversations", "1", "--clean-seconds", "1",
                   "--metrics-interval-s", "0.2", "--settle-s", "1", first=True),
    "tier_bandwidth.py": run("--batches-kib", "256", "--trials", "1", "--repeat", "1"),
    "vllm_replay.py": run("--datasets", "sharegpt", "--conversations", "1", "--max-turns", "2",
                          "--max-new-tokens", "2", "--ttft-prompts", "0", python=VLLM, first=True),
}


def one_json_document(stdout: str) -> Any:
    """The one JSON document `stdout` holds (surrounding whitespace aside); ValueError naming what else it holds."""
    text = stdout.strip()
    if not text:
        raise ValueError("stdout is empty, expected one JSON document")
    try:
        doc, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"stdout is not JSON ({exc.msg} at char {exc.pos}): {text[:200]!r}") from None
    rest = text[end:].strip()
    if rest:
        raise ValueError(f"stdout holds more than one JSON document; after the first comes {rest[:200]!r}")
    return doc


def benchmark_files(directory: Path = HERE) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))


def unlisted(names: list[str], entries: dict[str, Entry] = ENTRIES) -> list[str]:
    return [n for n in names if n not in entries]


def command(script: Path, entry: Entry) -> list[str]:
    if script.suffix == ".sh":
        return ["bash", str(script), *entry.args]
    return [str(REPO / entry.python), str(script), *entry.args]


def smoke_one(script: Path, entry: Entry, timeout_s: float, scratch: Path) -> str | None:
    """Run one benchmark; None when it passed, else what went wrong (with the tail of its stderr)."""
    if script.suffix == ".py" and not (REPO / entry.python).exists():
        return f"{entry.python} is missing: run scripts/setup.sh"
    # one OpenMP thread (as the benchmarks' own docs run them): spin-waiting threads on a busy 2-core machine
    # make small forwards many times slower, and two benchmarks run at once here
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", str(scratch / "ray")), "TMPDIR": str(scratch),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # a session of its own: on a timeout the benchmark goes with everything it started (Ray's workers too)
    proc = subprocess.Popen(command(script, entry), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        stdout, stderr = proc.communicate()
        return f"ran past {timeout_s:.0f} s\n{stderr[-STDERR_TAIL:]}"
    if proc.returncode != 0:
        return f"exit status {proc.returncode}\n{stderr[-STDERR_TAIL:]}"
    try:
        one_json_document(stdout)
    except ValueError as exc:
        return f"{exc}\n{stderr[-STDERR_TAIL:]}"
    return None


def freeze(proc: subprocess.Popen) -> set[int]:
    """SIGSTOP the benchmark's process group and every process below it, until no new one appears; their pids.

    Why: a process's children are found by their parent links, which break when the parent exits (they go to
    init). A benchmark stopped while it starts a server in a session of its own could exit before the server
    is seen and leave it running; stopped, nothing below it can start or lose a process any more."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:  # it ended meanwhile; what it started may not have
        pass
    frozen: set[int] = set()
    while new := descendants(proc.pid) - frozen:
        kill(new, signal.SIGSTOP)
        frozen |= new
    return frozen


def stop(proc: subprocess.Popen, grace_s: float | None = None) -> None:
    """Stop a benchmark past its time and everything below it: its process group, and the processes it started
    in sessions of their own (a `serve run`), which the group does not reach. All are frozen first (`freeze`),
    then sent SIGTERM and let go on, so that such a server can stop its own workers; SIGKILL for what is left."""
    grace_s = STOP_GRACE_S if grace_s is None else grace_s
    tree = freeze(proc)
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        kill(tree, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    tree |= descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill(tree | descendants(proc.pid))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated file names to run (default: all)")
    parser.add_argument("--timeout-s", type=float, default=300, help="per benchmark")
    parser.add_argument("--jobs", type=int, default=2,
                        help="benchmarks run at once (default 2: much of a small run waits on process starts, Ray's "
                             "and vLLM's; on the 2-core CI machine two at once took 70%% of one at a time)")
    args = parser.parse_args()
    files = benchmark_files()
    missing = unlisted(files)
    if missing:
        print(f"smoke: no entry in benchmarks/smoke.py ENTRIES for {', '.join(missing)}: add the arguments that "
              "make it small (or why it cannot run)", file=sys.stderr)
        return 1
    wanted = files if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(files))
    if unknown or not wanted:
        parser.error(f"--only: no benchmark named {', '.join(unknown) or '(none given)'} in {HERE}")
    failed, start = [], time.perf_counter()
    runs = []
    for name in wanted:
        entry = ENTRIES[name]
        if entry.part_of or entry.skip:
            print(f"skip {name}: " + (f"part of {entry.part_of}" if entry.part_of else entry.skip), flush=True)
        else:
            runs.append(name)
    runs.sort(key=lambda n: not ENTRIES[n].first)  # stable: file order otherwise

    def one(name: str) -> None:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kvc-smoke-", dir="/tmp") as scratch:
            problem = smoke_one(HERE / name, ENTRIES[name], args.timeout_s, Path(scratch))
        took = time.perf_counter() - t0
        if problem is None:
            print(f"ok   {name} {took:.1f} s", flush=True)
        else:
            failed.append(name)
            print(f"FAIL {name} {took:.1f} s: {problem}", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, runs))
    total = time.perf_counter() - start
    print(f"smoke: {len(wanted) - len(failed)} of {len(wanted)} passed or skipped in {total:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
