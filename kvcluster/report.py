"""`kvcluster report`: one trace, three charts and the numbers behind them.

- hit rate vs capacity: every policy at every capacity point (the `replay`
  sweep), or a saved `kvcluster replay --json` report;
- tier occupancy over time: one run per policy over a node's tiers, the blocks
  each tier holds sampled every N requests through the simulator's read-only
  `observe` hook (the cache logic is untouched);
- TTFT distribution: the cost model's projected TTFT of every request in those
  runs, plus the HBM-only and HBM+DRAM LRU reference deployments.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ConfigError
from .hierarchy import Hierarchy
from .replay import REFERENCE_DEPLOYMENTS, ReplayOptions, cost_model_for, plans, run_replay
from .simulator import PreparedTrace, replay

CHARTS = {
    "hit_rate_vs_capacity": "hit_rate_vs_capacity.png",
    "tier_occupancy": "tier_occupancy.png",
    "ttft_distribution": "ttft_distribution.png",
}
DEFAULT_SAMPLES = 200  # occupancy points per run when --sample-every is not given
TTFT_BINS = 40

ProgressFactory = Callable[[str], Callable[[int], None] | None]


@dataclass(frozen=True)
class ReportOptions:
    policies: tuple[str, ...] = ("lru", "bayes", "belady")
    capacity_blocks: tuple[int, ...] = ()
    capacity_frac: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2)
    tiers: str = "laptop-cpu"
    model: str = "llama-3.1-8b"
    node: str = "h100-node"
    prefetch_lead_s: float = 0.0
    sample_every: int | None = None

    def sweep(self) -> ReplayOptions:
        """The hit-rate-vs-capacity replays: a capacity list, one hbm tier."""
        return ReplayOptions(policies=self.policies, capacity_blocks=self.capacity_blocks,
                             capacity_frac=() if self.capacity_blocks else self.capacity_frac,
                             model=self.model, node=self.node, prefetch_lead_s=self.prefetch_lead_s)

    def over_tiers(self) -> ReplayOptions:
        """The occupancy and TTFT replays: every tier of the node."""
        return ReplayOptions(policies=self.policies, tiers=self.tiers, model=self.model,
                             prefetch_lead_s=self.prefetch_lead_s)

    def validate(self) -> None:
        """Every name and number, before any trace is read."""
        from .model_spec import load_model_spec
        from .tiers import load_node_tiers

        if not self.policies:
            raise ConfigError("--policies: give at least one policy")
        self.sweep().validate()
        self.over_tiers().validate()
        if self.sample_every is not None and self.sample_every <= 0:
            raise ConfigError("--sample-every must be a positive number of requests")
        for option, load, value in (("--tiers", load_node_tiers, self.tiers), ("--node", load_node_tiers, self.node),
                                    ("--model", load_model_spec, self.model)):
            try:
                load(value)
            except ConfigError as exc:
                raise ConfigError(f"{option}: {exc}") from None


class Sampler:
    """The simulator's `observe` hook: blocks per tier every `every` requests, and every request's TTFT."""

    def __init__(self, every: int, last: int, arrivals: tuple[float, ...]) -> None:
        self.every, self.last, self.arrivals = every, last, arrivals
        self.request: list[int] = []
        self.arrival_s: list[float] = []
        self.blocks: list[list[int]] = []
        self.ttft_s: list[float] = []

    def __call__(self, i: int, hierarchy: Hierarchy, ttft_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft_s.append(ttft_s)
        if i % self.every == 0 or i == self.last:
            self.request.append(i)
            self.arrival_s.append(self.arrivals[i])
            self.blocks.append([len(p) for p in hierarchy.policies])


def _tier_run(label: str, policy: str, plan, options: ReplayOptions, trace: PreparedTrace, every: int,
              progress: ProgressFactory) -> dict:
    sampler = Sampler(every, trace.requests - 1, trace.arrivals)
    result = replay(trace, policy, plan, cost=cost_model_for(options, plan, trace.block_size),
                    prefetch_lead_s=options.prefetch_lead_s if label == policy else 0.0,
                    observe=sampler, progress=progress(f"{label} over {options.tiers}"))
    row = result.to_dict()
    row["label"] = label
    if label != policy:
        row["deployment"] = label  # a reference deployment, as `kvcluster replay` names them
    row["occupancy"] = {
        "request": sampler.request,
        "arrival_s": sampler.arrival_s,
        "tiers": {t.name: {"capacity_blocks": t.capacity_blocks, "blocks": [s[k] for s in sampler.blocks]}
                  for k, t in enumerate(plan)},
    }
    row["ttft_histogram_s"] = ttft_histogram(sampler.ttft_s)
    row["ttft_s_values"] = sampler.ttft_s  # dropped before report.json is written; the chart reads it
    return row


def tier_runs(options: ReportOptions, trace: PreparedTrace, progress: ProgressFactory) -> dict:
    """Each policy over the node's tiers, then the reference deployments, with occupancy and TTFTs."""
    over = options.over_tiers()
    spec_bytes = _block_bytes(options.model, trace.block_size)
    full = plans(over, trace, spec_bytes)[0]
    every = options.sample_every or max(1, math.ceil(trace.requests / DEFAULT_SAMPLES))
    runs = [_tier_run(p, p, full, over, trace, every, progress) for p in options.policies]
    by_name = {t.name: t for t in full}
    for label, names in REFERENCE_DEPLOYMENTS:
        plan = [by_name[n] for n in names if n in by_name]
        if plan:
            runs.append(_tier_run(label, "lru", plan, over, trace, every, progress))
    return {"tiers": options.tiers, "sample_every": every, "runs": runs}


