"""`kvcluster` command line: size, capacity, replay and report, and the cache actors of a Ray cluster.

User mistakes (bad names, malformed files, bad numbers) print one line and
exit 2; nothing a user types produces a traceback. Progress bars go to stderr,
only when it is a terminal and the output is not --json.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from .dtypes import DTYPE_CHOICES
from .errors import ConfigError, KvclusterError

GIB = 1 << 30


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    """argparse type for counts and sizes: a clear error naming the flag instead of a later crash."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, row)) for row in rows]
    return "\n".join(lines)


def _cmd_size(args: argparse.Namespace) -> int:
    from .model_spec import load_model_spec
    from .sizing import size_model

    spec = load_model_spec(args.model)
    report = size_model(spec, dtype=args.dtype, context=args.context, weights_dtype=args.weights_dtype)
    hbm = int(args.hbm_gib * GIB) if args.hbm_gib is not None else None
    data = report.to_dict(hbm)
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"{report.model} ({report.variant}), KV dtype {report.dtype}, context {report.context:,} tokens")
    rows = [
        [l.index, l.kind, l.kv_heads, l.head_dim, l.bytes_per_token, l.tokens_kept, l.fixed_bytes,
         _human_bytes(l.bytes_at_context), l.naive_bytes_per_token]
        for l in report.layers
    ]
    print(_table(rows, ["layer", "kind", "kv_heads", "dim", "B/token", "kept", "state B", "at context", "naive B/tok"]))
    print(f"bytes per token:        {report.bytes_per_token:,}  (naive {report.naive_bytes_per_token:,})")
    print(f"bytes per sequence:     {_human_bytes(report.bytes_per_sequence)}  (naive {_human_bytes(report.naive_bytes_per_sequence)})")
    print(f"overprovision ratio:    {report.overprovision_ratio:.2f}x")
    print(f"parameters:             {report.num_parameters / 1e9:.3f} B  ({_human_bytes(report.weight_bytes)} of weights)")
    if hbm is not None:
        h = data["hbm"]
        print(f"HBM {args.hbm_gib:g} GiB: {h['max_sequences']:,} sequences exact vs {h['naive_max_sequences']:,} naive"
              f"  (batch gain {h['batch_gain']}x)")
    return 0


def _cmd_capacity(args: argparse.Namespace) -> int:
    from .capacity import node_capacity
    from .model_spec import load_model_spec
    from .sizing import size_model
    from .tiers import load_node_tiers

    node = load_node_tiers(args.tiers)
    report = size_model(load_model_spec(args.model), dtype=args.dtype, context=args.context)
    cap = node_capacity(report, node)
    if args.json:
        print(json.dumps(cap.to_dict()))
        return 0
    print(f"{cap.model} on {cap.node}: {cap.bytes_per_token:,} B/token ({cap.dtype}), sequences of {cap.context:,} tokens")
    if not cap.weights_fit_in_hbm:
        print("warning: the weights do not fit in HBM; the hbm tier holds no KV")
    rows = [[t.name, t.medium[:48], _human_bytes(t.bytes), f"{t.tokens:,}", f"{t.sequences:,}"] for t in cap.tiers]
    print(_table(rows, ["tier", "medium", "KV bytes", "tokens", "sequences"]))
    print(f"total: {_human_bytes(cap.total_bytes)}, {cap.total_tokens:,} tokens")
    return 0


def _csv(kind: Callable[[str], object]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _show_progress(args: argparse.Namespace) -> bool:
    """--progress / --no-progress if given; else on when stderr is a terminal and stdout is not --json."""
    if args.progress is not None:
        return args.progress
    return sys.stderr.isatty() and not getattr(args, "json", False)


def _progress_factory(enabled: bool, total: int):
    """A tqdm bar per replay on stderr when enabled; nothing otherwise."""
    if not enabled:
        return lambda label: None
    from tqdm import tqdm

    def factory(label: str):
        bar = tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr, mininterval=0.5)
        return bar.update

    return factory


