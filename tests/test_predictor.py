"""The Beta reuse predictor: successes, expiries, snapshots, priors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import BlockType, TransitionType, pair_index
from kvcluster.predictor import PredictorConfig, PredictorSnapshot, ReusePredictor

SYS_APPEND = pair_index(BlockType.SYSTEM, TransitionType.APPEND)
OUT_FIRST = pair_index(BlockType.OUTPUT, TransitionType.FIRST)


def test_reuse_within_horizon_is_a_success_and_expiry_a_failure() -> None:
    p = ReusePredictor(PredictorConfig(horizon_s=10))
    assert p.p_reuse(BlockType.SYSTEM, TransitionType.APPEND) == 0.5
    p.observe(1, SYS_APPEND, now=0.0)
    assert p.observe(1, SYS_APPEND, now=5.0) is True  # reused within 10 s
    p.observe(2, OUT_FIRST, now=5.0)
    p.expire(now=100.0)  # both watches ran out
    assert (p.alpha[SYS_APPEND], p.beta[SYS_APPEND]) == (2.0, 2.0)
    assert (p.alpha[OUT_FIRST], p.beta[OUT_FIRST]) == (1.0, 2.0)
    assert p.p_reuse(BlockType.OUTPUT, TransitionType.FIRST) == pytest.approx(1 / 3)
    p.check_integrity()


def test_reuse_after_horizon_is_not_a_success() -> None:
    p = ReusePredictor(PredictorConfig(horizon_s=10))
    p.observe(7, SYS_APPEND, now=0.0)
    assert p.observe(7, SYS_APPEND, now=11.0) is False
    assert (p.alpha[SYS_APPEND], p.beta[SYS_APPEND]) == (1.0, 2.0)


def test_priors_are_configurable_per_pair() -> None:
    p = ReusePredictor(PredictorConfig(prior_alpha=2, prior_beta=8, pair_priors={"system/append": (9, 1)}))
    assert p.p_reuse(BlockType.SYSTEM, TransitionType.APPEND) == pytest.approx(0.9)
    assert p.p_reuse(BlockType.TOOL, TransitionType.FORK) == pytest.approx(0.2)


def test_snapshot_restore_roundtrip() -> None:
    p = ReusePredictor()
    for t in range(5):
        p.observe(1, SYS_APPEND, now=float(t))
    snap = p.snapshot()
    q = ReusePredictor()
    q.restore(snap)
    assert q.snapshot() == snap and q.p_reuse_pair(SYS_APPEND) == p.p_reuse_pair(SYS_APPEND)
    with pytest.raises(ValueError):
        q.restore(PredictorSnapshot(0, (1.0,), (1.0,)))


def test_config_rejects_unknown_fields() -> None:
    with pytest.raises(Exception):
        PredictorConfig(horizon=3)  # type: ignore[call-arg]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 15), st.floats(0, 5)), max_size=200))
def test_counts_grow_by_one_outcome_per_watch(events) -> None:
    p = ReusePredictor(PredictorConfig(horizon_s=3))
    now, successes = 0.0, 0
    for block, pair, dt in events:
        now += dt
        successes += p.observe(block, pair, now)
    p.expire(now + 10)
    assert sum(p.alpha) - 16 == successes
    assert sum(p.alpha) - 16 + sum(p.beta) - 16 == len(events)  # every observation ends in one outcome
    assert all(0 < p.p_reuse_pair(i) < 1 for i in range(16))


def test_misspelt_or_bad_pair_priors_are_refused_by_name(tmp_path) -> None:
    from kvcluster.cluster_config import load_cluster_config
    from kvcluster.errors import ConfigError

    with pytest.raises(ValueError, match="unknown pair 'sytem/append'"):
        PredictorConfig(pair_priors={"sytem/append": (9, 1)})
    with pytest.raises(ValueError, match="must be positive"):
        PredictorConfig(pair_priors={"system/append": (0, 1)})
    path = tmp_path / "cluster.yaml"
    path.write_text("model: kvcluster-tiny-llama\ncheckpoint_dir: /tmp/x\npredictor: {horizon_s: -1}\n"
                    "nodes: [{name: n0, tiers: [{kind: dram, capacity: 0.01GiB}]}]\n")
    with pytest.raises(ConfigError, match="predictor.horizon_s"):
        load_cluster_config(str(path))
