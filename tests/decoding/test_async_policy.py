"""The asynchronous schedule's arithmetic (train/decoding/async_policy.py): the adaptive min_ahead
policy, and whether overlapping the two models pays at all."""

import pytest

from train.decoding.async_policy import (
    acceptance_estimate,
    best_wait,
    expected_block_tokens,
    overlap_pays,
    overlapped_speedup,
    synchronous_speedup,
    verify_cost_line,
)
from train.decoding.costs import StepCosts


def test_expected_block_tokens_by_hand():
    assert expected_block_tokens(0.5, 0) == 1.0
    assert expected_block_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_block_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_block_tokens(1.0, 4) == 5.0
    assert expected_block_tokens(0.0, 4) == 1.0
    with pytest.raises(ValueError):
        expected_block_tokens(0.5, -1)


def test_best_wait_by_hand():
    # a = 0.55, a draft costs 0.08 of a call: rates k=1 1.55/1.08=1.435, k=2 1.8525/1.16=1.597,
    # k=3 2.019/1.24=1.628, k=4 2.110/1.32=1.599 -> 3
    assert best_wait(0.55, 0.08, 1.0, ready=0, gamma=8) == 3
    # drafts already published cost nothing more: take them all when acceptance is positive
    assert best_wait(0.55, 0.08, 1.0, ready=6, gamma=8) == 6
    # a useless drafter: never wait beyond one draft
    assert best_wait(0.0, 0.08, 1.0, ready=0, gamma=8) == 1
    # a perfect free drafter: the longest block
    assert best_wait(1.0, 0.0, 1.0, ready=0, gamma=8) == 8
    # dearer drafts, shorter blocks
    assert best_wait(0.8, 0.5, 1.0, 0, 8) < best_wait(0.8, 0.05, 1.0, 0, 8)
    with pytest.raises(ValueError):
        best_wait(0.5, 0.1, 1.0, 0, 0)


def test_acceptance_estimate_shrinks_towards_the_prior():
    assert acceptance_estimate(0, 0) == 0.5
    assert acceptance_estimate(3, 4) == pytest.approx(4 / 6)
    assert acceptance_estimate(900, 1000) == pytest.approx(901 / 1002)


def test_best_wait_with_a_verify_cost_per_token_and_without_waiting():
    # each token scored costs 0.3 of a call: a = 0.55 with 8 drafts ready still takes few of them:
    # k=0 1/1=1, k=1 1.55/1.3=1.19, k=2 1.8525/1.6=1.158 -> 1
    assert best_wait(0.55, 0.08, 1.0, ready=8, gamma=8, verify_per_token=0.3, wait=False) == 1
    # without waiting, nothing ready means stepping alone
    assert best_wait(0.9, 0.01, 1.0, ready=0, gamma=8, wait=False) == 0
    # a useless drafter: step alone even with drafts ready, when scoring them costs something
    assert best_wait(0.0, 0.08, 1.0, ready=4, gamma=8, verify_per_token=0.05, wait=False) == 0
    # flat verification, drafts ready, no waiting: take them all (up to gamma)
    assert best_wait(0.6, 0.08, 1.0, ready=5, gamma=4, wait=False) == 4


def test_verify_cost_line_by_hand():
    assert verify_cost_line([], []) is None
    assert verify_cost_line([3, 3], [0.2, 0.4]) == pytest.approx((0.3, 0.0))
    base, slope = verify_cost_line([1, 2, 3, 5], [1.0, 1.1, 1.2, 1.4])
    assert (base, slope) == pytest.approx((1.0, 0.1))
    # a negative fitted slope (noise) is clamped to 0, the line through the mean
    assert verify_cost_line([1, 3], [1.2, 1.0]) == pytest.approx((1.1, 0.0))


def test_overlapped_speedup_by_hand():
    # a = 0.5, one draft: 1.5 tokens; the check of 2 tokens costs 2.0 together, and half the blocks are
    # rejected and wait one drafter step of 0.5: 2.25 s; plain decoding alone takes 1.0 s a token
    alone = StepCosts(verify=(1.0, 1.0), draft=0.1)
    together = StepCosts(verify=(2.0, 2.0), draft=0.5)
    k, value = overlapped_speedup(0.5, together, alone, gamma=1)
    assert (k, value) == (1, pytest.approx(1.5 / 2.25))
    # a perfect drafter never waits for the drafter: (k + 1) / V_together(k + 1), the longest block
    assert overlapped_speedup(1.0, together, alone, gamma=3) == (3, pytest.approx(4 / 2.0))
    # the synchronous side is the cost-chosen chain's bound: a plain step (1.0x) when nothing pays
    assert synchronous_speedup(0.0, alone, 4) == (0, 1.0)
    assert synchronous_speedup(0.5, alone, 1) == (1, pytest.approx(1.5 / 1.1))


def test_overlap_pays_on_two_devices_but_not_on_shared_cores():
    alone = StepCosts(verify=(1.0, 1.05, 1.1, 1.15, 1.2), draft=0.15)
    # two devices: each model computes as fast beside the other, so hiding the drafter's steps pays
    assert overlap_pays(0.6, alone, alone, gamma=4)
    # two cores shared: the verifier on one core is 1.3x slower and the drafter 1.6x: it does not pay
    # (synchronous at best k=2: 1.96 / (1.1 + 0.3) = 1.40x; overlapped at best k=2:
    # 1.96 / (1.3 * 1.1 + 0.64 * 2 * 0.24) = 1.13x; on two devices 1.96 / (1.1 + 0.64 * 0.3) = 1.52x)
    shared = StepCosts(verify=tuple(1.3 * t for t in alone.verify), draft=1.6 * alone.draft)
    assert not overlap_pays(0.6, shared, alone, gamma=4)
    assert overlapped_speedup(0.6, shared, alone, 4) == (2, pytest.approx(1.96 / (1.43 + 0.3072)))
    # a drafter never accepted: a plain step beats any block, overlapped or not
    assert not overlap_pays(0.0, alone, alone, gamma=4)
    # a tie does not pay: a free drafter gains nothing from being hidden
    free = StepCosts(verify=alone.verify, draft=0.0)
    assert not overlap_pays(0.6, free, free, gamma=4)
