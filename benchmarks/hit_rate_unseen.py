"""Hit rates on shared data the default policy was not tuned on: does `bayes` carry over?

`hit_rate.py` scores the policies on the traces they were tuned on. Held-out
traces are what matters, so this scores them on parts of the shared data that
no default was chosen by:

Every trace here is drawn from the validation parts only (kvcluster/traces/split.py): the
parts no default is chosen on from now on.

- `sharegpt-unseen`: the validation-part ShareGPT conversations after the first
  1,000 entries (`hit_rate.py` tokenized only those until 2026-12-08, and the
  defaults were tuned on them), from the first whole conversation on, timed as the
  loader times every trace without times by default (seeded, seed 0: Poisson
  conversation starts, log-normal think times fitted to the Claude Code traces;
  docs/traces.md);
- `sharegpt-unseen-random-gaps`: the same conversations re-timed by this
  script's own seeded draw, older than the loader's: conversations start as a
  Poisson process (one every 5 s on average) and a turn follows the one before
  after a log-normal think time of median 30 s (the fixed clock's gap) and
  sigma 1. Before the loader drew times, it was the one row whose times did not
  tell exactly when a conversation comes back; it stays for comparison with the
  figures measured then;
- `claude-code-even` / `claude-code-odd`: the validation-part Claude Code sessions
  split in two by file order. Both were part of the set the defaults were tuned on
  before 2026-12-08, merged; alone, each is a trace of another mix and size (how
  much a held-out set of a dozen sessions may differ);
- `...-as-mooncake`: a trace above written as a Mooncake jsonl (hash ids of
  512-token blocks, times in ms, token counts; no sessions, roles or finish
  reasons) and read back by the Mooncake loader, which infers sessions and block
  types from the hash ids alone. A held-out Mooncake conversation trace reaches
  the policy this way only. `sharegpt-unseen-random-gaps-512` is the same
  conversations, times and 512-token blocks with the labels the ShareGPT loader
  gives, for a like-for-like comparison. `...-system-prompt-as-mooncake` puts
  one 1,024-token system prompt before every request, as a chat service does:
  the hash ids then share a prefix across all conversations, and a first message
  shorter than a block ends its full blocks on the prompt;
- `mooncake-system-prompt`: the validation part of the shared Mooncake trace with the same
  prompt before every request, its own blocks as they were: its conversations then
  all start on a prefix every session shares, as a service's do. What is new to the
  policy here is the prompt.

Reference in the same run: LRU (the floor), Belady's MIN (the offline
near-bound) and the best of lru, arc, s3fifo and sieve (the bar `bayes` must
meet). Prints a markdown table with the share of the LRU->Belady gap each policy
closes, or with `--json` only the report, as JSON, on stdout.

    .venv/bin/python benchmarks/hit_rate_unseen.py [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

from hit_rate import load, load_parts

from kvcluster.errors import TraceError
from kvcluster.paths import shared_data_dir
from kvcluster.hierarchy import TierPlan
from kvcluster.simulator import PreparedTrace, prepare, replay
from kvcluster.traces import load_trace
from kvcluster.traces.records import require_path
from kvcluster.traces.sharegpt import root_id
from kvcluster.traces.split import session_part
from kvcluster.traces.text import SESSION_GAP_S, TURN_GAP_S

FRACTIONS = (0.02, 0.05, 0.10)
CLASSICAL = ("lru", "arc", "s3fifo", "sieve")
POLICIES = (*CLASSICAL, "bayes", "belady")
MOONCAKE_BLOCK = 512  # tokens per block of a Mooncake trace
SYSTEM_PROMPT_BLOCKS = 2  # a 1,024-token system prompt before every request of the `-system-prompt` row
TUNED_SHAREGPT_ENTRIES = 1000  # the ShareGPT entries the defaults were tuned on before the split (2026-12-08)


def _root(line: str) -> str:
    """The conversation a ShareGPT line belongs to (its parts share a root id)."""
    try:
        return root_id(str(json.loads(line)["id"]))
    except (ValueError, KeyError, TypeError) as err:
        raise TraceError(f"a ShareGPT line without an id: {line[:80]!r}") from err


def unseen_sharegpt(source: Path, out: Path) -> Path:
    """Write the validation-part entries after the tuned ones to `out`, from the first whole conversation on."""
    # split at "\n" only: str.splitlines would also cut at the U+2028 that some conversations' text holds
    lines = [line + "\n" for line in require_path(source).read_text().split("\n") if line.strip()]
    start = TUNED_SHAREGPT_ENTRIES
    while start < len(lines) and _root(lines[start]) == _root(lines[start - 1]):
        start += 1  # the conversation that straddles the cut was (partly) seen
    if start >= len(lines):
        raise TraceError(f"{source} has no conversation after its first {TUNED_SHAREGPT_ENTRIES} entries")
    out.write_text("".join(line for line in lines[start:] if session_part(_root(line), "sharegpt") == "validation"))
    return out


def with_random_gaps(trace: PreparedTrace, seed: int = 1) -> PreparedTrace:
    """`trace` with Poisson conversation starts (mean SESSION_GAP_S apart) and log-normal gaps between turns
    (median TURN_GAP_S, sigma 1), each conversation's order kept; requests re-sorted by the new times."""
    rng = random.Random(seed)
    turns: dict[str, list[int]] = {}
    for i, session in enumerate(trace.sessions):
        turns.setdefault(session, []).append(i)
    when = [0.0] * trace.requests
    start = 0.0
    for requests in turns.values():  # in order of first arrival
        start += rng.expovariate(1.0 / SESSION_GAP_S)
        t = start
        for j, i in enumerate(requests):
            t += TURN_GAP_S * math.exp(rng.gauss(0.0, 1.0)) if j else 0.0
            when[i] = t
    order = sorted(range(trace.requests), key=when.__getitem__)

    def pick(values: tuple) -> tuple:
        return tuple(values[i] for i in order) if values else values

    return dataclasses.replace(trace, name=f"{trace.name} (random gaps)", arrivals=tuple(when[i] for i in order),
                               blocks=pick(trace.blocks), types=pick(trace.types),
                               transitions=pick(trace.transitions), input_tokens=pick(trace.input_tokens),
                               sessions=pick(trace.sessions), finishes=pick(trace.finishes),
                               output_tokens=pick(trace.output_tokens))


