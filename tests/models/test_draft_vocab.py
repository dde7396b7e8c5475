"""The pure functions of train/models/draft_vocab.py against hand computations: the most frequent ids,
the divergence over the draft vocabulary (verifier renormalised there) and the acceptance decoding sees
(the verifier's whole distribution, q = 0 outside the draft ids). The wrapper itself and decoding with
it: tests/decoding/test_draft_vocab.py; DistillSpec on such a drafter:
tests/methods/test_draft_vocab_training.py."""

from __future__ import annotations

import pytest
import torch

from train.losses import acceptance_from_logits
from train.models.draft_vocab import (
    argmax_agreement,
    draft_acceptance,
    draft_divergence,
    draft_rows_of,
    frequent_tokens,
    restrict_logits,
    scatter_draft_logits,
    vocab_index,
)

V = 12
IDS = torch.tensor([0, 2, 3, 7, 11])


def test_frequent_tokens_counts_breaks_ties_by_id_and_keeps_the_always_ids():
    seqs = [[5, 5, 5, 3, 3, 9], [9, 9, 4, 4, 1]]  # 9: 3, 5: 3, 3: 2, 4: 2, 1: 1
    assert frequent_tokens(seqs, 3) == [3, 5, 9]  # 3 and 4 tie at 2: the lower id
    assert frequent_tokens(seqs, 3, always=[11]) == [5, 9, 11]
    assert frequent_tokens({9: 3, 5: 3, 3: 2, 4: 2}, 2) == [5, 9]  # counts work as well
    assert frequent_tokens(seqs, 7) == sorted([9, 5, 3, 4, 1, 0, 2])  # unseen ids fill from 0 up
    assert frequent_tokens([], 2, always=[7, 7]) == [0, 7]
    with pytest.raises(ValueError, match="more than n"):
        frequent_tokens(seqs, 1, always=[1, 2])


def _logits(seed: int, *shape: int) -> torch.Tensor:
    return 2.0 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _hand(name: str, q: torch.Tensor, p: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position divergence from probabilities (the module docstring of train/losses.py)."""
    if name == "fkl":
        return (p * (p / q).log()).sum(-1)
    if name == "rkl":
        return (q * (q / p).log()).sum(-1)
    if name == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draft_divergence_renormalises_the_verifier_over_the_draft_ids(name, temperature):
    drafter = _logits(0, 2, 3, len(IDS))
    verifier = _logits(1, 2, 3, V)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    p = torch.softmax(verifier / temperature, -1)[..., IDS]
    p = p / p.sum(-1, keepdim=True)  # renormalised over the draft ids
    q = torch.softmax(drafter / temperature, -1)
    want = _hand(name, q, p, 0.3)[mask].mean()
    got = draft_divergence(name, drafter, verifier, IDS, mask, temperature=temperature, beta=0.3)
    torch.testing.assert_close(got, want)


def test_draft_divergence_trains_the_draft_logits():
    drafter = _logits(0, 4, len(IDS)).float().requires_grad_()
    draft_divergence("fkl", drafter, _logits(1, 4, V).float(), IDS).backward()
    assert drafter.grad is not None and torch.isfinite(drafter.grad).all() and drafter.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draft_acceptance_is_sum_min_p_q_with_q_zero_outside_the_draft_ids(temperature):
    drafter = _logits(2, 2, 3, len(IDS))
    verifier = _logits(3, 2, 3, V)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    p = torch.softmax(verifier / temperature, -1)  # the whole verifier: its mass outside is never accepted
    q = torch.zeros_like(p)
    q[..., IDS] = torch.softmax(drafter / temperature, -1)
    want = torch.minimum(p, q).sum(-1)[mask].mean()
    got = draft_acceptance(drafter, verifier, IDS, mask, temperature=temperature)
    torch.testing.assert_close(got, want)
    over_draft_ids = acceptance_from_logits(
        drafter, restrict_logits(verifier, IDS), mask, temperature=temperature
    )
    assert float(got) < float(over_draft_ids)  # the renormalised figure would overstate it


def test_scatter_and_restrict_are_inverse_on_the_draft_ids():
    x = _logits(4, 3, len(IDS))
    full = scatter_draft_logits(x, IDS, V)
    assert full.shape == (3, V) and torch.equal(restrict_logits(full, IDS), x)
    outside = torch.ones(V, dtype=torch.bool)
    outside[IDS] = False
    assert torch.isneginf(full[:, outside]).all()
    assert torch.equal(torch.softmax(full, -1)[:, outside], torch.zeros(3, int(outside.sum()), dtype=x.dtype))


def test_draft_rows_of_is_vocab_index_without_the_vocabulary_size():
    draft = torch.tensor([0, 3, 4, 9, 15])
    ids = torch.tensor([[0, 1, 3, 9], [15, 16, 4, 2]])
    torch.testing.assert_close(draft_rows_of(ids, draft), vocab_index(draft, 17)[ids])


def test_argmax_agreement_counts_matching_top_tokens():
    verifier = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])  # tops 1, 0, 2
    drafter = torch.tensor([[[0.0, 9.0, 1.0], [0.0, 4.0, 1.0], [1.0, 0.0, 2.0]]])  # tops 1, 1, 2
    assert float(argmax_agreement(drafter, verifier)) == pytest.approx(2 / 3)
    mask = torch.tensor([[True, True, False]])
    assert float(argmax_agreement(drafter, verifier, mask)) == pytest.approx(0.5)
    assert float(argmax_agreement(drafter, verifier, torch.zeros_like(mask))) == 0.0
    # a drafter padded past the verifier's vocabulary: only the common ids count
    padded = torch.cat([drafter, torch.full((1, 3, 2), 50.0)], dim=-1)
    assert float(argmax_agreement(padded, verifier)) == pytest.approx(2 / 3)


def test_argmax_agreement_over_a_draft_vocabulary():
    verifier = torch.full((1, 2, 6), -1.0)
    verifier[0, 0, 4] = 2.0  # the verifier's top: id 4, then id 1
    verifier[0, 1, 1] = 2.0
    draft_ids = torch.tensor([1, 4])  # the drafter's rows are ids 1 and 4
    drafter = torch.tensor([[[0.0, 3.0], [0.0, 3.0]]])  # picks id 4 both times
    assert float(argmax_agreement(drafter, verifier, draft_ids=draft_ids)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="leading"):
        argmax_agreement(drafter[:, :1], verifier, draft_ids=draft_ids)
