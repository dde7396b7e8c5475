"""Prompt lookup: the copy rule, the proposer, the fallback to a drafter, and greedy losslessness.

The law at T > 0 and every count per depth are checked against the exact enumerator in
test_decoding_exact_sampling.py (the "lookup" cases); here: the pure lookup, edge cases, and greedy
equality with Hugging Face ``generate`` for real (tiny, random) models, whose outputs repeat enough
for both kinds of block to occur.
"""

from __future__ import annotations

import pytest
import torch

from train.decoding import SamplingParams, SpeculativeDecoder
from train.decoding.costs import StepCosts
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.fallback_proposer import FallbackProposer
from train.decoding.proposers.lookup_proposer import PromptLookupProposer, lookup_continuation

from .decoding_helpers import hf_greedy

GREEDY = SamplingParams()


@pytest.mark.parametrize(
    ("sequence", "max_ngram", "min_ngram", "k", "want"),
    [
        ([5, 6, 7, 8, 5, 6], 2, 1, 4, [7, 8, 5, 6]),  # the 2-gram (5, 6) occurred at 0
        ([5, 6, 7, 6, 9, 5, 6], 2, 2, 3, [7, 6, 9]),  # 2-gram beats the later 1-gram (6)
        ([5, 6, 7, 6, 9, 4, 6], 2, 1, 3, [9, 4, 6]),  # no 2-gram: the latest 1-gram (6 at 3)
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 1, [8]),  # the latest occurrence, not the first
        ([3, 3, 3], 2, 1, 5, [3]),  # a repeat continues itself, cut at the sequence's end
        ([1, 2, 3, 4], 3, 1, 4, []),  # nothing repeats
        ([7], 2, 1, 4, []),  # too short
        ([4, 5, 4, 5], 3, 3, 2, []),  # no 3-gram, and 1-2-grams are not asked for
    ],
)
def test_lookup_continuation(sequence, max_ngram, min_ngram, k, want):
    assert lookup_continuation(sequence, max_ngram, min_ngram, k) == want


def test_lookup_proposer_cuts_at_budget_and_eos_and_counts_its_blocks():
    stats = DecodeStats()
    proposer = PromptLookupProposer(num_tokens=6, max_ngram=2, min_ngram=2)
    seq = [10, 11, 12, 13, 2, 14, 10, 11]
    draft = proposer.propose(seq, 3, GREEDY, None, frozenset(), stats)
    assert draft.tokens == [12, 13, 2] and draft.q is None and draft.is_chain
    draft = proposer.propose(seq, 5, GREEDY, None, frozenset({2}), stats)
    assert draft.tokens == [12, 13, 2]  # nothing past an end of sequence
    assert stats.lookup_blocks == 2
    assert len(proposer.propose([1, 2, 3], 5, GREEDY, None, frozenset(), stats)) == 0
    assert stats.lookup_blocks == 2 and stats.drafter_calls == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_tokens": 0}, "num_tokens"),
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "must not exceed"),
        ({"num_tokens": True}, "num_tokens"),
    ],
)
def test_lookup_proposer_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptLookupProposer(**kwargs)


class _Recorder:
    """A second proposer that records what it is asked and told."""

    hidden_layers = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def start(self) -> None:
        self.calls.append(("start", None))

    def propose(self, sequence, budget, params, generator, eos, stats):
        from train.decoding.draft import Draft

        self.calls.append(("propose", budget))
        return Draft.chain([0] * budget)

    def commit(self, length, path=None) -> None:
        self.calls.append(("commit", length))

    def observe(self, states) -> None:
        self.calls.append(("observe", tuple(states.shape)))


def test_fallback_drafts_with_the_second_only_where_nothing_is_copied_and_tells_it_every_commit():
    second = _Recorder()
    hybrid = FallbackProposer(PromptLookupProposer(8, 2, 2), second, second_budget=3)
    stats = DecodeStats()
    hybrid.start()
    copied = hybrid.propose([1, 2, 3, 1, 2], 8, GREEDY, None, frozenset(), stats)
    assert copied.tokens == [3, 1, 2]
    hybrid.commit(6)
    drafted = hybrid.propose([1, 2, 3, 4], 8, GREEDY, None, frozenset(), stats)
    assert len(drafted) == 3  # the second proposer's own cap, not the block's budget
    drafted = hybrid.propose([1, 2, 3, 4], 2, GREEDY, None, frozenset(), stats)
    assert len(drafted) == 2  # nor more than the block allows
    hybrid.observe(torch.zeros(1, 1, 4))
    assert second.calls == [
        ("start", None),
        ("commit", 6),
        ("propose", 3),
        ("propose", 2),
        ("observe", (1, 1, 4)),
    ]
    with pytest.raises(ValueError, match="second_budget"):
        FallbackProposer(PromptLookupProposer(), second, 0)


