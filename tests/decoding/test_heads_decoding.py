"""Decoding with prediction heads (HeadsDecoder): greedy equality with HF ``generate`` for random
and for oracle heads (long accepted paths through the sparse tree, EOS and limits), and the exact
output law at T > 0 (deterministic candidates verified by sampling p without replacement)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from train.decoding import Draft, HeadsDecoder, SamplingParams, chain_choices, warp
from train.decoding.block_step import committed_tokens
from train.decoding.proposers.heads_proposer import DEFAULT_CHOICES, tree_from_accuracies
from train.decoding.rules.typical import TypicalAcceptance, typical_bound, verify_typical
from train.models.heads import MedusaHeads

from .decoding_helpers import build, hf_greedy, tiny_config
from .spec_reference import chi2_critical, chi_square, run_many


def random_heads(verifier, seed: int = 0, draft_vocab: list[int] | None = None) -> MedusaHeads:
    """Heads from the verifier's lm_head (over ``draft_vocab``'s rows only when given), blocks perturbed."""
    heads = MedusaHeads.from_verifier(verifier, 4, 1, draft_vocab=draft_vocab)
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
    decoder = HeadsDecoder(verifier, random_heads(verifier), None if tree == "default" else chain_choices(3))
    for prompt, n in (([0, 5, 9, 3, 7], 25), ([0, 44], 6)):
        ids = torch.tensor([prompt])
        assert decoder.generate(ids, n).tokens.tolist() == hf_greedy(verifier, ids, n)


@pytest.mark.parametrize("tree", ["default", "chain"])
def test_greedy_equals_hf_generate_with_heads_over_a_draft_vocabulary(tree, tiny_pairs):
    """Heads projecting onto every third id (the rest -inf): candidates from the draft rows only, output
    unchanged."""
    verifier, _ = tiny_pairs["llama"]
    heads = random_heads(verifier, draft_vocab=list(range(0, int(verifier.config.vocab_size), 3)))
    decoder = HeadsDecoder(verifier, heads, None if tree == "default" else chain_choices(3))
    for prompt, n in (([0, 5, 9, 3, 7], 25), ([0, 44], 6)):
        ids = torch.tensor([prompt])
        result = decoder.generate(ids, n)
        assert result.tokens.tolist() == hf_greedy(verifier, ids, n)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_oracle_heads_accept_long_paths_eos_and_limits(arch, tiny_pairs):
    verifier, _ = tiny_pairs[arch]
    prompt = [0, 5, 9, 3, 7]
    ids = torch.tensor([prompt])
    reference = hf_greedy(verifier, ids, 40)
    decoder = HeadsDecoder(verifier, OracleHeads(verifier, prompt, reference))
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
            HeadsDecoder(verifier, heads, tree)
    assert len(HeadsDecoder(verifier, heads).tree) == len(DEFAULT_CHOICES)


@pytest.mark.parametrize("num_heads", [1, 2, 3])
def test_the_default_tree_fits_fewer_heads(num_heads, tiny_pairs):
    verifier, _ = tiny_pairs["qwen3"]
    heads = MedusaHeads.from_verifier(verifier, num_heads, 1)
    decoder = HeadsDecoder(verifier, heads)
    assert decoder.depth == num_heads
    assert decoder.tree == [p for p in DEFAULT_CHOICES if len(p) <= num_heads]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    assert decoder.generate(ids, 12).tokens.tolist() == hf_greedy(verifier, ids, 12)
    with pytest.raises(ValueError, match="deep but the heads number"):  # a tree given is never cut
        HeadsDecoder(verifier, heads, chain_choices(num_heads + 1))


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
    ("params", "draft_vocab"),
    [
        pytest.param(SamplingParams(1.0), None, id="T1"),
        # 20-30 s each: slow (CI runs them), with the default suite kept near its 5 minutes
        pytest.param(SamplingParams(0.7, top_k=4), None, id="T0.7-top_k4", marks=pytest.mark.slow),
        pytest.param(SamplingParams(1.0), [0, 2, 3, 5], id="T1-draft-vocab", marks=pytest.mark.slow),
    ],
)
def test_sampled_output_law_is_the_verifiers(small_verifier, params, draft_vocab):
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    heads = random_heads(small_verifier, seed=3, draft_vocab=draft_vocab)
    decoder = HeadsDecoder(small_verifier, heads, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    result = run_many(decoder, prompt, n_new, params, runs, seed=0)
    stat, df = chi_square(result.counts, law, runs)
    assert stat < chi2_critical(df), (stat, df)
    assert sum(s.accepted for s in result.stats) > 0.2 * runs  # the tree's candidates were accepted often


@pytest.mark.slow  # the same break of the same rule fails test_tree.py's law test in the default suite
def test_sampling_test_catches_a_residual_drawn_from_p(small_verifier, monkeypatch):
    """Broken on purpose: after every candidate is rejected, draw from p instead of p without them."""
    import train.decoding.rules.recursive as rules

    original = rules.recursive_rejection

    def residual_from_p(p, candidates, q, kind, u_accept, u_next):
        choice, token = original(p, candidates, q, kind, u_accept, u_next)
        return choice, torch.where(choice >= 0, token, rules.sample_with_uniform(p, u_next))

    monkeypatch.setattr("train.decoding.rules.tree_walk.recursive_rejection", residual_from_p)
    params = SamplingParams(1.0)
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    decoder = HeadsDecoder(
        small_verifier,
        random_heads(small_verifier, seed=3),
        [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    )
    stat, df = chi_square(run_many(decoder, prompt, n_new, params, runs, seed=0).counts, law, runs)
    assert stat > chi2_critical(df), (stat, df)


# ----------------------------------------------------------------------------- trees from accuracies


@functools.cache
def _closed_trees(max_depth: int, max_rank: int, size: int) -> list[frozenset[tuple[int, ...]]]:
    """Every tree of ``size`` paths (ranks < max_rank, depth <= max_depth) that holds each path's parent.
    A path does not need its lower-rank siblings: the proposer drafts any path whose parent it drafts,
    and the verifier accepts a candidate for being its token, whatever the siblings."""
    paths = [p for d in range(1, max_depth + 1) for p in itertools.product(range(max_rank), repeat=d)]
    return [
        frozenset(combo)
        for combo in itertools.combinations(paths, size)
        if all(len(p) == 1 or p[:-1] in combo for p in combo)
    ]


def _expected_length(tree, acc) -> float:
    total = 0.0
    for path in tree:
        chance = 1.0
        for depth, rank in enumerate(path):
            chance *= acc[depth][rank]
        total += chance
    return total


ACCURACIES = {
    "falling with rank": [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.02]],
    "not falling with rank": [[0.2, 0.6, 0.1], [0.1, 0.3, 0.5], [0.05, 0.4, 0.2]],
    "ties, zeros and ones": [[0.3, 0.3, 0.0], [0.0, 0.7, 0.7], [1.0, 0.0, 0.5]],
}


@pytest.mark.parametrize("accuracy", list(ACCURACIES), ids=list(ACCURACIES))
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_tree_from_accuracies_is_the_best_tree_of_its_size(size, accuracy):
    acc = ACCURACIES[accuracy]
    tree = tree_from_accuracies(acc, size)
    assert len(tree) == size and all(len(p) == 1 or p[:-1] in tree for p in tree)
    best = max(_expected_length(t, acc) for t in _closed_trees(3, 3, size))
    assert _expected_length(tree, acc) == pytest.approx(best, abs=1e-12)


def test_tree_from_accuracies_by_hand():
    # head 0 is sure of its top-1, head 1 is split between ranks 0 and 1
    assert tree_from_accuracies([[0.9, 0.05], [0.45, 0.4]], 3) == ((0,), (0, 0), (0, 1))
    assert tree_from_accuracies([[0.9, 0.05]], 5) == ((0,), (1,))  # no more paths than heads x ranks
    # a rank more accurate than the ranks before it is taken without them
    assert tree_from_accuracies([[0.2, 0.6]], 1) == ((1,),)
    assert tree_from_accuracies([[0.9], [0.1, 0.5, 0.4]], 3) == ((0,), (0, 1), (0, 2))
    assert tree_from_accuracies([[0.1, 0.2, 0.7], [0.3, 0.0, 0.9]], 3) == ((2,), (2, 0), (2, 2))
    with pytest.raises(ValueError):
        tree_from_accuracies([[0.5]], 0)
    with pytest.raises(ValueError, match="head 1 rank 0"):
        tree_from_accuracies([[0.5], [1.5]], 2)


def test_tree_from_accuracies_takes_the_likeliest_paths_at_real_sizes():
    acc = torch.rand(5, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # in no order
    tree = tree_from_accuracies(acc.tolist(), 64)
    assert len(tree) == 64 and all(len(p) == 1 or p[:-1] in tree for p in tree)
    chosen = min(_expected_length([p], acc.tolist()) for p in tree)
    chance = torch.ones(())
    for depth in range(5):  # every path's chance, depth by depth (10 + 100 + ... + 100 000 paths)
        chance = (chance.unsqueeze(-1) * acc[depth]).to(torch.float64)
        left = chance.clone()
        for p in tree:
            if len(p) == depth + 1:
                left[p] = -1.0
        assert float(left.max()) <= chosen + 1e-15  # no path left out beats a chosen one


def test_decoder_takes_the_tree_the_heads_carry_and_refuses_other_verifiers(tiny_pairs, tmp_path):
    verifier, _ = tiny_pairs["llama"]
    heads = random_heads(verifier).with_tree([[0], [1], [0, 0]])
    heads.save_pretrained(tmp_path / "heads")
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert loaded.tree == [[0], [1], [0, 0]]
    assert HeadsDecoder(verifier, loaded).tree == [(0,), (1,), (0, 0)]
    assert HeadsDecoder(verifier, loaded, chain_choices(2)).tree == [(0,), (0, 0)]
    other, _ = tiny_pairs["qwen3"]
    if other.config.hidden_size == verifier.config.hidden_size:
        other = build(tiny_config("llama", hidden=verifier.config.hidden_size * 2), 1)
    with pytest.raises(ValueError, match="another verifier"):
        HeadsDecoder(other, heads)
    with pytest.raises(ValueError, match="5 deep"):
        HeadsDecoder(verifier, heads, chain_choices(5))


# ----------------------------------------------------------------------------- typical acceptance (lossy)


def test_typical_bound_and_rule_by_hand():
    flat = torch.full((4,), 0.25)
    sure = torch.tensor([0.97, 0.01, 0.01, 0.01])
    # flat: H = log 4, alpha * exp(-H) = 0.3 / 4 = 0.075 < 0.09; sure: 0.3 * exp(-H) > 0.09
    assert typical_bound(flat, 0.09, 0.3) == pytest.approx(0.075)
    assert typical_bound(sure, 0.09, 0.3) == pytest.approx(0.09)
    # tree: node 0 (token 0) and node 1 (token 3) under the context, node 2 (token 2) under node 1
    logits = torch.log(torch.stack([sure, flat, flat, sure]))  # rows: context, node 0, node 1, node 2
    draft = Draft([0, 3, 2], [-1, -1, 1], None, [0, 1, 0])
    rule = TypicalAcceptance(0.09, 0.3)
    params = SamplingParams(1.0)
    g = torch.Generator().manual_seed(0)
    verdict = verify_typical(logits, draft, params, g, frozenset(), rule)
    assert verdict.path == [0]  # token 3 has p 0.01 after the context: node 1 and its child are cut
    assert verdict.next is not None
    # the next token comes from p after node 0 (flat) restricted to tokens above 0.075: any of the 4
    # after a sure row only the argmax is above 0.09
    verdict = verify_typical(logits[[0, 3]], Draft([0], [-1], None, [0]), params, g, frozenset(), rule)
    assert verdict.path == [0] and verdict.next == 0
    # an accepted EOS ends the block: the block step commits it and no token after it
    verdict = verify_typical(logits, draft, params, g, frozenset({0}), rule)
    settled = committed_tokens(draft, verdict, frozenset({0}), room=10)
    assert verdict.path == [0] and settled.tokens == [0] and settled.done


def test_typical_acceptance_is_greedy_at_t0_and_marked_lossy(tiny_pairs):
    verifier, _ = tiny_pairs["llama"]
    decoder = HeadsDecoder(verifier, random_heads(verifier), acceptance="typical")
    assert not decoder.lossless and HeadsDecoder(verifier, random_heads(verifier)).lossless
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    assert decoder.generate(ids, 20).tokens.tolist() == hf_greedy(verifier, ids, 20)
    with pytest.raises(ValueError, match="acceptance"):
        HeadsDecoder(verifier, random_heads(verifier), acceptance="greedy")


@pytest.mark.slow
def test_typical_acceptance_changes_the_output_law(small_verifier):
    """The rule is lossy: its output law differs from the verifier's, and the same chi-square test that
    passes the lossless rule sees it."""
    params = SamplingParams(1.0)
    prompt, n_new, runs = [1, 2], 3, 3000
    law = exact_law(small_verifier, prompt, n_new, params)
    decoder = HeadsDecoder(
        small_verifier,
        random_heads(small_verifier, seed=3),
        [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
        acceptance="typical",
        posterior_threshold=0.3,
        posterior_alpha=0.9,
    )
    stat, df = chi_square(run_many(decoder, prompt, n_new, params, runs, seed=0).counts, law, runs)
    assert stat > chi2_critical(df), (stat, df)


def test_tree_nodes_builds_a_tree_from_the_heads_measured_accuracies(tiny_pairs):
    verifier, _ = tiny_pairs["llama"]
    accuracy = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.1, 0.0], [0.2, 0.1, 0.0]]
    heads = random_heads(verifier).with_tree(None, accuracy)
    for n in (1, 4, 9):
        assert HeadsDecoder(verifier, heads, tree_nodes=n).tree == list(tree_from_accuracies(accuracy, n))
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    assert HeadsDecoder(verifier, heads, tree_nodes=9).generate(ids, 12).tokens.tolist() == hf_greedy(
        verifier, ids, 12
    )
    with pytest.raises(ValueError, match="rank accuracies"):
        HeadsDecoder(verifier, random_heads(verifier), tree_nodes=4)
