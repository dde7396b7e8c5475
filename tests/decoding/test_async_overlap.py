"""Whether the asynchronous decoder overlaps its two models (``overlap="auto"``): the costs measured
with both computing at once (train/decoding/overlap_probe.py), and the decoder's choice, which follows
those costs and the acceptance seen so far and keeps the output the verifier's either way."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import train.decoding.decoders.async_decoder as async_decoder
from train.decoding import AsyncSpeculativeDecoder, SpeculativeDecoder
from train.decoding.costs import StepCosts
from train.decoding.model_call import TimedModel
from train.decoding.overlap_probe import measure_together

from .decoding_helpers import hf_greedy

PROMPT = [0, 5, 9, 3, 7]
ALONE = StepCosts(verify=(1.0, 1.05, 1.1, 1.15, 1.2), draft=0.15)
#: Two cores shared: the verifier 1.3x slower beside the drafter, the drafter 1.6x.
SHARED = StepCosts(verify=tuple(1.3 * t for t in ALONE.verify), draft=1.6 * ALONE.draft)


def _threads() -> int:
    return sum(t.name == "draftsmith-drafter" for t in threading.enumerate())


class ThreadCount(torch.nn.Module):
    """Records the intra-op thread count each forward runs with; raises after ``fail_after`` calls (and
    sets ``failed``); with ``wait_for``, each forward first waits (up to 30 s) for that event."""

    def __init__(
        self,
        model: torch.nn.Module,
        fail_after: int | None = None,
        wait_for: threading.Event | None = None,
    ) -> None:
        super().__init__()
        self.model, self.fail_after, self.wait_for = model, fail_after, wait_for
        self.seen: list[int] = []
        self.failed = threading.Event()

    def forward(self, *args, **kwargs):
        self.seen.append(torch.get_num_threads())
        if self.wait_for is not None:
            self.wait_for.wait(30)
        if self.fail_after is not None and len(self.seen) > self.fail_after:
            self.failed.set()
            raise RuntimeError("boom")
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)


def test_the_probe_times_the_verifier_beside_a_stepping_drafter(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    v, d = ThreadCount(verifier), ThreadCount(drafter)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = measure_together(TimedModel(v), TimedModel(d), 4, repeats=2)
        assert torch.get_num_threads() == 2  # the caller's setting comes back
    finally:
        torch.set_num_threads(before)
    assert len(costs.verify) == 4 and list(costs.verify) == sorted(costs.verify)
    assert costs.draft > 0
    # each side ran with half the threads, as the asynchronous schedule runs them
    assert set(v.seen) == {1} and set(d.seen) == {1}
    assert len(d.seen) > 1  # the drafter stepped while the verifier was timed
    assert _threads() == 0


def test_the_probe_raises_the_drafters_error_and_leaves_no_thread(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    failing = ThreadCount(drafter, fail_after=3)  # fails mid-measurement: the verifier waits for it
    with pytest.raises(RuntimeError, match="boom"):
        measure_together(
            TimedModel(ThreadCount(verifier, wait_for=failing.failed)), TimedModel(failing), 4, repeats=1
        )
    assert _threads() == 0


@pytest.fixture
def counted(monkeypatch):
    """Fixed step costs (``costs["alone"]``, ``costs["together"]``) instead of measured ones; returns the
    costs to set and the list of generations that ran the asynchronous schedule."""
    costs = {"alone": ALONE, "together": ALONE}
    runs: list[str] = []
    real = async_decoder.run_asynchronous

    def run(*args, **kwargs):
        runs.append("async")
        return real(*args, **kwargs)

    monkeypatch.setattr(async_decoder, "run_asynchronous", run)
    monkeypatch.setattr(async_decoder, "together_costs", lambda *a, **k: costs["together"])
    monkeypatch.setattr(SpeculativeDecoder, "measure_costs", lambda self: costs["alone"])
    return costs, runs


def test_it_overlaps_where_overlap_pays_and_runs_synchronously_where_not(tiny_pairs, counted):
    costs, runs = counted
    verifier, _ = tiny_pairs["llama"]
    drafter = copy.deepcopy(verifier)  # every draft accepted
    reference = hf_greedy(verifier, torch.tensor([PROMPT]), 30)
    two_devices = AsyncSpeculativeDecoder(verifier, drafter, gamma=4)
    for _ in range(2):
        assert two_devices.generate(torch.tensor([PROMPT]), 30).tokens.tolist() == reference
    assert runs == ["async", "async"]
    assert two_devices.step_costs == ALONE  # the report's bound uses the costs alone
    costs["together"] = SHARED
    shared_cores = AsyncSpeculativeDecoder(verifier, drafter, gamma=4)
    result = shared_cores.generate(torch.tensor([PROMPT]), 30)
    assert result.tokens.tolist() == reference
    assert runs == ["async", "async"]  # synchronous: no drafter thread ran
    assert result.stats.overlap_time == 0
    always = AsyncSpeculativeDecoder(verifier, drafter, gamma=4, overlap="always")
    assert always.generate(torch.tensor([PROMPT]), 30).tokens.tolist() == reference
    assert runs == ["async", "async", "async"]


def test_a_drafter_that_is_never_accepted_stops_being_overlapped(tiny_pairs, counted):
    """Overlap pays on two devices at the prior acceptance (0.5), not once the drafts prove useless."""
    _, runs = counted
    verifier, drafter = tiny_pairs["llama"]  # an unrelated random drafter: acceptance near 0
    reference = hf_greedy(verifier, torch.tensor([PROMPT]), 40)
    decoder = AsyncSpeculativeDecoder(verifier, drafter, gamma=4, idle="wait")
    for _ in range(3):
        assert decoder.generate(torch.tensor([PROMPT]), 40).tokens.tolist() == reference
    assert runs == ["async"]


def test_bad_overlap_is_refused(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    with pytest.raises(ValueError, match="overlap must be one of"):
        AsyncSpeculativeDecoder(verifier, drafter, overlap="sometimes")
