"""Spreading a batch's copies and checksums over the cores.

Why: the native copy, checksum and file calls release the GIL, so a large batch
split over the cores' threads is bound by memory bandwidth, not by one core
(`run`), and a file tier can sum its payloads on one core while another writes
them (`ahead`). Smaller batches run inline: waking a pool thread costs 40-75 us on
this VM (measured: benchmarks/RESULTS.md), more than the work it would share.
"""

from __future__ import annotations

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

    def each(self, fn: Callable[[int, T], R], parts: Sequence[T]) -> list[R]:
        """`fn(g, parts[g])` for every part at once: part 0 in the calling thread, the others on pool threads.

        Every part finishes before this returns, even when one raises (the parts may write
        into the caller's buffers); then the first exception, in part order, is raised.
        """
        if not parts:
            return []
        futures = [self._executor().submit(fn, g, part) for g, part in enumerate(parts) if g > 0]
        results: list = []
        errors: list[BaseException] = []
        try:
            results.append(fn(0, parts[0]))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the other parts are done
            errors.append(exc)
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]
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
