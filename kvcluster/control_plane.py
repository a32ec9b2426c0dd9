"""One request's path through the cache, over any data plane.

`fetch` asks the manager for the prefix run, reads it with one batched call per
tier and stops at the first block whose bytes do not verify (that block leaves the
bookkeeping; the rest of the prompt is recomputed). `commit` hands the request to
the manager, which places it with the configured policy, and runs the plan. The
same object serves a replica's tiers in its own process (`BackendTierIO`) and a
whole cluster's tier actors (`kvcluster.actors`), and `kvcluster replay --live`
drives it with a trace, so the live hit rates are the simulator's by construction
unless bytes go missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .cache_manager import CacheManager, StorePlan
from .plan_executor import Held, TierIO, execute
from .policies.base import RequestContext


@dataclass(frozen=True)
class Fetched:
    tiers: tuple[int, ...]  # tier of each block of the verified run
    payloads: tuple[np.ndarray, ...]
    digests: tuple[int | None, ...]
    corrupt: int  # blocks the manager listed whose bytes did not verify


class ControlPlane:
    def __init__(self, manager: CacheManager, io: TierIO) -> None:
        self.manager = manager
        self.io = io

    def fetch(self, keys: Sequence[bytes], out: Sequence[np.ndarray] | None = None) -> Fetched:
        """The verified cached run of `keys` (read into `out[j]` where the data plane can)."""
        tiers = self.manager.prepare_load(keys)
        try:
            wanted: dict[int, list[int]] = {}
            for j, tier in enumerate(tiers):
                wanted.setdefault(tier, []).append(j)
            got: dict[int, tuple[np.ndarray | None, int | None]] = {}
            if wanted:
                buffers = None if out is None else {t: [out[j] for j in js] for t, js in wanted.items()}
                for tier, (payloads, digests) in self.io.read(
                        {t: [keys[j] for j in js] for t, js in wanted.items()}, buffers).items():
                    got.update(zip(wanted[tier], zip(payloads, digests)))
        finally:
            self.manager.complete_load(keys[: len(tiers)])
        run_payloads, run_digests, corrupt = [], [], 0
        for j in range(len(tiers)):
            payload, digest = got[j]
            if payload is None:  # listed but unreadable: a miss from here on, and its room freed
                self.manager.forget([keys[j]])
                self.io.delete({tiers[j]: [keys[j]]})
                corrupt = 1
                break
            run_payloads.append(payload)
            run_digests.append(digest)
        n = len(run_payloads)
        return Fetched(tuple(tiers[:n]), tuple(run_payloads), tuple(run_digests), corrupt)

    def commit(self, keys: Sequence[bytes], held: Held, ctx: RequestContext | None = None
               ) -> tuple[StorePlan, list[bytes]]:
        """Place the request and move the bytes; `held`: the payloads (and verified digests) the caller
        has, fetched or computed. Returns the plan and the blocks that did not reach their tier."""
        plan = self.manager.prepare_store(keys, held.keys(), ctx)
        failed = execute(plan, self.io, held)
        self.manager.complete_store(plan, failed)
        return plan, failed

    def place(self, keys: Sequence[bytes], held: Held, ctx: RequestContext | None = None) -> list[bytes]:
        """Blocks read from elsewhere, into tier 0 without counting a use (`CacheManager.prepare_place`);
        `held` has their bytes. Returns the blocks that did not reach their tier."""
        plan = self.manager.prepare_place(keys, ctx)
        failed = execute(plan, self.io, held)
        self.manager.complete_store(plan, failed)
        return failed

    def serve(self, keys: Sequence[bytes], payloads: Mapping[bytes, np.ndarray],
              ctx: RequestContext | None = None) -> Fetched:
        """Fetch the cached run, then commit the request with `payloads` standing in for the blocks a
        model would compute (those past the run)."""
        fetched = self.fetch(keys)
        n = len(fetched.payloads)
        held = {k: (p, d) for k, p, d in zip(keys, fetched.payloads, fetched.digests)}
        for key in keys[n:]:
            if key in payloads and key not in held:
                held[key] = (payloads[key], None)
        self.commit(keys, held, ctx)
        return fetched
