"""When a refused draft is tried anyway (train/decoding/probes.py)."""

from __future__ import annotations

import pytest

from train.decoding.probes import Probes


def _refusals(probes: Probes, n: int) -> list[bool]:
    return [probes.refused() for _ in range(n)]


def test_the_interval_doubles_after_each_probe_that_does_not_pay_up_to_the_longest() -> None:
    probes = Probes(first=2, longest=8)
    assert _refusals(probes, 2) == [False, True]
    assert _refusals(probes, 4) == [False, False, False, True] and probes.gap == 4
    assert _refusals(probes, 8) == [False] * 7 + [True] and probes.gap == 8
    assert _refusals(probes, 8) == [False] * 7 + [True] and probes.gap == 8  # capped


def test_a_decision_on_its_merits_starts_the_interval_again() -> None:
    probes = Probes(first=2, longest=16)
    assert _refusals(probes, 6) == [False, True, False, False, False, True]
    probes.accepted()  # the last probe paid: the next decision drafted
    assert probes.gap == 2 and _refusals(probes, 2) == [False, True]
    # an acceptance between refusals clears the count without a probe
    probes = Probes(first=3, longest=3)
    assert _refusals(probes, 2) == [False, False]
    probes.accepted()
    assert _refusals(probes, 3) == [False, False, True]


def test_a_fixed_interval_when_first_is_longest() -> None:
    assert _refusals(Probes(first=3, longest=3), 9) == [False, False, True] * 3


@pytest.mark.parametrize(("first", "longest"), [(0, 8), (9, 8)])
def test_bad_intervals_are_refused(first: int, longest: int) -> None:
    with pytest.raises(ValueError, match="first <= longest"):
        Probes(first, longest)
