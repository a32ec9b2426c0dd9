"""What the multi-node Ray tests share: waiting until an earlier test's named actors are gone."""

from __future__ import annotations

import time

import ray

from kvcluster.actors.index_actor import NAMESPACE


def names_free(*names: str, timeout: float = 300.0) -> None:
    """Wait until the named actors an earlier test held are gone (their handles die asynchronously)."""
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"actor {name} from an earlier test is still alive")
            time.sleep(0.2)
