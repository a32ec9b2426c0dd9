"""The reuse-gap hazard model: bins, pooled Beta posteriors, P(reuse within t), hit density."""

from __future__ import annotations

import pytest

from kvcluster.reuse_gap import GapModel, GapModelConfig, age_bin


def test_age_bins_double_after_the_first() -> None:
    assert [age_bin(a, 0.5, 21) for a in (0.0, 0.49, 0.5, 0.99, 1.0, 3.9, 4.0, 1e9)] == [0, 0, 1, 1, 2, 3, 4, 21]


def test_hazard_is_shrunk_towards_the_pooled_hazard() -> None:
    m = GapModel(2, GapModelConfig(bins=4, prior_weight=2.0))
    m.reached[0][0], m.reached[0][1], m.reused[0][0] = 8, 2, 6
    start = 1 - 0.5 ** (1 / 4)  # even odds of ever coming back, spread over the 4 bins
    pooled = (6 + start) / (8 + 1)
    assert m.hazards(0)[0] == pytest.approx((6 + 2 * pooled) / (8 + 2))
    assert m.hazards(1)[0] == pytest.approx(pooled)  # a class with no data is the population
    assert m.hazards(1)[1] == pytest.approx(pooled / 3)  # reached by 2, reused by none, prior from bin 0
    assert m.hazards(1)[3] == pytest.approx(pooled / 3)  # a bin nobody reached carries on the one before
    assert GapModel(1, GapModelConfig(bins=4)).hazards(0) == pytest.approx([start] * 4)


def test_the_prior_weighs_groups_of_the_class_s_mean_size() -> None:
    """100 uses in 100 groups are 100 observations; 100 uses in one group are one."""
    m = GapModel(3, GapModelConfig(bins=4, prior_weight=1.0))
    m.reached[0][0], m.reused[0][0], m.groups[0] = 100, 90, 100
    m.reached[1][0], m.reused[1][0], m.groups[1] = 100, 10, 1
    m.reached[2][0], m.reused[2][0] = 4, 3  # counted block by block (no groups): groups of one
    start = 1 - 0.5 ** (1 / 4)
    pooled = (103 + start) / (204 + 1)
    assert m.hazards(0)[0] == pytest.approx((90 + pooled) / (100 + 1))
    assert m.hazards(1)[0] == pytest.approx((10 + 100 * pooled) / (100 + 100))
    assert m.hazards(2)[0] == pytest.approx((3 + pooled) / (4 + 1))


def test_p_reuse_within_counts_whole_and_partial_bins() -> None:
    m = GapModel(1, GapModelConfig(bins=4, base_s=0.5))
    h = [0.5, 0.5, 0.0, 0.0]
    assert m.p_reuse_within(0, 0.0, 1.0, h) == pytest.approx(0.75)
    assert m.p_reuse_within(0, 0.0, 0.25, h) == pytest.approx(0.25)
    assert m.p_reuse_within(0, 0.5, 0.5, h) == pytest.approx(0.5)  # already survived bin 0
    assert m.p_reuse_within(0, 1.0, 100.0, h) == pytest.approx(0.0)


def test_density_prefers_the_class_that_comes_back_sooner() -> None:
    m = GapModel(2, GapModelConfig(bins=8, prior_weight=0.01))
    m.reached[0][:3], m.reused[0][:3] = [100, 100, 100], [0, 0, 90]  # back at 1-2 s
    m.reached[1][:7], m.reused[1][:7] = [100] * 7, [0, 0, 0, 0, 0, 0, 90]  # back at 16-32 s
    dens = m.densities(horizon_bin=7)
    assert dens[0][0] > dens[1][0] > 0
    assert dens[1][6] > dens[1][0]  # the slow class is worth more once it nears its gap


def test_reuses_of_blocks_admitted_from_below_count_once_their_class_is_named() -> None:
    m = GapModel(2, GapModelConfig(bins=4, prior_weight=2.0))
    m.reached[0][0], m.reused[0][0] = 8, 2
    m.reused[1][0] = 4  # reuses of blocks class 1 never counted a use of
    start = 1 - 0.5 ** (1 / 4)
    assert m.hazards(0)[0] == pytest.approx((2 + 2 * (2 + start) / 9) / 10)
    m.note_reuse_row(1)
    pooled = (6 + start) / 9
    assert m.hazards(0)[0] == pytest.approx((2 + 2 * pooled) / 10)
    assert m.hazards(1)[0] == pytest.approx(pooled)  # still no uses of its own: the population


def test_a_refresh_computes_the_hazards_and_their_densities_together() -> None:
    m = GapModel(3, GapModelConfig(bins=6))
    m.reached[0][:4], m.reused[0][:4] = [50, 40, 30, 20], [10, 10, 10, 5]
    m.reached[2][:2], m.reused[2][:2] = [9, 3], [6, 1]
    hazards, densities = m.hazards_and_densities(horizon_bin=3)
    assert hazards == m.all_hazards()
    assert densities == m.densities(3, m.all_hazards())
    assert hazards[1] == m.hazards(1) != hazards[0]  # class 1 has no data: the pooled hazard