def as_mooncake(trace: PreparedTrace, out: Path, system_prompt_blocks: int = 0) -> Path:
    """Write `trace` as a Mooncake jsonl of 512-token blocks: what a Mooncake trace carries and nothing else.

    Each 512-token block is named by the id of the last of the trace's own blocks
    in it (ids are prefix-chained, so equal ids mean equal prefixes). A last block
    that is not full is left out: a Mooncake file lists it, but it never hits, and
    without it the blocks are those of the same trace cut into 512-token blocks. A
    trace already in 512-token blocks (a Mooncake trace) keeps every block it has.
    With `system_prompt_blocks`, every request starts with that many blocks of one
    system prompt, as a chat service's traffic does (ids after the trace's own; each
    input grows by the prompt's tokens)."""
    if system_prompt_blocks < 0:
        raise TraceError(f"system_prompt_blocks must be >= 0, not {system_prompt_blocks}")
    if MOONCAKE_BLOCK % trace.block_size:
        raise TraceError(f"{trace.name}: {trace.block_size}-token blocks do not tile Mooncake's {MOONCAKE_BLOCK}")
    per = MOONCAKE_BLOCK // trace.block_size
    after = 1 + max((max(blocks) for blocks in trace.blocks if blocks), default=-1)
    prompt = list(range(after, after + system_prompt_blocks))
    with open(out, "w") as f:
        for i, blocks in enumerate(trace.blocks):
            ids = prompt + [blocks[k + per - 1] for k in range(0, len(blocks) - per + 1, per)]
            f.write(json.dumps({"timestamp": round(trace.arrivals[i] * 1000.0),
                                "input_length": trace.input_tokens[i] + MOONCAKE_BLOCK * system_prompt_blocks,
                                "output_length": trace.output_tokens[i] if trace.output_tokens else 0,
                                "hash_ids": ids}) + "\n")
    return out


def claude_code_half(source: Path, out: Path, parity: int) -> Path:
    """Link every other validation-part session file of `source` (by name; `parity` 0 or 1) into the directory
    `out`. A session is named by its file's stem, as the Claude Code loader names it."""
    sessions = [f for f in sorted(require_path(source).glob("*.json"))
                if session_part(f.stem, "claude-code") == "validation"]
    if len(sessions) < 2:
        raise TraceError(f"{source} holds {len(sessions)} session files: two halves need two or more")
    out.mkdir()
    for f in sessions[parity::2]:
        os.symlink(f, out / f.name)
    return out