def _repetitive_prompt(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(2, 128, (5,), generator=gen)
    return torch.cat([motif, torch.randint(2, 128, (3,), generator=gen), motif[:3]]).reshape(1, -1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_lookup_first_keeps_the_greedy_output(tiny_pairs, arch):
    """Copied blocks and drafted blocks alternate (the drafter catching up on copied tokens in one
    call); the output is the verifier's greedy one, for chains of every length and the adaptive stop."""
    verifier, drafter = tiny_pairs[arch]
    copied_blocks = drafted_blocks = 0
    for seed in (0, 1, 2):
        ids = _repetitive_prompt(seed)
        ref = hf_greedy(verifier, ids, 40, eos=None)
        for gamma, k, threshold in ((1, 4, 0.0), (3, 8, 0.0), (2, 3, 0.02)):
            dec = SpeculativeDecoder(
                verifier,
                drafter,
                gamma=gamma,
                lookup_tokens=k,
                lookup_min_ngram=1,
                confidence_threshold=threshold,
            )
            res = dec.generate(ids, 40)
            assert res.tokens.tolist() == ref, (arch, seed, gamma, k)
            s = res.stats
            assert s.drafter_calls <= s.drafted  # copied drafts cost no drafter call
            assert len(s.position_drafted) <= max(gamma, k)
            copied_blocks += s.lookup_blocks
            drafted_blocks += s.verifier_calls - s.lookup_blocks
    assert copied_blocks > 10 and drafted_blocks > 10, (copied_blocks, drafted_blocks)


def test_lookup_with_eos_and_a_short_limit_matches_hf(llama_pair):
    verifier, drafter = llama_pair
    ids = _repetitive_prompt(3)
    free = hf_greedy(verifier, ids, 30, eos=None)
    eos = free[7]  # a token the greedy output reaches: generation must stop right after it
    ref = hf_greedy(verifier, ids, 30, eos=eos)
    assert ref[-1] == eos and len(ref) < 30
    for n in (1, 2, 5, 30):
        dec = SpeculativeDecoder(verifier, drafter, gamma=2, lookup_tokens=6, lookup_min_ngram=1)
        res = dec.generate(ids, n, eos_token_id=eos)
        assert res.tokens.tolist() == ref[:n], n


def test_a_gated_decoder_cuts_its_copies_by_cost(llama_pair):
    """Behind a plain-step gate with no cost-chosen length, copies are cut by a cost-aware length of their
    own under the gate's costs: where checking n tokens costs n steps no copy pays, so the blocks check
    one token (bar the probes) and the output stays Hugging Face's greedy one; where checks are flat the
    copies are checked whole. Broken on purpose (by hand): ``prompt_lookup`` ignoring ``gated`` (the
    copies uncut, as before) checks 4.05 tokens a call on the dear checks (1.66 cut) and fails."""
    verifier, drafter = llama_pair
    ids = _repetitive_prompt(0)
    ref = hf_greedy(verifier, ids, 40, eos=None)
    checked = {}
    for name, verify in (("flat", (1.0,) * 9), ("dear", tuple(float(n) for n in range(1, 10)))):
        dec = SpeculativeDecoder(
            verifier,
            drafter,
            gamma=2,
            lookup_tokens=6,
            lookup_min_ngram=1,
            plain_steps="auto",
            costs=StepCosts(verify, 0.01),
        )
        assert dec._lookup is not None and dec._lookup.length is not None
        res = dec.generate(ids, 40)
        assert res.tokens.tolist() == ref, name
        assert dec._lookup.length.costs == dec.step_costs
        checked[name] = res.stats.verifier_tokens / res.stats.verifier_calls
    assert checked["dear"] < 2.0 < 4.0 < checked["flat"], checked
    ungated = SpeculativeDecoder(verifier, drafter, gamma=2, lookup_tokens=6)
    assert ungated._lookup is not None and ungated._lookup.length is None  # copies uncut, as configured


def test_bad_lookup_settings_raise(llama_pair):
    verifier, drafter = llama_pair
    for k in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lookup_tokens"):
            SpeculativeDecoder(verifier, drafter, lookup_tokens=k)
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeDecoder(verifier, drafter, lookup_tokens=4, lookup_min_ngram=4, lookup_max_ngram=3)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0)], ids=["T0", "T1"])
def test_eagle3_behind_lookup_keeps_its_state_and_the_greedy_output(params, eagle3_verifiers, monkeypatch):
    """Copied blocks between the EAGLE-3 drafter's trees: it reads the verifier's features of every
    committed position (copied ones included) when it next drafts, its cache then equals a cache-free
    forward, and the greedy output is the verifier's."""
    from train.decoding import Eagle3Decoder

    from .test_eagle3_decoding import Spy, check_drafter_state, drafter_for

    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, "reduced")
    spy = Spy(monkeypatch)
    decoder = Eagle3Decoder(verifier, drafter, 4, 3, 10, lookup_tokens=5, lookup_min_ngram=1)
    copied = trees = 0
    for seed in (0, 1):
        ids = _repetitive_prompt(seed)
        gen = torch.Generator().manual_seed(seed)
        res = decoder.generate(ids, 30, params, generator=gen)
        if params.greedy:
            assert res.tokens.tolist() == hf_greedy(verifier, ids, 30), seed
        copied += res.stats.lookup_blocks
        trees += res.stats.verifier_calls - res.stats.lookup_blocks
    assert copied >= 3 and trees >= 3, (copied, trees)
    check_drafter_state(verifier, drafter, spy)