def _load_trace(args: argparse.Namespace):
    """The trace of `replay` / `report`, with its skipped records listed on stderr."""
    from .traces import TraceClock, load_trace
    from .traces.split import part

    trace = load_trace(args.trace, format=args.format, block_size=args.block_size, strict=args.strict,
                       max_records=args.max_records, clock=TraceClock(fixed=args.fixed_clock, seed=args.clock_seed))
    trace = part(trace, args.part, "--part")
    for line in trace.skipped[:5]:
        print(f"skipped {line}", file=sys.stderr)
    if len(trace.skipped) > 5:
        print(f"skipped {len(trace.skipped) - 5} more malformed records", file=sys.stderr)
    return trace


def _cmd_replay(args: argparse.Namespace) -> int:
    from .replay import ReplayOptions, run_replay
    from .simulator import prepare
    from .traces import UNTIMED_FORMATS

    policies = args.policies or ((args.policy,) if args.policy else ("lru", "bayes", "belady"))
    if args.live:
        return _cmd_replay_live(args, tuple(policies))
    tier_flag = _tier_split_flag(args)
    if tier_flag:
        raise ConfigError(f"{tier_flag} splits the tiers of a --live replay, one value per tier; the simulator sweeps "
                          f"capacities with --capacity-frac/--capacity-blocks, or runs a node's own tiers with "
                          f"--tiers/--topology")
    if args.topology and args.model:
        raise ConfigError("--model: with --topology the cluster file's model sizes the blocks")
    options = ReplayOptions(
        policies=tuple(policies),
        capacity_blocks=args.capacity_blocks or (),
        capacity_frac=args.capacity_frac or (),
        tiers=args.tiers,
        topology=args.topology,
        model=args.model or "llama-3.1-8b",
        node=args.node,
        prefetch_lead_s=args.prefetch_lead_s,
        calibration_horizon_s=args.calibration or 0.0,
        lookahead_s=args.lookahead_s,
        answers_at_finish=args.answers_at_finish,
    )
    options.validate()
    trace = _load_trace(args)
    prepared = prepare(trace)
    progress = _progress_factory(_show_progress(args), prepared.requests)
    report = run_replay(options, prepared, progress)
    report["format"] = trace.format
    report["skipped_records"] = len(trace.skipped)
    report["clock"] = _clock_note(args, trace.format)
    report["part"] = args.part
    if args.plot:
        from .plots import plot_hit_rates

        plot_hit_rates(report, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['trace']} ({trace.format}): {report['requests']:,} requests, {report['block_refs']:,} block refs, "
          f"{report['unique_blocks']:,} unique blocks of {report['block_size']} tokens; "
          f"infinite-cache hit rate {report['infinite_hit_rate']:.4f}")
    if trace.format in UNTIMED_FORMATS:
        print(f"times drawn: {report['clock']}")
    rows = [
        [r.get("deployment", r["policy"]), f"{r['capacity_blocks']:,}", f"{r['hit_rate']:.4f}",
         " ".join(f"{k}={v:.3f}" for k, v in r["per_tier"].items()),
         f"{r['projected_ttft_s']['mean'] * 1e3:.1f}" if r.get("projected_ttft_s") else "-",
         f"{r['cost']['usd_per_million_prompt_tokens']:.4f}" if r.get("cost") else "-", f"{r['refs_per_s']:,}"]
        + ([f"{r['lookahead']['hit_rate']:.4f}" if "lookahead" in r else "-"] if args.lookahead_s else [])
        for r in report["results"] + report.get("reference_deployments", [])
    ]
    print(_table(rows, ["policy", "capacity", "hit rate", "per tier", "TTFT ms", "USD/M prompt tok", "refs/s"]
                 + ([f"hit, {args.lookahead_s:g} s look-ahead"] if args.lookahead_s else [])))
    if report.get("unpriced"):
        print("cost per million prompt tokens: not priced; the node's file lacks " + ", ".join(report["unpriced"]))
    if "calibration" in report:
        cal = report["calibration"]
        print(f"\nreuse-gap predictor, P(reuse within {cal['horizon_s']:g} s) over {cal['references']:,} refs: "
              f"Brier {cal['brier']:.4f} (base rate alone {cal['brier_base_rate']:.4f})")
        print(_table([[r["decile"], f"{r['count']:,}", f"{r['predicted']:.3f}", f"{r['observed']:.3f}"]
                      for r in cal["reliability"]], ["predicted", "refs", "mean predicted", "observed"]))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _clock_note(args: argparse.Namespace, format: str) -> str:
    """How the trace's times came about: the file's own, or the clock that drew them."""
    from .traces import UNTIMED_FORMATS, TraceClock

    if format not in UNTIMED_FORMATS:
        return "the trace's own times"
    return TraceClock(fixed=args.fixed_clock, seed=args.clock_seed).describe()


