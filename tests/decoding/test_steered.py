"""Steered speculative decoding (SD^2): greedy equality with HF ``generate`` for a random nonzero
steering module, the exact output law at T > 0, a zero module equal to no steering for the same seed,
the guide refreshed once per verification, and the drafter left unsteered afterwards."""

from __future__ import annotations

import pytest
import torch

from train.decoding import SamplingParams, SpeculativeDecoder
from train.models.steering import SteeringModule

from .decoding_helpers import build, hf_greedy, tiny_config
from .spec_reference import chi2_critical, chi_square, run_many
from .test_heads_decoding import VOCAB, exact_law, small_verifier  # noqa: F401 -- fixture


def random_steering(verifier, drafter, scale: float = 0.5, seed: int = 0) -> SteeringModule:
    module = SteeringModule.for_pair(verifier, drafter)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = module.project.weight
        w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale)
    return module


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_hf_generate_with_a_nonzero_steering_module(arch, tiny_pairs):
    verifier, drafter = tiny_pairs[arch]
    steering = random_steering(verifier, drafter)
    decoder = SpeculativeDecoder(verifier, drafter, gamma=4, steering=steering)
    plain = SpeculativeDecoder(verifier, drafter, gamma=4)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    before = drafter(ids).logits
    for prompt, n in (([0, 5, 9, 3, 7], 30), ([0, 44], 5)):
        p = torch.tensor([prompt])
        result = decoder.generate(p, n)
        assert result.tokens.tolist() == hf_greedy(verifier, p, n)
    stats = result.stats
    assert stats.guide_time > 0
    # the steering changed the drafter's q (its expected acceptance under sampling, same seed) and left
    # the drafter plain afterwards
    params = SamplingParams(temperature=1.0)
    steered = decoder.generate(ids, 30, params, generator=torch.Generator().manual_seed(0)).stats
    unsteered = plain.generate(ids, 30, params, generator=torch.Generator().manual_seed(0)).stats
    assert steered.sum_expected_acceptance != pytest.approx(unsteered.sum_expected_acceptance)
    assert torch.equal(drafter(ids).logits, before)


def test_a_zero_module_equals_no_steering_for_the_same_seed(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    zero = SpeculativeDecoder(verifier, drafter, gamma=4, steering=SteeringModule.for_pair(verifier, drafter))
    plain = SpeculativeDecoder(verifier, drafter, gamma=4)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    params = SamplingParams(temperature=1.0)
    for seed in range(3):
        a = zero.generate(ids, 24, params, generator=torch.Generator().manual_seed(seed))
        b = plain.generate(ids, 24, params, generator=torch.Generator().manual_seed(seed))
        assert a.tokens.tolist() == b.tokens.tolist() and a.stats.accepted == b.stats.accepted


def test_sampled_output_law_is_the_verifiers(small_verifier):  # noqa: F811 -- the fixture
    drafter = build(tiny_config("llama", hidden=16, vocab=VOCAB), 7).double()
    steering = random_steering(small_verifier, drafter, scale=2.0)
    params = SamplingParams(1.0)
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    decoder = SpeculativeDecoder(small_verifier, drafter, gamma=2, steering=steering)
    result = run_many(decoder, prompt, n_new, params, runs, seed=0)
    stat, df = chi_square(result.counts, law, runs)
    assert stat < chi2_critical(df), (stat, df)
    assert sum(s.accepted for s in result.stats) > 0.2 * runs


def test_a_module_for_another_pair_is_refused(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    module = SteeringModule.for_pair(verifier, drafter)
    wide = build(tiny_config("llama", 96), 3)
    with pytest.raises(ValueError, match="hidden size is 96"):
        SpeculativeDecoder(wide, drafter, steering=module)
