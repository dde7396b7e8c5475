"""train.evaluation.task_metrics: ROUGE-L over token ids (hand-computed cases) and per-token NLL
(against a direct torch computation on a tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from train.evaluation.task_metrics import continuation_nll, lcs_length, rouge_l, token_nll


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("ABCBDAB", "BDCABA", 4),  # the textbook case (BCBA, BDAB, ...)
        ("AGGTAB", "GXTXAYB", 4),  # GTAB
        ("abc", "abc", 3),
        ("abc", "cba", 1),
        ("abc", "xyz", 0),
        ("", "abc", 0),
        ("abc", "", 0),
    ],
)
def test_lcs_length_hand_computed(a, b, expected):
    ids = {c: i for i, c in enumerate(sorted(set(a + b)))}
    assert lcs_length([ids[c] for c in a], [ids[c] for c in b]) == expected
    assert lcs_length([ids[c] for c in b], [ids[c] for c in a]) == expected  # symmetric


def test_rouge_l_hand_computed():
    # candidate [1, 2, 3, 4] vs reference [1, 3, 4, 5, 6]: LCS [1, 3, 4] = 3; P = 3/4, R = 3/5
    r = rouge_l([1, 2, 3, 4], [1, 3, 4, 5, 6])
    assert r.precision == pytest.approx(0.75) and r.recall == pytest.approx(0.6)
    assert r.f1 == pytest.approx(2 * 0.75 * 0.6 / (0.75 + 0.6))  # 2/3
    assert rouge_l([7, 7, 7], [7, 7, 7]).f1 == 1.0
    assert rouge_l([1, 2], [3, 4]).f1 == 0.0
    assert rouge_l([], [1, 2]) == rouge_l([1, 2], []) == rouge_l([], [])
    assert rouge_l([], [1]).f1 == 0.0
    # repeated tokens count once per match: [5, 5] in [5, 1, 5, 1] -> LCS 2, P 1, R 1/2
    assert rouge_l([5, 5], [5, 1, 5, 1]).f1 == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_token_nll_matches_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    targets = torch.randint(0, 7, (2, 5), generator=g)
    for t in (1.0, 0.5, 2.0):
        want = torch.nn.functional.cross_entropy(
            (logits / t).flatten(0, 1), targets.flatten(), reduction="none"
        ).view(2, 5)
        torch.testing.assert_close(token_nll(logits, targets, temperature=t), want)
    with pytest.raises(ValueError, match="temperature"):
        token_nll(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        token_nll(logits, targets[:, :4])


def _direct_nll(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """-log softmax(logits)[token] read position by position from one full forward, in float64."""
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([prompt + continuation])).logits[0].double().log_softmax(-1)
    return torch.tensor(
        [-float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(continuation)], dtype=torch.float64
    )


def test_continuation_nll_matches_a_direct_computation():
    model = tiny_llama(seed=3)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 6), generator=g)
    continuation = torch.randint(0, 256, (7,), generator=g).tolist()
    got = continuation_nll(model, prompt, continuation)
    assert got.shape == (7,) and got.dtype == torch.float32
    want = _direct_nll(model, prompt[0].tolist(), continuation)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # every generated token is scored, the last one included
    longer = [*continuation, 9]
    torch.testing.assert_close(
        continuation_nll(model, prompt, longer).double(),
        _direct_nll(model, prompt[0].tolist(), longer),
        atol=1e-5,
        rtol=1e-5,
    )
    # a one-token prompt (BOS alone) scores the first token after it
    torch.testing.assert_close(
        continuation_nll(model, [256], continuation).double(),
        _direct_nll(model, [256], continuation),
        atol=1e-5,
        rtol=1e-5,
    )
    # temperature scales the logits; an empty continuation is scored without running the model
    hot = continuation_nll(model, prompt[0].tolist(), continuation, temperature=2.0)
    assert not torch.allclose(hot, got)
    assert continuation_nll(model, prompt, []).shape == (0,)
    with pytest.raises(ValueError, match="prompt"):
        continuation_nll(model, [], continuation)
