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
from .errors import KvclusterError

GIB = 1 << 30


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
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
    from .traces import load_trace

    trace = load_trace(args.trace, format=args.format, block_size=args.block_size, strict=args.strict,
                       max_records=args.max_records)
    for line in trace.skipped[:5]:
        print(f"skipped {line}", file=sys.stderr)
    if len(trace.skipped) > 5:
        print(f"skipped {len(trace.skipped) - 5} more malformed records", file=sys.stderr)
    return trace


def _cmd_replay(args: argparse.Namespace) -> int:
    from .replay import ReplayOptions, run_replay
    from .simulator import prepare

    policies = args.policies or ((args.policy,) if args.policy else ("lru", "bayes", "belady"))
    options = ReplayOptions(
        policies=tuple(policies),
        capacity_blocks=args.capacity_blocks or (),
        capacity_frac=args.capacity_frac or (),
        tiers=args.tiers,
        model=args.model,
        node=args.node,
        prefetch_lead_s=args.prefetch_lead_s,
    )
    options.validate()
    trace = _load_trace(args)
    prepared = prepare(trace)
    progress = _progress_factory(_show_progress(args), prepared.requests)
    report = run_replay(options, prepared, progress)
    report["format"] = trace.format
    report["skipped_records"] = len(trace.skipped)
    if args.plot:
        from .plots import plot_hit_rates

        plot_hit_rates(report, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['trace']} ({trace.format}): {report['requests']:,} requests, {report['block_refs']:,} block refs, "
          f"{report['unique_blocks']:,} unique blocks of {report['block_size']} tokens; "
          f"infinite-cache hit rate {report['infinite_hit_rate']:.4f}")
    rows = [
        [r.get("deployment", r["policy"]), f"{r['capacity_blocks']:,}", f"{r['hit_rate']:.4f}",
         " ".join(f"{k}={v:.3f}" for k, v in r["per_tier"].items()),
         f"{r['projected_ttft_s']['mean'] * 1e3:.1f}", f"{r['refs_per_s']:,}"]
        for r in report["results"] + report.get("reference_deployments", [])
    ]
    print(_table(rows, ["policy", "capacity", "hit rate", "per tier", "TTFT ms", "refs/s"]))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcluster", description="Cluster-scale KV-cache manager for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    size = sub.add_parser("size", help="exact KV bytes per token and per sequence for a model")
    size.add_argument("model", help="a name under configs/models, or a path to a HF config.json / checkpoint dir")
    size.add_argument("--dtype", choices=DTYPE_CHOICES, help="KV dtype (default: the model's dtype)")
    size.add_argument("--weights-dtype", choices=DTYPE_CHOICES, help="weight dtype (default: as published)")
    size.add_argument("--context", type=_positive_int, help="tokens per sequence (default: min(max positions, 32768))")
    size.add_argument("--hbm-gib", type=_non_negative_float, help="HBM for weights + KV; reports max sequences")
    size.add_argument("--json", action="store_true", help="print one JSON object")
    size.set_defaults(func=_cmd_size)

    capacity = sub.add_parser("capacity", help="KV bytes and tokens a node's six tiers hold for a model")
    capacity.add_argument("model", help="a name under configs/models, or a config path")
    capacity.add_argument("--tiers", required=True, help="a tiers YAML (path, or a name under configs/tiers)")
    capacity.add_argument("--dtype", choices=DTYPE_CHOICES, help="KV dtype (default: the model's dtype)")
    capacity.add_argument("--context", type=_positive_int, help="tokens per sequence for the sequences column")
    capacity.add_argument("--json", action="store_true", help="print one JSON object")
    capacity.set_defaults(func=_cmd_capacity)

    rp = sub.add_parser("replay", help="replay a trace through the policy engine and project TTFT")
    rp.add_argument("trace", help="a trace file or directory (Mooncake, Bailian, Claude Code, ShareGPT, LMSYS, SWE-agent, Azure)")
    rp.add_argument("--format", default="auto", help="auto|mooncake|bailian|claude-code|sharegpt|lmsys|swe-agent|azure")
    group = rp.add_mutually_exclusive_group()
    group.add_argument("--policy", help="one eviction policy")
    group.add_argument("--policies", type=_csv(str), help="comma-separated policies (default lru,bayes,belady)")
    rp.add_argument("--capacity-blocks", type=_csv(int), help="capacity in blocks (comma list for several runs)")
    rp.add_argument("--capacity-frac", type=_csv(float), help="capacity as a fraction of unique blocks (comma list)")
    rp.add_argument("--tiers", help="a tiers YAML: one run over all its tiers, plus vLLM/LMCache-style references")
    rp.add_argument("--block-size", type=_positive_int, help="tokens per block for text traces (hash traces fix their own)")
    rp.add_argument("--model", default="llama-3.1-8b", help="model for block bytes and prefill FLOPs (default llama-3.1-8b)")
    rp.add_argument("--node", default="h100-node", help="tiers YAML for the cost model when capacity is in blocks")
    rp.add_argument("--prefetch-lead-s", type=_non_negative_float, default=0.0,
                    help="prefetch blocks of requests arriving within this many seconds (multi-tier only)")
    rp.add_argument("--strict", action="store_true", help="fail on the first malformed trace record")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    rp.add_argument("--plot", metavar="FILE.png", help="write hit rate vs capacity as a PNG")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.set_defaults(func=_cmd_replay)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


def _cmd_cluster(args: argparse.Namespace) -> int:
    from .cluster_config import load_cluster_config

    cfg = load_cluster_config(args.config)  # a bad file fails here, before Ray starts
    from actors import cluster  # Ray only for this command

    cluster.connect(args.address)
    if args.action == "up":
        result = cluster.up(cfg, args.placement_period_s)
        text = f"started {len(result['tiers'])} tier actors ({', '.join(result['tiers'])}); " \
               f"blocks of {_human_bytes(result['block_bytes'])}; index, predictor and placement loop running"
    elif args.action == "down":
        result = {"killed": cluster.down(cfg)}
        text = f"stopped {len(result['killed'])} actors (files on nvme and pfs are kept)"
    else:
        result = cluster.status(cfg)
        rows = [[r["node"], r["tier"], r["state"], str(r.get("used_blocks", "-")), str(r.get("capacity_blocks", "-"))]
                for r in result["tiers"]]
        text = _table(rows, ["node", "tier", "state", "blocks", "capacity"])
        if result.get("placement"):
            text += "\nplacement: " + ", ".join(f"{k} {v}" for k, v in sorted(result["placement"].items()))
    print(json.dumps(result) if args.json else text)
    return 0


def _register_cluster(sub: argparse._SubParsersAction) -> None:
    cl = sub.add_parser("cluster", help="start, inspect or stop the cache actors on a running Ray cluster")
    cl.add_argument("action", choices=["up", "status", "down"])
    cl.add_argument("config", help="a cluster YAML (path, or a name under configs/cluster)")
    cl.add_argument("--address", default="auto", help="Ray cluster address (default: the running one)")
    cl.add_argument("--placement-period-s", type=_non_negative_float, default=1.0,
                    help="seconds between placement rounds (up)")
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.set_defaults(func=_cmd_cluster)


# Later modules (serve) add their subcommands here.
_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_register_cluster]


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
