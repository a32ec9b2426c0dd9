"""What the in-process store's policy keeps when it serves requests as a runner does, against the replay.

A runner (and the vLLM connector) `fetch`es a prompt's cached run, computes the rest and `store`s the request:
`LocalBlockStore` counts that request's use of its blocks once, at `store`, with its pairs and session, as the
simulator replays a trace request. The reference in the same run counts the fetched run at `fetch`, as a
request of its own with no context, and stores only the new blocks with the request's session but no pairs
(what the store did before). Each trace of `hit_rate.py` is served through a dram tier of real memory at
`--capacity-frac` of its unique blocks (16-byte keys, 64-byte stand-in payloads checked on every read).

    .venv/bin/python benchmarks/serving_commits.py [--capacity-frac 0.02,0.05,0.1] [--policies lru,bayes] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import JsonOutput  # noqa: E402
from hit_rate import add_clock_options, clock_from, load, traces  # noqa: E402

from kvcluster.block_types import pair_index  # noqa: E402
from kvcluster.errors import TraceError  # noqa: E402
from kvcluster.policies import POLICIES  # noqa: E402
from kvcluster.policies.base import RequestContext  # noqa: E402
from kvcluster.serving.block_store import LocalBlockStore  # noqa: E402
from kvcluster.hierarchy import TierPlan  # noqa: E402
from kvcluster.simulator import prepare, replay, request_context  # noqa: E402
from kvcluster.storage import dram_backend  # noqa: E402
from kvcluster.storage.tiered import TieredStore  # noqa: E402

BLOCK_BYTES = 64


class FetchCountedStore(LocalBlockStore):
    """The reference: the fetched run is a use of its own, at `fetch`, with no context; `store` keeps the new
    blocks with the request's session and answer but not its pairs."""

    def fetch(self, keys, out=None):
        with self._lock:
            got = list(self.tiered.read(keys, out).payloads)
            if got:
                self._requests += 1
                self.tiered.commit(keys[: len(got)], [None] * len(got),
                                   RequestContext(index=self._requests, now=self._clock()))
            return got

    def store(self, keys, payloads, pairs=None, finish="", output_tokens=0, session=""):
        new = [(k, p) for k, p in zip(keys, payloads) if p is not None]
        if not new:
            return
        with self._lock:
            self._requests += 1
            ctx = RequestContext(index=self._requests, now=self._clock(), finish=finish,
                                 output_tokens=output_tokens, session=session)
            self.tiered.commit([k for k, _ in new], [p for _, p in new], ctx)


def payload_of(key: bytes) -> np.ndarray:
    return np.frombuffer(key * (BLOCK_BYTES // len(key)), dtype=np.uint8)


def serve(trace, policy: str, capacity: int, kind: type[LocalBlockStore]) -> float:
    """Prefix hit rate of `trace` served through a store of `kind` over one dram tier of `capacity` blocks."""
    clock = [0.0]
    store = kind(TieredStore([dram_backend(capacity, BLOCK_BYTES)], BLOCK_BYTES, policy), clock=lambda: clock[0])
    hits = refs = 0
    for i, blocks in enumerate(trace.blocks):
        ctx = request_context(trace, i)
        clock[0] = ctx.now
        keys = [b.to_bytes(16, "big") for b in blocks]
        got = store.fetch(keys)
        if not all(np.array_equal(p, payload_of(k)) for p, k in zip(got, keys)):
            raise AssertionError(f"request {i}: a fetched block holds another block's bytes")
        hits, refs = hits + len(got), refs + len(keys)
        store.store(keys, [None] * len(got) + [payload_of(k) for k in keys[len(got):]],
                    [pair_index(t, ctx.transition) for t in ctx.block_types], ctx.finish, ctx.output_tokens,
                    ctx.session)
    return hits / max(1, refs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity-frac", default="0.02,0.05,0.1")
    ap.add_argument("--policies", default="lru,bayes")
    ap.add_argument("--sharegpt-records", type=int, default=1000, help="ShareGPT entries to tokenize")
    add_clock_options(ap)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny slices of the traces: checks the code runs")
    args = ap.parse_args()
    policies = args.policies.split(",")
    online = [name for name, cls in POLICIES.items() if not cls.offline]
    unknown = [p for p in policies if p not in online]
    if unknown:
        ap.error(f"--policies: {', '.join(unknown)}: choose online policies from {', '.join(online)}")
    try:
        fracs = [float(f) for f in args.capacity_frac.split(",")]
    except ValueError:
        ap.error(f"--capacity-frac: {args.capacity_frac!r} is not a list of numbers")
    if not all(0 < f <= 1 for f in fracs):
        ap.error("--capacity-frac: each fraction must be in (0, 1]")
    if args.sharegpt_records < 1:
        ap.error("--sharegpt-records must be >= 1")
    out = JsonOutput(args.json)
    rows = []
    for label, path, kwargs in traces(args.sharegpt_records, clock_from(args)):
        try:
            trace = prepare(load(path, args.smoke, **kwargs))
        except TraceError as err:  # missing or malformed shared data: one line, not a traceback
            print(f"serving_commits: {err}", file=sys.stderr)
            return 2
        for frac in fracs:
            capacity = max(1, round(frac * trace.unique_blocks))
            for policy in policies:
                started = time.perf_counter()
                simulated = replay(trace, policy, [TierPlan("dram", capacity)]).hit_rate
                once = serve(trace, policy, capacity, LocalBlockStore)
                at_fetch = serve(trace, policy, capacity, FetchCountedStore)
                rows.append({"trace": label, "capacity_frac": frac, "capacity_blocks": capacity, "policy": policy,
                             "simulated": round(simulated, 4), "store": round(once, 4),
                             "counted_at_fetch": round(at_fetch, 4),
                             "store_vs_counted_at_fetch": round(once / at_fetch, 3) if at_fetch else None,
                             "seconds": round(time.perf_counter() - started, 1)})
                if not args.json:
                    r = rows[-1]
                    print(f"{label} | {frac:.0%} | {capacity:,} | {policy} | {r['simulated']:.4f} | {r['store']:.4f} | "
                          f"{r['counted_at_fetch']:.4f} | {r['store_vs_counted_at_fetch']}x", flush=True)
    if args.json:
        out.emit({"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
