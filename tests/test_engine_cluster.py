"""How an engine process joins the cluster: Ray's draws from `random` never follow the engine's seed."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("ray")

from kvcluster.serve_apps.engine_cluster import unseeded_random  # noqa: E402


def test_joining_draws_from_the_os_and_leaves_the_engines_random_stream_as_it_was() -> None:
    """vLLM seeds `random` alike in every worker; Ray's subscriber ids drawn inside must not repeat the seeded
    stream (two workers would share them), and the engine's stream goes on as if nothing had been drawn."""
    random.seed(0)
    seeded = [random.getrandbits(64) for _ in range(4)]
    random.seed(0)
    with unseeded_random():
        inside = [random.getrandbits(64) for _ in range(4)]
    after = [random.getrandbits(64) for _ in range(4)]
    assert inside != seeded
    assert after == seeded
