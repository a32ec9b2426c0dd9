"""Hit rates on shared data the default policy was not tuned on: does `bayes` carry over?

`hit_rate.py` scores the policies on the traces they were tuned on. Held-out
traces are what matters, so this scores them on parts of the shared data that
no default was chosen by:

- `sharegpt-unseen`: the ShareGPT entries after the first 1,000 (`hit_rate.py`
  tokenizes only those), from the first whole conversation on;
- `claude-code-even` / `claude-code-odd`: the Claude Code sessions split in two
  by file order. Both halves were part of the tuning set, merged; alone, each is
  a trace of another mix and size (how much a held-out set of 43 sessions may
  differ).

Reference in the same run: LRU (the floor), Belady's MIN (the offline
near-bound) and the best of lru, arc, s3fifo and sieve (the bar `bayes` must
meet). Prints a markdown table with the share of the LRU->Belady gap each policy
closes, or with `--json` only the report, as JSON, on stdout.

    .venv/bin/python benchmarks/hit_rate_unseen.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvcluster.paths import shared_data_dir
from kvcluster.simulator import TierPlan, prepare, replay
from kvcluster.traces import load_trace

FRACTIONS = (0.02, 0.05, 0.10)
TUNED_SHAREGPT_ENTRIES = 1000  # what hit_rate.py tokenizes by default
CLASSICAL = ("lru", "arc", "s3fifo", "sieve")
POLICIES = (*CLASSICAL, "bayes", "belady")


def _root(line: str) -> str:
    """A ShareGPT entry's conversation: its id without the last `_N` (the parts of one conversation)."""
    return json.loads(line)["id"].rsplit("_", 1)[0]


def unseen_sharegpt(source: Path, out: Path) -> Path:
    """Write the entries after the tuned ones to `out`, from the first whole conversation on."""
    lines = source.read_text().splitlines(keepends=True)
    start = TUNED_SHAREGPT_ENTRIES
    while start < len(lines) and _root(lines[start]) == _root(lines[start - 1]):
        start += 1  # the conversation that straddles the cut was (partly) seen
    if start >= len(lines):
        raise SystemExit(f"{source} has no conversation after its first {TUNED_SHAREGPT_ENTRIES} entries")
    out.write_text("".join(lines[start:]))
    return out


def claude_code_half(source: Path, out: Path, parity: int) -> Path:
    """Link every other session file of `source` (by name; `parity` 0 or 1) into the directory `out`."""
    out.mkdir()
    for i, f in enumerate(sorted(source.glob("*.json"))):
        if i % 2 == parity:
            os.symlink(f, out / f.name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the report, as JSON, on stdout")
    args = parser.parse_args()
    data = shared_data_dir()
    report = []
    if not args.json:
        print("| trace | capacity | blocks | " + " | ".join(POLICIES) + " | bayes gap closed | bayes >= best classical |")
        print("|---|---|---|" + "---|" * (len(POLICIES) + 2))
    with tempfile.TemporaryDirectory(prefix="kvcluster-unseen-") as tmp:
        tmp_dir = Path(tmp)
        traces = [
            ("sharegpt-unseen", unseen_sharegpt(data / "sharegpt_v3" / "sharegpt_v3_subset.jsonl",
                                                tmp_dir / "sharegpt.jsonl")),
            ("claude-code-even", claude_code_half(data / "weka_claude_code_traces", tmp_dir / "cc-even", 0)),
            ("claude-code-odd", claude_code_half(data / "weka_claude_code_traces", tmp_dir / "cc-odd", 1)),
        ]
        for label, path in traces:
            t0 = time.perf_counter()
            prepared = prepare(load_trace(str(path)))
            print(f"{label}: {prepared.requests} requests, {prepared.block_refs} refs, {prepared.unique_blocks} "
                  f"unique, loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            for frac in FRACTIONS:
                cap = max(1, round(frac * prepared.unique_blocks))
                rates = {p: replay(prepared, p, [TierPlan("hbm", cap)]).hit_rate for p in POLICIES}
                gap = rates["belady"] - rates["lru"]
                closed = (rates["bayes"] - rates["lru"]) / gap if gap > 0.005 else None
                best = max(rates[p] for p in CLASSICAL)
                report.append({"trace": label, "fraction": frac, "capacity_blocks": cap, "hit_rate": rates,
                               "bayes_gap_closed": closed, "bayes_at_least_best_classical": rates["bayes"] >= best})
                if not args.json:
                    cells = " | ".join(f"{rates[p]:.4f}" for p in POLICIES)
                    shown = "n/a (gap < 0.005)" if closed is None else f"{closed:.0%}"
                    print(f"| {label} | {frac:.0%} | {cap:,} | {cells} | {shown} | "
                          f"{'yes' if rates['bayes'] >= best else 'no'} |", flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