@pytest.mark.parametrize(
    "tree", [{"method": "specinfer", "branching": [2, 1]}, {"method": "rsd_s", "depth": 3, "beam_width": 2}]
)
def test_trees_behind_lookup_keep_the_greedy_output(tiny_pairs, tree):
    from train.decoding import TreeSpeculativeDecoder

    verifier, drafter = tiny_pairs["llama"]
    copied = trees = 0
    for seed in (0, 1):
        ids = _repetitive_prompt(seed)
        dec = TreeSpeculativeDecoder(verifier, drafter, **tree, lookup_tokens=5, lookup_min_ngram=1)
        res = dec.generate(ids, 30)
        assert res.tokens.tolist() == hf_greedy(verifier, ids, 30), (tree, seed)
        copied += res.stats.lookup_blocks
        trees += res.stats.verifier_calls - res.stats.lookup_blocks
    assert copied >= 3 and trees >= 3, (copied, trees)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0)], ids=["T0", "T1"])
@pytest.mark.parametrize(
    "shape",
    [{"draft_length": "cost"}, {"tree_nodes": 5}, {"tree_nodes": 5, "markov_rank": 8}],
    ids=["chain-cut-by-cost", "tree", "tree-markov"],
)
def test_dflash_behind_lookup_keeps_its_context_and_the_greedy_output(
    params, shape, eagle3_verifiers, monkeypatch
):
    """Copied blocks between DFlash's blocks (dflash_lookup, dflash_tree_lookup): the drafter reads the
    verifier's states of every committed position (copied ones included) when it next drafts, so each of
    its blocks equals the cache-free reference, and the greedy output is the verifier's."""
    from train.decoding import DFlashDecoder
    from train.decoding.costs import StepCosts

    from .test_dflash_decoding import Spy, drafter_for, reference_block_logits, walked

    verifier = eagle3_verifiers["llama"]
    kw = dict(shape)
    drafter = drafter_for(verifier, "reduced", block_size=5, markov_rank=kw.pop("markov_rank", 0))
    if kw.get("draft_length") == "cost":  # flat checks: the cut keeps what is likely at all
        kw["costs"] = StepCosts((1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 0.01)
    spy = Spy(monkeypatch)
    decoder = DFlashDecoder(verifier, drafter, lookup_tokens=5, lookup_min_ngram=1, **kw)
    copied = drafted = 0
    for seed in (0, 1):
        ids = _repetitive_prompt(seed)
        res = decoder.generate(ids, 30, params, generator=torch.Generator().manual_seed(seed))
        if params.greedy:
            assert res.tokens.tolist() == hf_greedy(verifier, ids, 30), seed
        copied += res.stats.lookup_blocks
        drafted += res.stats.verifier_calls - res.stats.lookup_blocks
    assert copied >= 3 and drafted >= 3, (copied, drafted)
    assert len(spy.records) >= 3
    for sequence, _, context in spy.records:
        assert context == len(sequence) - 1  # every committed position but the anchor, copies included
    if params.greedy and "tree_nodes" not in shape:  # the chain is the argmax of the reference block
        for sequence, draft, _ in spy.records:
            block = reference_block_logits(verifier, drafter, sequence)
            rows = walked(drafter, block, sequence[-1], draft.tokens)
            assert draft.tokens == drafter.draft_ids[rows.argmax(-1)].tolist()[: len(draft)]
