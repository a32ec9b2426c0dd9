"""GPU check (issue 9): the tiers, the NVMe and NIXL paths, serving and sizing on a CUDA device, in one run.

Run it through `benchmarks/gpu_check.sh` (which prepares the machine with
`scripts/prepare_gpu_machine.py`, picks a Python with CUDA torch and puts the repo
on PYTHONPATH). Every figure sits next to a reference measured in the same run on
the same bytes, and the ratio between them is what the report is about:

- hbm: the hbm backend's block moves between pinned DRAM and HBM vs torch copies;
- paged: the vLLM connector's data plane (PagedKV gather/scatter over 32 paged layers + the
  dram tier) vs one bulk torch copy of the same bytes each way (gpu_paged.py);
- nvme: the nvme backend's reads + H2D vs a plain preadv + H2D (and KvikIO, when
  importable), with the I/O path the backend actually took (both: gpu_tiers.py);
- nixl: raw NIXL UCX VRAM<->DRAM vs torch copies, the repo's rdma backend vs the raw
  NIXL read, reads straight into 32 layers' paged KV pages in VRAM vs the staged
  read + PagedKV.scatter, and the same blocks read from another engine's lent paged KV
  in VRAM (the node's hbm tier) vs that in-place read from a pool (gpu_nixl.py);
- serving: TTFT for a long prompt whose prefix is in DRAM vs cold prefill, decode
  tokens/s vs the bare model, greedy output with and without the cache (gpu_serving.py);
- sizing: the sizing engine's bytes vs the CUDA allocator's delta for the cache (gpu_sizing.py).

Each section has its own time budget and records its own failure; one JSON report.
`--dry-run` runs the same code on the CPU with a tiny model, every figure labelled
as not a GPU result.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and ("--dry-run" in sys.argv or os.environ.get("GPU_CHECK_DRY") == "1"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a dry run is a CPU run, even on a GPU machine
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would bury the summary

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import torch  # noqa: E402
from gpu_common import Plan, Skip, cuda, dry_plan, full_plan  # noqa: E402
from gpu_nixl import section_nixl, summary_nixl  # noqa: E402
from gpu_paged import section_paged, summary_paged  # noqa: E402
from gpu_serving import section_serving, summary_serving  # noqa: E402
from gpu_sizing import section_sizing, summary_sizing  # noqa: E402
from gpu_tiers import section_hbm, section_nvme, summary_hbm, summary_nvme  # noqa: E402

SECTIONS = ("hbm", "paged", "nvme", "nixl", "serving", "sizing")
REPO = Path(__file__).resolve().parents[1]


class OutOfTime(Exception):
    """A section ran past its budget; what it measured so far stays in the report."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in this (main) thread after `seconds`, between Python steps."""
    def on_alarm(signum, frame):  # noqa: ARG001
        raise OutOfTime(f"ran past its {seconds:.0f} s budget")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


RUN: dict[str, Callable[[Plan, dict], None]] = {
    "hbm": section_hbm, "paged": section_paged, "nvme": section_nvme, "nixl": section_nixl,
    "serving": section_serving, "sizing": section_sizing}
SUMMARY: dict[str, Callable[[dict], str]] = {
    "hbm": summary_hbm, "paged": summary_paged, "nvme": summary_nvme, "nixl": summary_nixl,
    "serving": summary_serving, "sizing": summary_sizing}


def run_section(name: str, plan: Plan) -> dict:
    """One section: its figures, or `skipped` with the reason, or `error` with what broke (the rest still run)."""
    out: dict[str, Any] = {"device": plan.label}
    t0 = time.perf_counter()
    try:
        with time_limit(plan.budgets[name]):
            RUN[name](plan, out)
        out["status"] = "ok"
    except Skip as exc:
        out.update(status="skipped", skipped=str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded, and the next section runs
        hint = " (carry its wheel: benchmarks/gpu_check.sh --help)" if isinstance(exc, ModuleNotFoundError) else ""
        out.update(status="error", error=f"{type(exc).__name__}: {exc}{hint}",
                   traceback=traceback.format_exc().strip().splitlines()[-8:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    label_figures(out, plan.label)
    return out


def label_figures(node: Any, label: str) -> None:
    """Every dict holding a figure names the device it was measured on."""
    if isinstance(node, dict):
        if any(isinstance(v, float) for v in node.values()):
            node.setdefault("device", label)
        for v in node.values():
            label_figures(v, label)
    elif isinstance(node, list):
        for v in node:
            label_figures(v, label)


def environment(plan: Plan) -> dict:
    import transformers

    env = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
           "wheels_installed": os.environ.get("GPU_CHECK_WHEELS_INSTALLED", "").split(), "dry_run": plan.dry,
           "checksum_kernel": checksum_kernel()}
    if cuda():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    return env


def checksum_kernel() -> str:
    from kvcluster.storage.copyhash import KERNEL

    return KERNEL


def report_path(arg: str | None) -> Path:
    if arg or os.environ.get("GPU_CHECK_JSON"):
        return Path(arg or os.environ["GPU_CHECK_JSON"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return REPO / "benchmarks" / "gpu_check.json"


def write(report: dict, path: Path) -> None:
    """Rewritten after every section, so a run stopped from outside still leaves what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def summary_line(name: str, s: dict) -> str:
    if s["status"] == "skipped":
        return f"{name:8} skipped: {s['skipped']}"
    if s["status"] == "error":
        return f"{name:8} ERROR: {s['error'][:300]}"
    try:
        return f"{name:8} {SUMMARY[name](s)}"
    except Exception as exc:  # noqa: BLE001 - a missing figure must not hide the others
        return f"{name:8} ok (summary unavailable: {type(exc).__name__}: {exc})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: keeps the code from rotting")
    parser.add_argument("--out", help="report path (default: $GPU_CHECK_JSON, $OUT/gpu_check.json, "
                                      "benchmarks/gpu_check.json)")
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    args = parser.parse_args()
    dry = args.dry_run or os.environ.get("GPU_CHECK_DRY") == "1"
    try:
        import kvcluster  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - cannot start: say why in one line
        print(f"gpu_check: cannot import kvcluster ({type(exc).__name__}: {exc}); is the repo on PYTHONPATH?")
        return 2
    if not dry and not cuda():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check")
        return 0
    plan = dry_plan() if dry else full_plan(torch.cuda.get_device_name(0))
    path = report_path(args.out)
    names = [s for s in (args.only.split(",") if args.only else SECTIONS) if s in RUN]
    t0 = time.perf_counter()
    report: dict[str, Any] = {"check": "gpu_check (issue 9)", "device": plan.label,
                              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "environment": environment(plan), "plan": dataclasses.asdict(plan), "sections": {}}
    print(f"gpu_check on {plan.label}: torch {torch.__version__}, transformers {report['environment']['transformers']}"
          f", checksum kernel {report['environment']['checksum_kernel']}"
          f" -> {path}", flush=True)
    for name in names:
        report["sections"][name] = section = run_section(name, plan)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        write(report, path)
        print(summary_line(name, section), flush=True)
    print(f"gpu_check: {sum(s['status'] == 'ok' for s in report['sections'].values())}/{len(names)} sections ok "
          f"in {report['total_s']} s; report {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
