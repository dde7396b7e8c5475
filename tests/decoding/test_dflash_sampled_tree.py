"""A tree sampled from a DFlash block at T > 0 (``DFlashDecoder(sampled_tree=[...])``): every node carries
the q its siblings were drawn from (the slot's warped row, with DSpark's Markov bias of the node's
parent), siblings are distinct and as many as the setting asks, nothing grows under an eos, T = 0 keeps
the greedy output, bad settings are refused; the exact output law at T = 1 (slow), alone, with a Markov
head and behind the gate with its cut chain, and a flattened q caught (broken on purpose)."""

from __future__ import annotations

import pytest
import torch

from train.decoding import DFlashDecoder, SamplingParams
from train.decoding.costs import StepCosts
from train.decoding.proposers import dflash_proposer
from train.decoding.proposers.dflash_slots import BlockSlots, sample_tree
from train.decoding.sampling import warp
from train.decoding.tree_attention import ancestors
from train.models import markov_head

from .decoding_helpers import hf_greedy
from .spec_reference import chi2_critical
from .test_dflash_decoding import Spy, drafter_for, law_statistic, reference_block_logits, walked
from .test_eagle3_decoding import PROMPTS


@pytest.mark.parametrize(
    ("markov_rank", "table", "widths", "params"),
    [
        (0, True, [3, 2], SamplingParams(1.0)),
        (8, True, [2, 2, 1], SamplingParams(1.0)),
        (8, False, [3, 1, 1], SamplingParams(0.7, top_k=5)),
    ],
    ids=["dflash-3-2", "markov-table-2-2-1", "markov-computed-3-1-1-T0.7-top_k5"],
)
def test_every_node_carries_the_q_its_siblings_were_drawn_from(
    markov_rank, table, widths, params, eagle3_verifiers, monkeypatch
):
    """Each node's q is its slot's row of the cache-free reference block, with a Markov head plus the
    bias of the node's parent's token (the anchor for the first depth), divided by ``draft_temperature``
    and warped; its token lies in that q's support; every expanded node has ``widths[depth]`` distinct
    children in draw order; the draft is marked as drawn without replacement."""
    if not table:
        monkeypatch.setattr(markov_head, "MARKOV_TABLE_BYTES", 0)
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, "reduced", seed=2, block_size=4, markov_rank=markov_rank)
    spy = Spy(monkeypatch)
    decoder = DFlashDecoder(verifier, drafter, draft_temperature=0.8, sampled_tree=widths)
    decoder.generate(torch.tensor([PROMPTS[0]]), 24, params, generator=torch.Generator().manual_seed(0))
    assert len(spy.records) > 3
    full = 0
    for sequence, draft, _ in spy.records:
        assert draft.kind == "without_replacement" and not draft.is_chain
        block = reference_block_logits(verifier, drafter, sequence)
        depths = draft.depths()
        deepest = max(depths)  # shallower than the setting only where the budget ends first
        full += deepest == len(widths)
        for node in [-1, *range(len(draft))]:
            kids = draft.children(node)
            depth = 0 if node < 0 else depths[node]
            assert len(kids) == (widths[depth] if depth < deepest else 0), (node, depth)
            assert len({draft.tokens[k] for k in kids}) == len(kids)
            assert [draft.rank[k] for k in kids] == list(range(len(kids)))
        lineage = ancestors(draft.parents)
        for i, token in enumerate(draft.tokens):
            path = [draft.tokens[a] for a in lineage[i]]
            row = walked(drafter, block, sequence[-1], path)[depths[i] - 1]
            want = warp(row.float()[None] / 0.8, params)[0]
            assert draft.q is not None and draft.columns is not None
            torch.testing.assert_close(draft.q[i], want, atol=1e-5, rtol=1e-4)
            assert draft.q[i, draft.columns[i]] > 0 and int(drafter.draft_ids[draft.columns[i]]) == token
    assert full > len(spy.records) / 2


