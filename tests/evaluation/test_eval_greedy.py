"""The temperature-0 check: a low-precision tie is recorded, any other difference is an error."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.evaluation.fakes import SwapDecoder, inline
from train.decoding import AutoregressiveDecoder, SamplingParams
from train.evaluation import EvalConfig, GreedyMismatchError, evaluate_drafters, results_table
from train.evaluation.greedy import classify_difference, first_difference, float32_logits, ulp

POSITION = 2


@pytest.fixture(scope="module")
def tied(verifier, prompts):
    """(verifier whose lm_head rows of tokens a and b are identical, a, b): an exact tie between a and
    b at new token POSITION of prompt 0, where greedy decoding picks a (the lower id wins ties)."""
    greedy = (
        AutoregressiveDecoder(verifier).generate(prompts[0], POSITION + 1, SamplingParams()).tokens.tolist()
    )
    a = greedy[POSITION]
    b = 259 if a != 259 else 258
    if b < a:  # argmax keeps the first maximal id: b must come after a for greedy to stay a
        pytest.skip("greedy token is the last id")
    model = copy.deepcopy(verifier)
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
    return model, a, b


def _cfg(decoder: dict, **kw) -> EvalConfig:
    base = dict(
        temperatures=[0.0], seeds=[0], max_new_tokens=POSITION + 3, warmup=False, progress=False, plots=False
    )
    return EvalConfig(decoders=[decoder], **{**base, **kw})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_ulp_follows_the_dtype_and_magnitude():
    assert ulp(torch.float32, 1.0) == torch.finfo(torch.float32).eps
    assert ulp(torch.bfloat16, 8.0) == 8 * torch.finfo(torch.bfloat16).eps
    assert ulp(torch.float32, 0.0) > 0


def test_float32_logits_of_a_low_precision_model(verifier, prompts):
    model = copy.deepcopy(verifier).to(torch.bfloat16)
    logits = float32_logits(model, prompts[0])
    assert logits.dtype == torch.float32 and logits.shape == (260,)
    own = model(prompts[0]).logits[0, -1].float()
    assert torch.allclose(logits, own, atol=4 * ulp(torch.bfloat16, own.abs().max().item()))


def test_exact_tie_is_recorded_not_raised(tied, prompts):
    model, a, b = tied
    results = evaluate_drafters(
        model, {"d": model}, prompts[:1], _cfg(inline(SwapDecoder, "swap", position=POSITION, token=b))
    )
    (run,) = results["runs"]
    assert run["greedy_match"] is True and run["greedy_mismatches"] == []
    (tie,) = run["greedy_ties"]
    assert tie["prompt"] == 0 and tie["seed"] == 0 and tie["position"] == POSITION
    assert tie["tokens"] == [a, b] and tie["margin"] == 0.0 and tie["tie"] is True
    table = results_table(results)
    assert "yes (1 tie)" in table and f"greedy {a} vs decoder {b}" in table
    greedy = AutoregressiveDecoder(model).generate(prompts[0], POSITION + 1, SamplingParams()).tokens.tolist()
    record = classify_difference(model, prompts[0], greedy, greedy[:POSITION] + [b], tie_ulps=0.0)
    assert record is not None and record["tie"]  # exact: a tie even with no tolerance


def test_other_difference_is_a_mismatch(tied, prompts):
    model, a, _ = tied
    other = (a + 1) % 256
    cfg = _cfg(inline(SwapDecoder, "swap", position=POSITION, token=other))
    with pytest.raises(
        GreedyMismatchError, match=rf"swap with drafter 'd', seed 0, prompt 0, new token {POSITION}"
    ):
        evaluate_drafters(model, {"d": model}, prompts[:1], cfg)
    relaxed = _cfg(inline(SwapDecoder, "swap", position=POSITION, token=other), strict_greedy=False)
    (run,) = evaluate_drafters(model, {"d": model}, prompts[:1], relaxed)["runs"]
    assert run["greedy_match"] is False and run["greedy_ties"] == []
    (miss,) = run["greedy_mismatches"]
    assert miss["tokens"] == [a, other] and miss["margin"] > miss["tolerance"]
