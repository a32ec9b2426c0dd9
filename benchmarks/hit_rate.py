"""Hit rate of every policy on every shared trace at 2/5/10/20% of unique blocks.

Reference in the same run: LRU (the floor to beat) and Belady's MIN (the offline
near-bound). Each trace is scored on its validation part, the figure to quote, then on its tuning part and whole
(`--parts`; kvcluster/traces/split.py): defaults are chosen on the tuning parts only, so a figure measured there
says how well they fit, not how they carry over. Prints a markdown table with the share of the LRU->Belady gap that
each predictive policy (`bayes`, `bayes-v1`) closes, or with `--json` only the whole report, as JSON, on stdout.
`--answers-at-finish` replays the traces in the vLLM connector's order: the engine stores a request's blocks
before it finishes, and the connector tells the policy how the answer ended (its length, and for kvcluster's
front whether it ended the turn) once it has. `--without-answers` drops the answers altogether.
ShareGPT and SWE-agent carry no times: the loader draws them, seeded (`--clock-seed`, default 0: Poisson
conversation starts, log-normal think times fitted to Claude Code, docs/traces.md); `--fixed-clock` times them
as before (conversations 5 s apart, turns 30 s apart), which lets a policy foresee every next turn.

    .venv/bin/python benchmarks/hit_rate.py [--json] [--sharegpt-records N] [--policies lru,bayes,...]
        [--traces mooncake,claude-code,sharegpt,swe-agent] [--parts validation,tune,all] [--fixed-clock] [--clock-seed N]
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
from kvcluster.traces.split import PART_NAMES, check_part, part
from kvcluster.traces.text import SESSION_GAP_S, TURN_GAP_S

FRACTIONS = (0.02, 0.05, 0.10, 0.20)
SHAREGPT_RECORDS = None  # ShareGPT entries tokenized by default: all of them (both parts)
SMOKE_RECORDS, SMOKE_REQUESTS = 6, 30  # --smoke: the code runs end to end, on traces too small for figures
REPORTED_PART = "validation"  # the part whose figures are quoted (README, RESULTS, docs)
PARTS = (REPORTED_PART, "tune", "all")  # scored by default, in this order


TRACES = ("mooncake", "claude-code", "sharegpt", "swe-agent")
UNTIMED = ("sharegpt", "swe-agent")  # timed by the loader's clock


def traces(sharegpt_records: int | None = SHAREGPT_RECORDS,
           clock: TraceClock | None = None) -> list[tuple[str, str, dict]]:
    """(label, path, load_trace keywords) of every shared trace, whole: split it with `load_parts`; `clock` times
    those without times (None: the loader's default, seeded random); `sharegpt_records` caps ShareGPT's lines
    (None: the whole file)."""
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


def load_parts(path: str, parts: tuple[str, ...] = (REPORTED_PART,), smoke: bool = False,
               **kwargs) -> list[tuple[str, Trace]]:
    """(part, trace) for each of `parts` of the trace at `path`, loaded once and split by session
    (kvcluster/traces/split.py); with `smoke`, each part's first SMOKE_REQUESTS requests of the first
    SMOKE_RECORDS records."""
    whole = load(path, **kwargs) if not smoke else load_trace(
        path, **{**kwargs, "max_records": min(kwargs.get("max_records") or SMOKE_RECORDS, SMOKE_RECORDS)})
    out = []
    for which in parts:
        trace = part(whole, which, "--parts")
        out.append((which, dataclasses.replace(trace, requests=trace.requests[:SMOKE_REQUESTS]) if smoke else trace))
    return out


def parse_parts(text: str) -> tuple[str, ...]:
    """--parts: a comma-separated list of parts, each named once."""
    chosen = tuple(text.split(","))
    for which in chosen:
        check_part(which, "--parts")
    if len(set(chosen)) != len(chosen):
        raise TraceError(f"--parts: {text} names a part twice")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the full report, as JSON, on stdout")
    parser.add_argument("--sharegpt-records", type=int, default=SHAREGPT_RECORDS,
                        help="ShareGPT entries to tokenize (default: all)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts of each trace to score, of {', '.join(PART_NAMES)} (default: "
                             f"{','.join(PARTS)}; {REPORTED_PART} is the figure to quote)")
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
    if args.sharegpt_records is not None and args.sharegpt_records < 1:
        parser.error("--sharegpt-records must be >= 1")
    try:
        parts = parse_parts(args.parts)
    except TraceError as err:
        parser.error(str(err))
    chosen = args.traces.split(",")
    if not chosen or any(t not in TRACES for t in chosen):
        parser.error(f"--traces: choose from {', '.join(TRACES)}, got {args.traces}")
    learnt = [p for p in ("bayes", "bayes-v1") if p in policies]
    args.clock = clock_from(args)
    report = []
    if not args.json:
        print("| trace | part | capacity | blocks | " + " | ".join(policies)
              + "".join(f" | {p} gap closed" for p in learnt) + " |")
        print("|---|---|---|---|" + "---|" * (len(policies) + len(learnt)))
    for label, path, kwargs in traces(args.sharegpt_records, args.clock):
        if label not in chosen:
            continue
        t0 = time.perf_counter()
        try:
            split = load_parts(path, parts, args.smoke, **kwargs)
        except TraceError as err:  # missing or malformed shared data: one line, not a traceback
            print(f"hit_rate: {err}", file=sys.stderr)
            return 2
        load_s = time.perf_counter() - t0
        for which, trace in split:
            report += score(label, which, trace, policies, learnt, args, load_s)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def score(label: str, which: str, trace: Trace, policies: list[str], learnt: list[str], args: argparse.Namespace,
          load_s: float) -> list[dict]:
    """Rows of one part of one trace at every fraction (printed as table rows unless --json)."""
    prepared = prepare(trace)
    if args.without_answers:
        prepared = dataclasses.replace(prepared, finishes=(), output_tokens=())
    if not prepared.requests:
        print(f"<!-- {label} ({which}): no requests, not scored -->", file=sys.stderr)
        return []
    infinite = prepared.infinite_hit_rate()
    sessions = len(set(prepared.sessions))
    print(f"<!-- {label} ({which}): {sessions} sessions, {prepared.requests} requests, {prepared.block_refs} refs, "
          f"{prepared.unique_blocks} unique, infinite {infinite:.4f}, loaded in {load_s:.1f} s"
          f"{', times ' + args.clock.describe() if label in UNTIMED else ''} -->", file=sys.stderr)
    rows = []
    for frac in FRACTIONS:
        cap = max(1, round(frac * prepared.unique_blocks))
        rates = {p: replay(prepared, p, [TierPlan("hbm", cap)], answers_at_finish=args.answers_at_finish).hit_rate
                 for p in policies}
        gap = rates.get("belady", 0) - rates.get("lru", 0)
        closed = {p: (rates[p] - rates.get("lru", 0)) / gap if gap > 0.005 else None for p in learnt}
        rows.append({"trace": label, "part": which, "sessions": sessions, "requests": prepared.requests,
                     "fraction": frac, "capacity_blocks": cap, "infinite": infinite, "hit_rate": rates,
                     "gap_closed": closed})
        if not args.json:
            cells = " | ".join(f"{rates[p]:.4f}" for p in policies)
            shown = "".join(" | n/a (gap < 0.005)" if c is None else f" | {c:.0%}" for c in closed.values())
            print(f"| {label} | {which} | {frac:.0%} | {cap:,} | {cells}{shown} |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