REPLAY_DRIVERS_GROUP = "kvcluster.replay_drivers"  # entry points: name -> replay function (live: the Ray side)


def _tier_split_flag(args: argparse.Namespace) -> str | None:
    """The per-tier flag given, if any (--tier-blocks or --tier-fracs)."""
    return "--tier-blocks" if args.tier_blocks else "--tier-fracs" if args.tier_fracs else None


def _live_tier_labels(cluster: str) -> tuple[str, list[str]]:
    """The first node of `cluster` and its tiers, fastest first, as a live replay runs them."""
    from .cluster_config import load_cluster_config
    from .cluster_control import node_chains

    cfg = load_cluster_config(cluster)
    node = cfg.nodes[0].name
    return node, [t.label for t in node_chains(cfg)[node]]


def _cmd_replay_live(args: argparse.Namespace, policies: tuple[str, ...]) -> int:
    """`replay --live`: the driver comes from the cluster package by entry point, so the core never imports Ray."""
    from importlib.metadata import entry_points

    from .policies.registry import POLICIES, policy_names
    from .simulator import prepare

    for flag, value in (("--tiers", args.tiers), ("--topology", args.topology), ("--lookahead-s", args.lookahead_s),
                        ("--calibration", args.calibration), ("--plot", args.plot)):
        if value:
            raise ConfigError(f"{flag} is a simulator option; --live takes --cluster, and --tier-fracs or "
                              f"--tier-blocks per tier")
    sweep = "--capacity-blocks" if args.capacity_blocks else "--capacity-frac" if args.capacity_frac else None
    if sweep:
        raise ConfigError(f"{sweep} sweeps the capacity of the simulator's single tier, one run per value; a --live "
                          f"replay runs the cluster's tiers: give their sizes with --tier-fracs F,F,... or "
                          f"--tier-blocks N,N,... (one value per tier, fastest first)")
    for name in policies:
        if name not in policy_names():
            raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
        if POLICIES[name].offline:
            raise ConfigError(f"--policy {name}: an offline policy reads the future; a live cluster cannot run it")
    split = _tier_split_flag(args)
    if split:
        node, labels = _live_tier_labels(args.cluster)
        values = args.tier_blocks or args.tier_fracs
        if len(values) != len(labels):
            raise ConfigError(f"{split}: give one value per tier of node {node} ({', '.join(labels)}), fastest "
                              f"first; got {len(values)}")
    if any(f <= 0 or f > 1 for f in args.tier_fracs or ()):
        raise ConfigError("--tier-fracs values must be in (0, 1]")
    if any(n < 1 for n in args.tier_blocks or ()):
        raise ConfigError("--tier-blocks values must be >= 1 (every live tier holds at least one block)")
    driver = next((e for e in entry_points(group=REPLAY_DRIVERS_GROUP) if e.name == "live"), None)
    try:
        replay_live = driver.load() if driver is not None else None
    except ImportError:
        replay_live = None
    if replay_live is None:
        raise ConfigError("--live needs the cluster side: pip install 'kvcluster[cluster]'")
    trace = _load_trace(args)
    prepared = prepare(trace)
    capacities = list(args.tier_blocks) if args.tier_blocks else \
        [max(1, round(f * prepared.unique_blocks)) for f in args.tier_fracs] if args.tier_fracs else None
    runs = []
    for policy in policies:
        runs.append(replay_live(prepared, policy, args.cluster, capacities, args.live_block_bytes,
                                _progress_factory(_show_progress(args), prepared.requests)(f"{policy} live"),
                                prefetch_lead_s=args.prefetch_lead_s,
                                answers_at_finish=args.answers_at_finish))
    report = {"trace": prepared.name, "requests": prepared.requests, "block_refs": prepared.block_refs,
              "unique_blocks": prepared.unique_blocks, "block_size": prepared.block_size, "driver": "live",
              "cluster": args.cluster, "block_bytes": args.live_block_bytes,
              "results": [r["live"] for r in runs], "simulated": [r["simulated"] for r in runs],
              "wrong_bytes": sum(r["wrong_bytes"] for r in runs),
              "max_abs_diff": max(r["max_abs_diff"] for r in runs), "format": trace.format,
              "skipped_records": len(trace.skipped)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['trace']} ({trace.format}): {report['requests']:,} requests, {report['block_refs']:,} block "
          f"refs, live through cluster {args.cluster!r} ({args.live_block_bytes}-byte blocks)")
    rows = [[live["policy"], f"{live['capacity_blocks']:,}", f"{live['hit_rate']:.4f}", f"{sim['hit_rate']:.4f}",
             " ".join(f"{k}={v:.3f}" for k, v in live["per_tier"].items()), f"{live['refs_per_s']:,}"]
            for live, sim in zip(report["results"], report["simulated"])]
    print(_table(rows, ["policy", "capacity", "live hit rate", "simulated", "live per tier", "refs/s"]))
    print(f"largest live-simulated difference, overall or per tier: {report['max_abs_diff']:.4f}; "
          f"hits with wrong bytes: {report['wrong_bytes']}")
    return 0


