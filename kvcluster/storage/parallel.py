"""Spreading a batch's copies and checksums over the cores.

Why: the native copy, checksum and file calls release the GIL, so a large batch
split over the cores' threads is bound by memory bandwidth, not by one core
(`run`), and a file tier can sum its payloads on one core while another writes
them (`ahead`). Smaller batches run inline: waking a pool thread costs tens of
microseconds (measured in benchmarks/RESULTS.md), more than the work it would share.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_MIN_BYTES = 8 << 20  # below this a batch runs in the calling thread
AHEAD_MIN_BYTES = 1 << 20  # below this `ahead` computes in the calling thread


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
        pool = self._executor()
        bounds = [n * g // groups for g in range(groups + 1)]

        def group(g: int) -> None:
            for i in range(bounds[g], bounds[g + 1]):
                fn(i)

        futures = [pool.submit(group, g) for g in range(1, groups)]
        group(0)  # the calling thread takes the first share
        for f in futures:
            f.result()

    def drain(self, fn: Callable[[int, int], R], n: int, lanes: int) -> list[R]:
        """`fn(lane, k)` for k = 0..n-1 over up to `lanes` lanes, each taking the next k when free; results in k order.

        Lane 0 is the calling thread, the others pool threads. Why not fixed shares: a pool
        thread wakes tens of microseconds late, far later when the other cores are busy, and
        with fixed shares the caller then sat waiting for it. Here the caller takes the work
        a late lane has not started, and a lane that never started is cancelled, not waited
        for. Every started `fn` finishes before this returns, even when one raises (they may
        write the caller's buffers); no k starts after an error; the lowest k's error is raised.
        """
        results: list = [None] * n
        errors: dict[int, BaseException] = {}
        tickets = itertools.count()  # next() on a count is atomic under the GIL: each k goes to one lane

        def lane(g: int) -> None:
            while not errors:
                k = next(tickets)
                if k >= n:
                    return
                try:
                    results[k] = fn(g, k)
                except BaseException as exc:  # noqa: BLE001 - raised below, once every started k is over
                    errors[k] = exc

        helpers = [self._executor().submit(lane, g) for g in range(1, min(lanes, n, self.workers))]
        lane(0)
        for helper in helpers:
            if not helper.cancel():  # started: it may be moving its last k
                helper.result()
        if errors:
            raise errors[min(errors)]
        return results

    def worth(self, nbytes: int) -> bool:
        """Whether a batch of `nbytes` is large enough to share with a pool thread."""
        return nbytes >= AHEAD_MIN_BYTES and self.workers > 1

    def start(self, background: bool, fn: Callable[..., R], *args) -> Callable[[], R]:
        """`fn(*args)` started now, on a pool thread when `background`, else done inline; call the result to wait."""
        if not background:
            result = fn(*args)
            return lambda: result
        return self._executor().submit(fn, *args).result

    def ahead(self, fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[Callable[[], R]]:
        """`fn(item)` for every item, started now on a pool thread, in order; each result is waited for on call.

        For work the caller needs only later in its loop (a file's digest, needed after
        its payload is written). Inline, and so already done, for small batches or one core.
        """
        background = self.worth(nbytes)
        return [self.start(background, fn, item) for item in items]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="kvc-copy")
        return self._pool
