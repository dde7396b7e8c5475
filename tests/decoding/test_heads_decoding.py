"""Decoding with prediction heads (MedusaDecoder): greedy equality with HF ``generate`` for random
and for oracle heads (long accepted paths through the sparse tree, EOS and limits), and the exact
output law at T > 0 (deterministic candidates verified by sampling p without replacement)."""

from __future__ import annotations

import itertools

import pytest
import torch

from train.decoding import MedusaDecoder, SamplingParams, chain_choices, warp
from train.decoding.heads import DEFAULT_CHOICES
from train.models.heads import MedusaHeads

from .decoding_helpers import build, hf_greedy, tiny_config
from .spec_reference import chi2_critical, chi_square, run_many


def random_heads(verifier, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads.from_verifier(verifier, 4, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return heads


class OracleHeads(torch.nn.Module):
    """Test double: recognises which position of a reference greedy run a hidden state belongs to and
    returns one-hot logits for the reference tokens that follow (rank 0 right, so trees accept long
    paths; ranks 1.. wrong)."""

    def __init__(self, verifier, prompt: list[int], reference: list[int], num_heads: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        with torch.no_grad():
            out = verifier(torch.tensor([prompt + reference]), output_hidden_states=True)
        self.states = out.hidden_states[-1][0]
        self.sequence = prompt + reference
        self.vocab = out.logits.shape[-1]
        self.num_heads = num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = int((self.states - hidden.to(self.states.dtype)).norm(dim=-1).argmin())
        logits = torch.zeros(self.num_heads, self.vocab)
        for k in range(self.num_heads):
            logits[k] = torch.arange(self.vocab, dtype=torch.float32) * 1e-3  # a fixed order for ranks 1..
            if t + k + 2 < len(self.sequence):
                logits[k, self.sequence[t + k + 2]] = 10.0
        return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("tree", ["default", "chain"])
def test_greedy_equals_hf_generate_with_random_heads(arch, tree, tiny_pairs):
    verifier, _ = tiny_pairs[arch]
    decoder = MedusaDecoder(verifier, random_heads(verifier), None if tree == "default" else chain_choices(3))
    for prompt, n in (([0, 5, 9, 3, 7], 25), ([0, 44], 6)):
        ids = torch.tensor([prompt])
        assert decoder.generate(ids, n).tokens.tolist() == hf_greedy(verifier, ids, n)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_oracle_heads_accept_long_paths_eos_and_limits(arch, tiny_pairs):
    verifier, _ = tiny_pairs[arch]
    prompt = [0, 5, 9, 3, 7]
    ids = torch.tensor([prompt])
    reference = hf_greedy(verifier, ids, 40)
    decoder = MedusaDecoder(verifier, OracleHeads(verifier, prompt, reference))
    result = decoder.generate(ids, 40)
    assert result.tokens.tolist() == reference
    assert result.stats.verifier_calls <= 40 // 4 + 2  # about depth + 1 = 5 tokens per call
    for eos in reference[3:10]:
        assert (
            decoder.generate(ids, 40, eos_token_id=eos).tokens.tolist()
            == reference[: reference.index(eos) + 1]
        )
    for n in range(1, 7):
        assert decoder.generate(ids, n).tokens.tolist() == reference[:n]


def test_bad_trees_are_rejected(tiny_pairs):
    verifier, _ = tiny_pairs["llama"]
    heads = random_heads(verifier)
    for tree in ([], [[0], [0]], [[0, 1]], [[-1]]):
        with pytest.raises(ValueError):
            MedusaDecoder(verifier, heads, tree)
    assert len(MedusaDecoder(verifier, heads).tree) == len(DEFAULT_CHOICES)


VOCAB = 6


@pytest.fixture(scope="module")
def small_verifier():
    return build(tiny_config("llama", hidden=32, vocab=VOCAB), 5).double()


def exact_law(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=n):
            prob = 1.0
            for i in range(n):
                p = warp(model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1], params)
                prob *= float(p[seq[i]])
                if prob == 0.0:
                    break
            if prob > 0:
                law[seq] = prob
    return law


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4)], ids=["T1", "T0.7-top_k4"]
)
def test_sampled_output_law_is_the_verifiers(small_verifier, params):
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    heads = random_heads(small_verifier, seed=3)
    decoder = MedusaDecoder(small_verifier, heads, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    result = run_many(decoder, prompt, n_new, params, runs, seed=0)
    stat, df = chi_square(result.counts, law, runs)
    assert stat < chi2_critical(df), (stat, df)
    assert sum(s.accepted for s in result.stats) > 0.2 * runs  # the tree's candidates were accepted often


def test_sampling_test_catches_a_residual_drawn_from_p(small_verifier, monkeypatch):
    """Broken on purpose: after every candidate is rejected, draw from p instead of p without them."""
    from train.decoding import verification as rules

    original = rules.recursive_rejection

    def residual_from_p(p, candidates, q, kind, u_accept, u_next):
        choice, token = original(p, candidates, q, kind, u_accept, u_next)
        return choice, torch.where(choice >= 0, token, rules.sample_with_uniform(p, u_next))

    monkeypatch.setattr("train.decoding.tree.recursive_rejection", residual_from_p)
    params = SamplingParams(1.0)
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    decoder = MedusaDecoder(
        small_verifier,
        random_heads(small_verifier, seed=3),
        [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    )
    stat, df = chi_square(run_many(decoder, prompt, n_new, params, runs, seed=0).counts, law, runs)
    assert stat > chi2_critical(df), (stat, df)