EPILOG = """\
examples:
  kvcluster size deepseek-v3 --dtype bf16 --context 32768 --hbm-gib 1050.5
  kvcluster capacity llama-3.1-8b --tiers h100-node --json
  kvcluster replay TRACE --policies lru,arc,bayes,belady --capacity-frac 0.02,0.05,0.1 --plot hit_rate.png
  kvcluster replay TRACE --policy bayes --tiers h100-node --prefetch-lead-s 2 --json
  kvcluster report TRACE --policies lru,bayes --capacity-frac 0.02,0.05,0.1 --tiers laptop-cpu \\
      --model kvcluster-tiny-llama --out report/
  kvcluster cluster up two-workers --address HEAD_IP:6379

TRACE is a trace file or directory, e.g. ../shared/data/mooncake/synthetic_trace.jsonl.
Names (models, tiers, clusters) are files under configs/; any path works too.
Bad input prints one line `kvcluster COMMAND: error: ...` and exits 2.
"""

_TRACE_HELP = "a trace file or directory (Mooncake, Bailian, Claude Code, ShareGPT, LMSYS, SWE-agent, Azure)"


def _trace_options(p: argparse.ArgumentParser, formats: Sequence[str]) -> None:
    """Options shared by `replay` and `report`: how the trace is read."""
    from .traces import UNTIMED_FORMATS
    from .traces.split import PART_NAMES
    from .traces.text import SESSION_GAP_S, TURN_GAP_S

    p.add_argument("--format", default="auto", metavar="FORMAT",
                   help=f"trace format: auto (sniffed, the default) or one of {', '.join(formats)}")
    p.add_argument("--block-size", type=positive_int, metavar="TOKENS",
                   help="tokens per block for text traces (hash traces fix their own)")
    p.add_argument("--max-records", type=positive_int, metavar="N",
                   help="read at most N records (lines; session files for claude-code, trajectories for swe-agent)")
    p.add_argument("--strict", action="store_true", help="fail on the first malformed trace record instead of "
                                                         "skipping it (skipped records are listed on stderr)")
    p.add_argument("--part", choices=PART_NAMES, default="all",
                   help="replay one part of the trace, split by session (docs/traces.md#tuning-and-validation-parts):"
                        " tune (what defaults are chosen on), validation (what figures are quoted on) or all "
                        "(default)")
    p.add_argument("--fixed-clock", action="store_true",
                   help=f"time traces without times ({', '.join(UNTIMED_FORMATS)}) by the old fixed clock: "
                        f"conversations {SESSION_GAP_S:g} s apart, turns {TURN_GAP_S:g} s apart (default: seeded "
                        "Poisson arrivals and log-normal think times, docs/traces.md)")
    p.add_argument("--clock-seed", type=int, default=0, metavar="N",
                   help="seed of the random clock of traces without times (default 0: same seed, same trace)")