def test_no_node_grows_under_an_eos_and_the_tree_stops_at_the_last_slot(eagle3_verifiers):
    """A slot whose likeliest token is an eos: the node that drew it has no children, its siblings do;
    a tree deeper than the logits it is given stops at their last row."""
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, "full", seed=2, block_size=4)
    slots = BlockSlots(drafter, drafter.draft_ids, 1.0)
    n = drafter.draft_ids.shape[0]
    logits = torch.zeros(3, n)
    logits[0, 5] = 8.0  # the first depth draws id 5 first, almost surely
    generator = torch.Generator().manual_seed(0)
    draft = sample_tree(slots, logits, 1, [3, 1, 1], SamplingParams(1.0), generator, frozenset({5}))
    depths = draft.depths()
    eos_nodes = [i for i, t in enumerate(draft.tokens) if t == 5 and depths[i] == 1]
    assert eos_nodes and not draft.children(eos_nodes[0])
    others = [i for i in draft.children(-1) if draft.tokens[i] != 5]
    assert len(others) == 2 and all(len(draft.children(i)) == 1 for i in others)
    shallow = sample_tree(slots, logits[:1], 1, [3, 1, 1], SamplingParams(1.0), generator, frozenset())
    assert len(shallow) == 3 and max(shallow.depths()) == 1


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_greedy_output_is_unchanged_by_a_sampled_tree(markov_rank, eagle3_verifiers):
    """T = 0 drafts the block's chain (or the tree of ``tree_nodes``) as before: the output is HF's."""
    verifier = eagle3_verifiers["qwen3"]
    for kw in ({"sampled_tree": [3, 1]}, {"sampled_tree": [2, 2], "tree_nodes": 4}):
        drafter = drafter_for(verifier, "reduced", block_size=4, markov_rank=markov_rank)
        decoder = DFlashDecoder(verifier, drafter, **kw)
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            reference = hf_greedy(verifier, ids, 13)
            assert decoder.generate(ids, 13).tokens.tolist() == reference
            eos = reference[3]
            assert decoder.generate(ids, 13, eos_token_id=eos).tokens.tolist() == reference[:4]


def test_bad_sampled_trees_are_refused(eagle3_verifiers):
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, block_size=4)  # 3 slots
    for bad in ([], [0], [2, True], [2, 1, 1, 1], "3"):
        with pytest.raises(ValueError, match="sampled_tree"):
            DFlashDecoder(verifier, drafter, sampled_tree=bad)


# ----------------------------------------------------------------------------- the law at T > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "decoder_kw",
    [
        {"sampled_tree": [3, 2]},
        {"sampled_tree": [2, 2, 1], "markov_rank": 8},
        {
            "sampled_tree": [3, 1],
            "plain_steps": "auto",
            "fallback_cut": True,
            "costs": StepCosts((1.0, 1.0, 1.6, 2.2, 2.4, 2.6, 2.8), 0.1),
        },
    ],
    ids=["T1-sampled-tree", "T1-markov-sampled-tree", "T1-gated-sampled-tree-falling-back-on-its-cut"],
)
def test_a_sampled_trees_output_law_is_the_verifiers(eagle3_law_verifier, decoder_kw):
    """About a minute each: 4,000 seeded runs against the verifier's law (the power is stated in
    test_dflash_decoding.py's law test, the same prompt and runs)."""
    stat, df, accepted = law_statistic(eagle3_law_verifier, SamplingParams(1.0), **decoder_kw)
    assert stat < chi2_critical(df), (stat, df)
    assert accepted > 0.1 * 4000  # drafts were accepted often: the rule was exercised


@pytest.mark.slow
def test_law_test_catches_a_sampled_tree_handed_a_flattened_q(eagle3_law_verifier, monkeypatch):
    """Broken on purpose: the siblings are drawn from the slot's q, the rule is handed q**0.5,
    renormalised."""
    original = dflash_proposer.sample_tree

    def flattened_q(*args):
        draft = original(*args)
        if draft.q is not None:
            flat = draft.q.sqrt()
            draft.q = flat / flat.sum(-1, keepdim=True)
        return draft

    monkeypatch.setattr(dflash_proposer, "sample_tree", flattened_q)
    stat, df, _ = law_statistic(eagle3_law_verifier, SamplingParams(1.0), sampled_tree=[3, 2])
    assert stat > chi2_critical(df), (stat, df)