def _run(quiet: bool, smoke: bool = False) -> list[dict]:
    """Score every policy on the unseen traces (tiny slices of them with `smoke`); print the table unless `quiet`.
    Returns the report's rows."""
    data = shared_data_dir()
    report = []
    if not quiet:
        print("| trace | capacity | blocks | " + " | ".join(POLICIES) + " | bayes gap closed | bayes >= best classical |")
        print("|---|---|---|" + "---|" * (len(POLICIES) + 2))
    with tempfile.TemporaryDirectory(prefix="kvcluster-unseen-") as tmp:
        tmp_dir = Path(tmp)
        sharegpt = unseen_sharegpt(data / "sharegpt_v3" / "sharegpt_v3_subset.jsonl", tmp_dir / "sharegpt.jsonl")
        unseen = prepare(load(str(sharegpt), smoke))
        unseen_512 = with_random_gaps(prepare(load(str(sharegpt), smoke, block_size=MOONCAKE_BLOCK)))
        [(_, mooncake_part)] = load_parts(str(data / "mooncake" / "synthetic_trace.jsonl"), smoke=smoke)
        mooncake = prepare(mooncake_part)
        halves = [prepare(load(str(claude_code_half(data / "weka_claude_code_traces", tmp_dir / f"cc-{h}", i)), smoke))
                  for i, h in enumerate(("even", "odd"))]

        def reread(trace: PreparedTrace, name: str, system_prompt_blocks: int = 0) -> PreparedTrace:
            return prepare(load_trace(str(as_mooncake(trace, tmp_dir / f"{name}.jsonl", system_prompt_blocks))))

        traces = [
            ("sharegpt-unseen", lambda: unseen),
            ("sharegpt-unseen-random-gaps", lambda: with_random_gaps(unseen)),
            ("sharegpt-unseen-random-gaps-512", lambda: unseen_512),
            ("sharegpt-unseen-random-gaps-as-mooncake", lambda: reread(with_random_gaps(unseen), "sharegpt")),
            ("sharegpt-unseen-random-gaps-system-prompt-as-mooncake",
             lambda: reread(with_random_gaps(unseen), "sharegpt-system", SYSTEM_PROMPT_BLOCKS)),
            ("mooncake-system-prompt", lambda: reread(mooncake, "mooncake-system", SYSTEM_PROMPT_BLOCKS)),
            ("claude-code-even", lambda: halves[0]),
            ("claude-code-odd", lambda: halves[1]),
            ("claude-code-even-as-mooncake", lambda: reread(halves[0], "cc-even")),
            ("claude-code-odd-as-mooncake", lambda: reread(halves[1], "cc-odd")),
        ]
        for label, build in traces:
            prepared = build()
            print(f"{label}: {prepared.requests} requests, {prepared.block_refs} refs, {prepared.unique_blocks} "
                  "unique", file=sys.stderr)
            for frac in FRACTIONS:
                cap = max(1, round(frac * prepared.unique_blocks))
                rates = {p: replay(prepared, p, [TierPlan("hbm", cap)]).hit_rate for p in POLICIES}
                gap = rates["belady"] - rates["lru"]
                closed = (rates["bayes"] - rates["lru"]) / gap if gap > 0.005 else None
                best = max(rates[p] for p in CLASSICAL)
                report.append({"trace": label, "fraction": frac, "capacity_blocks": cap, "hit_rate": rates,
                               "bayes_gap_closed": closed, "bayes_at_least_best_classical": rates["bayes"] >= best})
                if not quiet:
                    cells = " | ".join(f"{rates[p]:.4f}" for p in POLICIES)
                    shown = "n/a (gap < 0.005)" if closed is None else f"{closed:.0%}"
                    print(f"| {label} | {frac:.0%} | {cap:,} | {cells} | {shown} | "
                          f"{'yes' if rates['bayes'] >= best else 'no'} |", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the report, as JSON, on stdout")
    parser.add_argument("--smoke", action="store_true", help="tiny slices of the traces: checks the code runs")
    args = parser.parse_args()
    try:
        report = _run(args.json, args.smoke)
    except TraceError as err:
        print(f"hit_rate_unseen: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
