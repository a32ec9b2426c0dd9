"""Spreading a batch's copies and checksums over the cores.

Why: a checksummed memory tier does a copy and a hash per block, each about as
costly as the other; numpy copies and xxhash both release the GIL, so a batch
split over the cores' threads costs about one copy's time, not two. Smaller
batches run inline: waking a pool thread costs ~75 us on this VM (measured:
benchmarks/RESULTS.md), more than copying and hashing 4 MiB that sit in cache.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

PARALLEL_MIN_BYTES = 8 << 20  # below this a batch runs in the calling thread


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class BatchWorkers:
    """Runs `fn(i)` for every item of a batch, in contiguous groups, one group per worker thread."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fn: Callable[[int], None], n: int, nbytes: int) -> None:
        groups = min(self.workers, n) if nbytes >= PARALLEL_MIN_BYTES else 1
        if groups <= 1:
            for i in range(n):
                fn(i)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="kvc-copy")
        bounds = [n * g // groups for g in range(groups + 1)]

        def group(g: int) -> None:
            for i in range(bounds[g], bounds[g + 1]):
                fn(i)

        futures = [self._pool.submit(group, g) for g in range(1, groups)]
        group(0)  # the calling thread takes the first share
        for f in futures:
            f.result()
