"""Adaptive k: drafts more when drafts are accepted, stops when they are not, and tries again later."""

import pytest

from hf_specdec.adaptive import AdaptiveK


def test_high_acceptance_drafts_the_most():
    policy = AdaptiveK(num_rows=2, max_k=8, token_cost_ratio=0.18)
    for _ in range(10):
        policy.update([0, 1], [8, 8], [8, 8])
    assert policy.choose([0, 1]) == 8


def test_low_acceptance_switches_speculation_off():
    policy = AdaptiveK(num_rows=1, max_k=8, token_cost_ratio=0.18)
    for _ in range(10):
        policy.update([0], [4], [0])
    assert policy.choose([0]) == 0


def test_idle_rows_drift_back_and_are_tried_again():
    policy = AdaptiveK(num_rows=1, max_k=8, token_cost_ratio=0.18)
    for _ in range(10):
        policy.update([0], [4], [0])
    steps = 0
    while policy.choose([0]) == 0:
        policy.update([0], [0], [0])
        steps += 1
        assert steps < 100
    assert steps > 2  # not immediately


@pytest.mark.parametrize("rate,expected", [(0.5, 2), (0.8, 5), (0.3, 1)])
def test_k_maximises_expected_tokens_per_cost(rate, expected):
    policy = AdaptiveK(num_rows=1, max_k=10, token_cost_ratio=0.18, prior=rate)
    assert policy.choose([0]) == expected


def test_expensive_drafting_lowers_k():
    cheap = AdaptiveK(num_rows=1, max_k=10, token_cost_ratio=0.18, prior=0.8)
    dear = AdaptiveK(num_rows=1, max_k=10, token_cost_ratio=0.18, draft_cost_per_token=0.3, prior=0.8)
    assert dear.choose([0]) < cheap.choose([0])
    as_big_as_target = AdaptiveK(num_rows=1, max_k=10, token_cost_ratio=0.18, draft_cost_per_token=1.0, prior=0.95)
    assert as_big_as_target.choose([0]) == 0  # a draft as costly as the target never pays


def test_larger_batches_draft_less():
    policy = AdaptiveK(num_rows=16, max_k=10, token_cost_ratio=0.18, prior=0.7)
    assert policy.choose(list(range(16))) < policy.choose([0])
    assert abs(policy.verify_cost_per_token(1) - 0.153) < 0.001  # 5 tokens cost 1.6 steps at batch 1, as measured