def _block_bytes(model: str, block_size: int) -> int:
    from .model_spec import load_model_spec
    from .sizing import size_model

    return size_model(load_model_spec(model)).bytes_per_token * block_size


def ttft_histogram(values: list[float], bins: int = TTFT_BINS) -> dict:
    """Summary and log-spaced histogram of TTFTs in seconds (zeros counted apart: their log is undefined)."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    positive = [v for v in ordered if v > 0]
    out = {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9),
           "p99": pick(0.99), "max": ordered[-1], "zeros": len(ordered) - len(positive)}
    if positive:
        lo, hi = math.log10(positive[0]), math.log10(positive[-1])
        hi = max(hi, lo + 1e-9)
        edges = [10 ** (lo + (hi - lo) * k / bins) for k in range(bins + 1)]
        counts = [0] * bins
        for v in positive:
            counts[min(bins - 1, int((math.log10(v) - lo) / (hi - lo) * bins))] += 1
        out["edges_s"], out["counts"] = edges, counts
    return out


def load_replay_json(path: str) -> dict:
    """A saved `kvcluster replay --json` report; errors name the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--replay-json: no such file {path!r}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--replay-json: malformed replay report {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--replay-json {path}: field (top level): expected the object `kvcluster replay --json` prints")
    for name in ("trace", "requests", "block_refs", "infinite_hit_rate", "results"):
        if name not in data:
            raise ConfigError(f"--replay-json {path}: field {name}: missing (not a `kvcluster replay --json` report)")
    if not isinstance(data["results"], list) or not data["results"]:
        raise ConfigError(f"--replay-json {path}: field results: expected a non-empty list")
    for i, row in enumerate(data["results"]):
        for name, kind in (("policy", str), ("capacity_blocks", int), ("hit_rate", (int, float))):
            if not isinstance(row, dict) or not isinstance(row.get(name), kind):
                raise ConfigError(f"--replay-json {path}: field results.{i}.{name}: missing or not a {getattr(kind, '__name__', 'number')}")
    return data


def build_report(options: ReportOptions | None, trace: PreparedTrace | None, saved: dict | None = None,
                 progress: ProgressFactory = lambda label: None) -> dict:
    """The sweep (run, or `saved`) and, with a trace, the runs over the node's tiers."""
    if trace is None and saved is None:
        raise ConfigError("give a TRACE, or --replay-json with a saved replay report")
    out: dict = {}
    if options is not None:
        options.validate()
    if saved is not None:
        out["hit_rate_vs_capacity"] = {**saved, "source": "saved"}
    else:
        sweep = run_replay(options.sweep(), trace, progress)
        out["hit_rate_vs_capacity"] = {**sweep, "source": "replayed"}
    if trace is not None:
        out.update(trace=trace.name, requests=trace.requests, block_refs=trace.block_refs,
                   unique_blocks=trace.unique_blocks, block_size=trace.block_size, model=options.model)
        out["over_tiers"] = tier_runs(options, trace, progress)
    else:
        out.update(trace=saved["trace"], requests=saved["requests"], block_refs=saved["block_refs"])
    return out


def prepare_out(out_dir: str) -> Path:
    """The output directory, created if missing; a file in the way is an error naming --out."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out_dir!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out: cannot create {out_dir!r}: {exc.strerror or exc}") from None
    return out


def write_report(report: dict, out_dir: str) -> dict[str, str]:
    """The charts the report has data for, and report.json; returns name -> path."""
    from . import plots

    out = prepare_out(out_dir)
    files = {"hit_rate_vs_capacity": str(out / CHARTS["hit_rate_vs_capacity"])}
    plots.plot_hit_rates(report["hit_rate_vs_capacity"], files["hit_rate_vs_capacity"])
    over = report.get("over_tiers")
    if over is not None:
        files["tier_occupancy"] = str(out / CHARTS["tier_occupancy"])
        files["ttft_distribution"] = str(out / CHARTS["ttft_distribution"])
        title = f"{report['trace']} on {over['tiers']} ({report['model']})"
        plots.plot_tier_occupancy(over["runs"], files["tier_occupancy"], title)
        plots.plot_ttft_distribution(over["runs"], files["ttft_distribution"], title)
        for run in over["runs"]:
            run.pop("ttft_s_values", None)
    files["report"] = str(out / "report.json")
    report["files"] = files
    Path(files["report"]).write_text(json.dumps(report, indent=1) + "\n")
    return files
