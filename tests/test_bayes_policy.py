"""The `bayes-v1` policy (GreedyDual over the Beta predictor): value ordering, prefix-closed eviction, integrity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcluster.block_types import BlockType, TransitionType
from policy_support import check_invariants
from kvcluster.policies.base import RequestContext
from kvcluster.policies.bayes_v1 import BayesV1Policy as BayesPolicy
from kvcluster.predictor import PredictorConfig, ReusePredictor


def ctx(i: int, n: int, block_type: BlockType = BlockType.HISTORY, transition=TransitionType.FIRST, now=None):
    return RequestContext(index=i, now=float(i if now is None else now), block_types=(int(block_type),) * n,
                          transition=int(transition))


def test_suffix_is_evicted_before_its_prefix() -> None:
    policy = BayesPolicy(capacity=4)
    policy.access([1, 2, 3, 4], ctx(0, 4))
    evicted = policy.access([9], ctx(1, 1))
    assert evicted == [4]  # the tail of the older chain, never its head
    for i, block in enumerate([10, 11, 12], start=2):
        policy.access([block], ctx(i, 1))
        resident = [b in policy for b in (1, 2, 3, 4)]
        assert resident == sorted(resident, reverse=True)  # what is left is always a prefix
        policy.check_integrity()


def test_blocks_of_a_class_that_gets_reused_outlive_one_that_does_not() -> None:
    predictor = ReusePredictor(PredictorConfig(horizon_s=5, pair_priors={"system/first": (9, 1), "output/first": (1, 9)}))
    policy = BayesPolicy(capacity=2, predictor=predictor)
    policy.access([1], ctx(0, 1, BlockType.SYSTEM))
    policy.access([2], ctx(1, 1, BlockType.OUTPUT))
    evicted = policy.access([3], ctx(2, 1, BlockType.OUTPUT))
    assert evicted == [2]  # P(reuse) 0.9 beats 0.1 although block 1 is older
    assert 1 in policy and 3 in policy


def test_a_block_reused_before_ranks_above_a_fresh_one_of_its_class() -> None:
    policy = BayesPolicy(capacity=2)
    policy.access([1], ctx(0, 1))
    policy.access([1], ctx(1, 1))  # reused: its own Beta evidence rises
    policy.access([2], ctx(2, 1))
    assert policy.value(1, 4, 0) > policy.value(2, 4, 0)


def test_capacity_zero_holds_nothing() -> None:
    policy = BayesPolicy(capacity=0)
    assert sorted(policy.access([1, 2], ctx(0, 2))) == [1, 2]
    assert len(policy) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=40))
def test_invariants(capacity, token_runs) -> None:
    check_invariants(BayesPolicy(capacity), capacity, token_runs, lambda i, blocks: ctx(i, len(blocks)))
