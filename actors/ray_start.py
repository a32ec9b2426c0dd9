"""Starting a Ray node on a busy machine: Ray's own startup check is a fixed 30 s deadline.

`ray.init` (a new local cluster) and `ray.cluster_utils.Cluster` (its head and each `add_node`) start the
node's processes and then wait at most 30 s, a constant in Ray, for the raylet to register with the GCS. On
a loaded machine (two cores, another Ray cluster starting beside it) that deadline passes while nothing is
wrong, and the start raises "The current node timed out during startup". `start_ray` runs such a start
again in that one case, after killing the processes the failed try left behind; any other error is raised
at once.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import ray

from kvcluster.process_tree import descendants, kill

log = logging.getLogger(__name__)

T = TypeVar("T")
STARTUP_TIMEOUT = "timed out during startup"  # Ray's message when its 30 s registration check gives up
TRIES = 3


def start_ray(start: Callable[[], T], tries: int = TRIES) -> T:
    """`start()`, run again (up to `tries` times in all) while it fails only by Ray's startup deadline."""
    for attempt in range(1, tries + 1):
        before = descendants()
        try:
            return start()
        except Exception as exc:  # Ray raises a bare Exception for this
            if STARTUP_TIMEOUT not in str(exc) or attempt == tries:
                raise
            log.warning("Ray's node did not register within its startup deadline (try %d of %d): starting again",
                        attempt, tries)
            if ray.is_initialized():
                ray.shutdown()
            kill(descendants() - before)
    raise AssertionError("unreachable")

