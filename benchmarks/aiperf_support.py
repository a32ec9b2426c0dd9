"""Inputs and summary for `benchmarks/aiperf.sh`: a Hugging Face-style tokenizer cache, a scaled Mooncake slice.

AIPerf loads its tokenizer through `huggingface_hub`, which offline finds only a cache
laid out as `hub/models--ORG--NAME/snapshots/REV/` with `refs/main` naming REV; the
served model's tokenizer (`.cache/tokenizer/`) is linked there as `local/NAME`.
The Mooncake slice keeps each record's hash ids and arrival time and divides its
input length by `--scale` (the trace's 512-token hash blocks become 512/scale tokens:
AIPerf is told that block size), so a CPU replica can serve it while shared prefixes
stay shared.

    .venv/bin/python benchmarks/aiperf_support.py inputs OUT_DIR [--records 40] [--scale 16] [--max-output 8]
    .venv/bin/python benchmarks/aiperf_support.py summary OUT_DIR [--json]

`summary` reads the `profile_export_aiperf.json` of each phase AIPerf ran under OUT_DIR
and compares the identical second Mooncake pass with the first (its reference).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import JsonOutput  # noqa: E402
from kvcluster.cli import positive_int  # noqa: E402
from kvcluster.paths import shared_data_dir  # noqa: E402
from kvcluster.tokenizer import tokenizer_dir  # noqa: E402

MODEL = "kvcluster-tiny-llama"


def hf_cache(out: Path) -> Path:
    """HF_HOME with the local tokenizer as model `local/kvcluster-tiny-llama`; returns HF_HOME."""
    home = out / "hf"
    repo = home / "hub" / f"models--local--{MODEL}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        src = tokenizer_dir() / name
        if src.is_file():
            shutil.copyfile(src, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return home


def mooncake_slice(out: Path, records: int, scale: int, max_output: int) -> Path:
    path = out / f"mooncake_first{records}_div{scale}.jsonl"
    with open(shared_data_dir() / "mooncake" / "synthetic_trace.jsonl") as src, open(path, "w") as dst:
        for line, _ in zip(src, range(records)):
            rec = json.loads(line)
            rec["input_length"] = max(1, rec["input_length"] // scale)
            rec["output_length"] = max(1, min(rec["output_length"], max_output))
            dst.write(json.dumps(rec) + "\n")
    return path


PHASES = ("mooncake_pass1", "mooncake_pass2", "multiturn_chat")


def _phase(path: Path) -> dict:
    d = json.loads((path / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str):
        value = d.get(name)
        return None if not isinstance(value, dict) else value.get(key)

    prompt = stat("usage_prompt_tokens", "avg") or 0.0
    cached = stat("usage_prompt_cache_read_tokens", "avg") or 0.0
    return {"requests": int(stat("request_count", "avg") or 0), "errors": sum(e.get("count", 1) for e in
                                                                            d.get("error_summary") or []),
            "prompt_tokens_avg": prompt, "cached_tokens_avg": cached,
            "cached_share": round(cached / prompt, 4) if prompt else None,
            "ttft_ms_p50": stat("time_to_first_token", "p50"), "ttft_ms_p99": stat("time_to_first_token", "p99"),
            "latency_ms_p50": stat("request_latency", "p50"), "latency_ms_p99": stat("request_latency", "p99"),
            "requests_per_s": stat("request_throughput", "avg"), "duration_s": stat("benchmark_duration", "avg")}


def summary(out: Path) -> dict:
    phases = {name: _phase(out / name) for name in PHASES if (out / name / "profile_export_aiperf.json").is_file()}
    first, second = phases.get("mooncake_pass1"), phases.get("mooncake_pass2")
    ratios = {}
    if first and second:
        for key in ("ttft_ms_p50", "latency_ms_p50", "latency_ms_p99"):
            if first[key] and second[key]:
                ratios[f"pass2_over_pass1_{key}"] = round(second[key] / first[key], 4)
    return {"phases": phases, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("inputs", help="write the tokenizer cache and the Mooncake slice")
    make.add_argument("out", type=Path)
    make.add_argument("--records", type=positive_int, default=40)
    make.add_argument("--scale", type=positive_int, default=16)
    make.add_argument("--max-output", type=positive_int, default=8)
    report = sub.add_parser("summary", help="the phases' figures and the second pass against the first")
    report.add_argument("out", type=Path)
    report.add_argument("--json", action="store_true", help="print only JSON")
    args = parser.parse_args()
    if args.command == "inputs":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"hf_home": str(hf_cache(args.out)),
                          "mooncake": str(mooncake_slice(args.out, args.records, args.scale, args.max_output)),
                          "block_size": 512 // args.scale}))
        return 0
    out = JsonOutput(args.json)
    result = summary(args.out)
    if out.enabled:
        out.emit(result)
        return 0
    for name, p in result["phases"].items():
        ms = {k: "-" if p[k] is None else f"{p[k]:.0f}" for k in ("ttft_ms_p50", "latency_ms_p50", "latency_ms_p99")}
        print(f"{name:16s} {p['requests']:4d} requests, {p['errors']} errors, cached {p['cached_share']:.1%}, "
              f"TTFT p50 {ms['ttft_ms_p50']} ms, latency p50 {ms['latency_ms_p50']} ms / p99 {ms['latency_ms_p99']} ms")
    for key, value in result["ratios"].items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
