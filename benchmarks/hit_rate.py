"""Hit rate of every policy on every shared trace at 2/5/10/20% of unique blocks.

Reference in the same run: LRU (the floor to beat) and Belady's MIN (the offline
near-bound). Prints a markdown table with the share of the LRU->Belady gap that
each predictive policy (`bayes`, `bayes-v1`) closes, or with `--json` only the whole report, as JSON, on stdout.
`--answers-at-finish` replays the traces in the vLLM connector's order: the engine stores a request's blocks
before it finishes, and the connector tells the policy how the answer ended (its length, and for kvcluster's
front whether it ended the turn) once it has. `--without-answers` drops the answers altogether.
ShareGPT and SWE-agent carry no times: the loader draws them, seeded (`--clock-seed`, default 0: Poisson
conversation starts, log-normal think times fitted to Claude Code, docs/traces.md); `--fixed-clock` times them
as before (conversations 5 s apart, turns 30 s apart), which lets a policy foresee every next turn.

    .venv/bin/python benchmarks/hit_rate.py [--json] [--sharegpt-records N] [--policies lru,bayes,...]
        [--traces mooncake,claude-code,sharegpt,swe-agent] [--fixed-clock] [--clock-seed N]
        [--answers-at-finish | --without-answers] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvcluster.errors import TraceError
from kvcluster.paths import shared_data_dir
from kvcluster.policies.registry import policy_names
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import prepare, replay
from kvcluster.traces import Trace, TraceClock, load_trace
from kvcluster.traces.text import SESSION_GAP_S, TURN_GAP_S

FRACTIONS = (0.02, 0.05, 0.10, 0.20)
SHAREGPT_RECORDS = 1000  # ShareGPT entries tokenized by default: the ones the defaults were tuned on
SMOKE_RECORDS, SMOKE_REQUESTS = 2, 30  # --smoke: the code runs end to end, on traces too small for figures


TRACES = ("mooncake", "claude-code", "sharegpt", "swe-agent")


def traces(sharegpt_records: int, clock: TraceClock | None = None) -> list[tuple[str, str, dict]]:
    """(label, path, load_trace keywords) of every shared trace; `clock` times those without times (None: the
    loader's default, seeded random)."""
    data = shared_data_dir()
    timing = {} if clock is None else {"clock": clock}
    return [
        ("mooncake", str(data / "mooncake" / "synthetic_trace.jsonl"), {}),
        ("claude-code", str(data / "weka_claude_code_traces"), {}),
        ("sharegpt", str(data / "sharegpt_v3" / "sharegpt_v3_subset.jsonl"),
         {"max_records": sharegpt_records, **timing}),
        ("swe-agent", str(data / "swe_agent_trajectories"), dict(timing)),
    ]


def add_clock_options(parser: argparse.ArgumentParser) -> None:
    """--fixed-clock and --clock-seed, as `kvcluster replay` has them: how traces without times are timed."""
    parser.add_argument("--fixed-clock", action="store_true",
                        help=f"time the traces without times (sharegpt, swe-agent) by the old fixed clock: "
                             f"conversations {SESSION_GAP_S:g} s apart, turns {TURN_GAP_S:g} s apart (default: "
                             f"seeded Poisson arrivals and log-normal think times, docs/traces.md)")
    parser.add_argument("--clock-seed", type=int, default=0, metavar="N",
                        help="seed of the random clock of traces without times (default 0)")


def clock_from(args: argparse.Namespace) -> TraceClock:
    return TraceClock(fixed=args.fixed_clock, seed=args.clock_seed)


def load(path: str, smoke: bool = False, **kwargs) -> Trace:
    """`load_trace(path, **kwargs)`; with `smoke`, the first SMOKE_REQUESTS requests of its first SMOKE_RECORDS
    records (one Claude Code session alone is ~100k block references)."""
    if not smoke:
        return load_trace(path, **kwargs)
    trace = load_trace(path, **{**kwargs, "max_records": min(kwargs.get("max_records") or SMOKE_RECORDS,
                                                            SMOKE_RECORDS)})
    return dataclasses.replace(trace, requests=trace.requests[:SMOKE_REQUESTS])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the full report, as JSON, on stdout")
    parser.add_argument("--sharegpt-records", type=int, default=SHAREGPT_RECORDS, help="ShareGPT entries to tokenize")
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    add_clock_options(parser)
    answers = parser.add_mutually_exclusive_group()
    answers.add_argument("--without-answers", action="store_true",
                         help="drop every request's finish reason and answer length")
    answers.add_argument("--answers-at-finish", action="store_true",
                         help="tell each request's answer after its blocks are stored (the vLLM connector's order)")
    parser.add_argument("--smoke", action="store_true", help="tiny slices of the traces: checks the code runs")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)}; choose from {', '.join(policy_names())}")
    if args.sharegpt_records < 1:
        parser.error("--sharegpt-records must be >= 1")
    chosen = args.traces.split(",")
    if not chosen or any(t not in TRACES for t in chosen):
        parser.error(f"--traces: choose from {', '.join(TRACES)}, got {args.traces}")
    learnt = [p for p in ("bayes", "bayes-v1") if p in policies]
    report = []
    if not args.json:
        print("| trace | capacity | blocks | " + " | ".join(policies)
              + "".join(f" | {p} gap closed" for p in learnt) + " |")
        print("|---|---|---|" + "---|" * (len(policies) + len(learnt)))
    for label, path, kwargs in traces(args.sharegpt_records, clock_from(args)):
        if label not in chosen:
            continue
        t0 = time.perf_counter()
        try:
            prepared = prepare(load(path, args.smoke, **kwargs))
            if args.without_answers:
                prepared = dataclasses.replace(prepared, finishes=(), output_tokens=())
        except TraceError as err:  # missing or malformed shared data: one line, not a traceback
            print(f"hit_rate: {err}", file=sys.stderr)
            return 2
        load_s = time.perf_counter() - t0
        infinite = prepared.infinite_hit_rate()
        timing = f", times {kwargs['clock'].describe()}" if "clock" in kwargs else ""
        print(f"<!-- {label}: {prepared.requests} requests, {prepared.block_refs} refs, {prepared.unique_blocks} unique, "
              f"infinite {infinite:.4f}, loaded in {load_s:.1f} s{timing} -->", file=sys.stderr)
        for frac in FRACTIONS:
            cap = max(1, round(frac * prepared.unique_blocks))
            rates = {p: replay(prepared, p, [TierPlan("hbm", cap)], answers_at_finish=args.answers_at_finish).hit_rate
                     for p in policies}
            gap = rates.get("belady", 0) - rates.get("lru", 0)
            closed = {p: (rates[p] - rates.get("lru", 0)) / gap if gap > 0.005 else None for p in learnt}
            report.append({"trace": label, "fraction": frac, "capacity_blocks": cap, "infinite": infinite,
                           "hit_rate": rates, "gap_closed": closed})
            if not args.json:
                cells = " | ".join(f"{rates[p]:.4f}" for p in policies)
                shown = "".join(" | n/a (gap < 0.005)" if c is None else f" | {c:.0%}" for c in closed.values())
                print(f"| {label} | {frac:.0%} | {cap:,} | {cells}{shown} |", flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