def _progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: only when stderr is a terminal and without --json)")


def _capacity_options(p: argparse.ArgumentParser, frac_default: str = "") -> argparse._MutuallyExclusiveGroup:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--capacity-blocks", type=_csv(int), metavar="N[,N...]",
                       help="capacities to sweep: HBM capacity in blocks, one run per value")
    group.add_argument("--capacity-frac", type=_csv(float), metavar="F[,F...]",
                       help="capacities to sweep: HBM capacity as a fraction (0, 1] of the trace's unique blocks, "
                            "one run per value" + (f" (default {frac_default})" if frac_default else ""))
    return group


def _subparser(sub: argparse._SubParsersAction, name: str, help: str, description: str, examples: str = ""):
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines()) if examples else None
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcluster")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from .policies.registry import policy_names
    from .traces import TRACE_FORMATS

    policies = ", ".join(policy_names())
    parser = _Parser(prog="kvcluster", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                     description="Cluster-scale KV-cache manager for LLM serving: exact KV sizing, six memory "
                                 "tiers,\ntrace replay of eviction policies, and the cache actors of a Ray cluster.")
    parser.add_argument("--version", action="version", version=f"kvcluster {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, title="commands",
                                metavar="COMMAND")

    size = _subparser(sub, "size", "exact KV bytes per token and per sequence for a model",
                      "Per layer: attention kind (full, sliding, mla, linear) and exact KV bytes per token;\n"
                      "per sequence at a context, against the naive full-MHA figure.",
                      "kvcluster size llama-3.1-8b\nkvcluster size deepseek-v3 --dtype bf16 --hbm-gib 1050.5 --json\n"
                      "kvcluster size path/to/config.json")
    size.add_argument("model", help="a name under configs/models, or a path to a HF config.json / checkpoint dir")
    size.add_argument("--dtype", choices=DTYPE_CHOICES, help="KV dtype (default: the model's dtype)")
    size.add_argument("--weights-dtype", choices=DTYPE_CHOICES, help="weight dtype (default: as published)")
    size.add_argument("--context", type=positive_int, metavar="TOKENS",
                      help="tokens per sequence (default: min(max positions, 32768))")
    size.add_argument("--hbm-gib", type=_non_negative_float, metavar="GIB",
                      help="HBM for weights + KV; reports the maximum concurrent sequences")
    size.add_argument("--json", action="store_true", help="print one JSON object")
    size.set_defaults(func=_cmd_size)

    capacity = _subparser(sub, "capacity", "KV bytes and tokens a node's six tiers hold for a model",
                          "KV bytes, tokens and sequences each tier of a node holds for one model\n"
                          "(HBM after the weights).",
                          "kvcluster capacity llama-3.1-8b --tiers h100-node\n"
                          "kvcluster capacity kvcluster-tiny-llama --tiers laptop-cpu --json")
    capacity.add_argument("model", help="a name under configs/models, or a config path")
    capacity.add_argument("--tiers", required=True, help="a tiers YAML (path, or a name under configs/tiers)")
    capacity.add_argument("--dtype", choices=DTYPE_CHOICES, help="KV dtype (default: the model's dtype)")
    capacity.add_argument("--context", type=positive_int, metavar="TOKENS",
                          help="tokens per sequence for the sequences column")
    capacity.add_argument("--json", action="store_true", help="print one JSON object")
    capacity.set_defaults(func=_cmd_capacity)

    rp = _subparser(sub, "replay", "replay a trace through the policy engine and project TTFT",
                    "Every policy at every capacity point (blocks, a fraction of the unique blocks, or one run\n"
                    "over all tiers of a node), with per-tier hit rates and the cost model's projected TTFT.\n"
                    f"Policies: {policies}.",
                    "kvcluster replay TRACE --policies lru,bayes,belady --capacity-frac 0.02,0.05,0.1 --plot hit.png\n"
                    "kvcluster replay TRACE --policy bayes --tiers h100-node --model llama-3.1-8b --json")
    rp.add_argument("trace", metavar="TRACE", help=_TRACE_HELP)
    group = rp.add_mutually_exclusive_group()
    group.add_argument("--policy", help="one eviction policy")
    group.add_argument("--policies", type=_csv(str), metavar="P[,P...]",
                       help="comma-separated policies (default lru,bayes,belady)")
    _capacity_options(rp)
    rp.add_argument("--tiers", help="a tiers YAML: one run over all its tiers, plus HBM-only and HBM+DRAM LRU references "
                                    "(instead of --capacity-*)")
    rp.add_argument("--topology", metavar="CLUSTER", help="a cluster YAML: one run over its first node's tiers as its "
                                                          "control plane runs them, sized for the cluster's model; "
                                                          "TTFT projected when the node names its gpu")
    rp.add_argument("--model", help="model for block bytes and prefill FLOPs (default llama-3.1-8b)")
    rp.add_argument("--node", default="h100-node", help="tiers YAML for the cost model when capacity is in blocks "
                                                        "(default h100-node)")
    rp.add_argument("--prefetch-lead-s", type=_non_negative_float, default=0.0, metavar="SECONDS",
                    help="prefetch blocks of requests arriving within this many seconds (multi-tier only)")
    rp.add_argument("--lookahead-s", type=_non_negative_float, default=0.0, metavar="SECONDS",
                    help="also replay each capacity point with the blocks of requests queued within SECONDS "
                         "pinned; reported in its own column (single tier, --capacity-* only)")
    rp.add_argument("--answers-at-finish", action="store_true",
                    help="serve each request without how its answer ended and tell the policy right after, as "
                         "kvcluster's vLLM connector does (vLLM stores a request's blocks before it finishes)")
    rp.add_argument("--calibration", type=_non_negative_float, nargs="?", const=60.0, metavar="SECONDS",
                    help="also score the reuse-gap predictor: Brier score and reliability per decile of "
                         "P(reuse within SECONDS) (default 60)")
    rp.add_argument("--live", action="store_true",
                    help="replay through the live control plane instead: real tier actors of --cluster with real "
                         "backends (under a scratch directory), the policy run by the control plane actor; prints "
                         "the simulator's figures for the same tiers beside the live ones. The tiers are sized by "
                         "--tier-fracs or --tier-blocks (default: the cluster's own capacities). Needs "
                         "kvcluster[cluster]")
    split = rp.add_mutually_exclusive_group()
    split.add_argument("--tier-fracs", type=_csv(float), metavar="F,F[,F...]",
                       help="with --live: the size of each tier of the cluster's first node, fastest first, as a "
                            "fraction (0, 1] of the trace's unique blocks; one value per tier, one run")
    split.add_argument("--tier-blocks", type=_csv(int), metavar="N,N[,N...]",
                       help="with --live: the size of each tier of the cluster's first node in blocks, fastest "
                            "first; one value per tier, one run")
    rp.add_argument("--cluster", default="local", help="cluster YAML for --live (default local)")
    rp.add_argument("--live-block-bytes", type=positive_int, default=4096, metavar="BYTES",
                    help="payload bytes per block in --live (default 4096: stand-in KV, small to keep it quick)")
    _trace_options(rp, TRACE_FORMATS)
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    rp.add_argument("--plot", metavar="FILE.png", help="write hit rate vs capacity as a PNG")
    _progress_option(rp)
    rp.set_defaults(func=_cmd_replay)

    rep = _subparser(sub, "report", "PNG charts: hit rate vs capacity, tier occupancy, TTFT",
                     "Replays TRACE and writes to --out:\n"
                     "  hit_rate_vs_capacity.png  every policy at every --capacity-frac/--capacity-blocks point\n"
                     "  tier_occupancy.png        fraction of each tier of --tiers in use over trace time, per policy\n"
                     "  ttft_distribution.png     projected TTFT of every request, per policy and for the HBM-only\n"
                     "                            and HBM+DRAM LRU reference deployments\n"
                     "  report.json               the numbers behind the charts\n"
                     "and prints their paths. With --replay-json the hit-rate chart comes from a saved\n"
                     "`kvcluster replay --json` report (without TRACE it is the only chart).",
                     "kvcluster report TRACE --policies lru,bayes --capacity-frac 0.02,0.05,0.1 --tiers laptop-cpu \\\n"
                     "    --model kvcluster-tiny-llama --out report/\n"
                     "kvcluster replay TRACE --capacity-frac 0.01,0.1 --json > sweep.json\n"
                     "kvcluster report --replay-json sweep.json --out report/")
    rep.add_argument("trace", metavar="TRACE", nargs="?", help=_TRACE_HELP + " (optional with --replay-json)")
    rep.add_argument("--out", required=True, metavar="DIR", help="directory for the charts and report.json "
                                                                 "(created if missing)")
    rep.add_argument("--policies", type=_csv(str), default=("lru", "bayes", "belady"), metavar="P[,P...]",
                     help=f"comma-separated policies (default lru,bayes,belady; known: {policies})")
    _capacity_options(rep, "0.02,0.05,0.1,0.2")
    rep.add_argument("--replay-json", metavar="FILE", help="draw hit rate vs capacity from this saved "
                                                           "`kvcluster replay --json` output instead of replaying")
    rep.add_argument("--tiers", default="laptop-cpu",
                     help="tiers YAML of the occupancy and TTFT runs (default laptop-cpu)")
    rep.add_argument("--model", default="llama-3.1-8b", help="model for block bytes and prefill FLOPs (default llama-3.1-8b)")
    rep.add_argument("--node", default="h100-node", help="tiers YAML for the cost model of the capacity sweep "
                                                         "(default h100-node)")
    rep.add_argument("--prefetch-lead-s", type=_non_negative_float, default=0.0, metavar="SECONDS",
                     help="prefetch blocks of requests arriving within this many seconds (multi-tier runs)")
    rep.add_argument("--sample-every", type=positive_int, metavar="N",
                     help="sample tier occupancy every N requests (default: about 200 points per run)")
    _trace_options(rep, TRACE_FORMATS)
    rep.add_argument("--json", action="store_true", help="print one JSON object with the written paths")
    _progress_option(rep)
    rep.set_defaults(func=_cmd_report)

    for register in _extra_commands():
        register(sub)
    return parser


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import ReportOptions, build_report, load_replay_json, prepare_out, write_report
    from .simulator import prepare

    options = ReportOptions(
        policies=tuple(args.policies),
        capacity_blocks=args.capacity_blocks or (),
        capacity_frac=args.capacity_frac or ReportOptions.capacity_frac,
        tiers=args.tiers,
        model=args.model,
        node=args.node,
        prefetch_lead_s=args.prefetch_lead_s,
        sample_every=args.sample_every,
    )
    if args.trace is None and args.replay_json is None:
        raise ConfigError("give a TRACE, or --replay-json with a saved `kvcluster replay --json` report")
    options.validate()
    prepare_out(args.out)
    saved = load_replay_json(args.replay_json) if args.replay_json else None
    prepared = prepare(_load_trace(args)) if args.trace else None
    progress = _progress_factory(_show_progress(args), prepared.requests if prepared else 0)
    files = write_report(build_report(options, prepared, saved, progress), args.out)
    if args.json:
        print(json.dumps({"files": files}))
    else:
        for path in files.values():
            print(path)
    return 0


COMMANDS_GROUP = "kvcluster.commands"  # entry points: name -> fn(subparsers) that adds a subcommand


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands other distributions (or this one's Ray side: `cluster`) register by entry point.

    Why entry points: the core CLI stays free of Ray; `kvcluster cluster` appears wherever the
    package that provides it is installed. One that fails to load is left out, not fatal."""
    from importlib.metadata import entry_points

    found = []
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            found.append(entry.load())
        except ImportError:
            continue
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvclusterError as exc:
        print(f"kvcluster {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
