"""Tree speculative decoding (SpecInfer, RSD-C, RSD-S): tree attention, cache compaction, greedy
equality with Hugging Face ``generate``, the exact output law at T > 0, sibling sampling without
replacement, and broken variants that the distribution test must catch.

Exact law at T > 0: table-driven fakes on 4 ids (id 3 is the EOS) whose next-token logits depend on
the current token and its *position* (``position_ids`` of a tree forward included), with a cache that
``keep_positions`` can compact. The verifier's own law of the first tokens is enumerated
(``verifier_joint``) and the decoder's output counts over N runs are compared with a chi-square
(alpha 1e-4). Power: the same statistic on decoders broken on purpose (siblings verified as i.i.d.
when they were drawn without replacement, the residual drawn from p, acceptance scaled by 0.97) is
asserted to exceed the critical value (``test_distribution_test_catches_broken_rules``). Measured when written
(seeds 0 and 5): at N = 3000 the wrong sibling kind gives a
statistic of 379 and the residual from p 158 against a critical value of 78 (df 37); the 3% bias needs
N = 20000 (352-383 for RSD-C, 356-413 for SpecInfer, critical value 95 at df 49, correct decoders
48-74), so that one runs in the ``slow`` suite. The default suite checks one seed per case; ``-m slow``
adds every case at two more seeds.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

import train.decoding.rules.recursive as rules
from train.decoding import (
    AutoregressiveDecoder,
    SamplingParams,
    SpeculativeDecoder,
    TimedModel,
    TreeSpeculativeDecoder,
    keep_positions,
    warp,
)
from train.decoding.proposers.tree_proposers import (
    TreeProposer,
    gumbel_scores,
    gumbel_top_k,
    on_support,
    sbs_scores,
    sbs_top,
)
from train.decoding.tree_attention import tree_attention_mask, tree_position_ids

from .decoding_helpers import build, hf_greedy, tiny_config
from .spec_reference import chi2_critical, chi_square, peaked_table_lm, run_many, table_next, verifier_joint

METHODS = {
    "specinfer": dict(method="specinfer", branching=(2, 2, 1)),
    "rsd_c": dict(method="rsd_c", branching=(2, 2, 1)),
    "rsd_s": dict(method="rsd_s", depth=3, beam_width=3),
}


# ------------------------------------------------------------------------------ tree attention


def full_last(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@torch.no_grad()
def test_tree_logits_equal_sequential_paths_and_compacted_cache_equals_fresh(arch):
    model = build(tiny_config(arch, 64), 3).double()
    timed = TimedModel(model)
    prompt = [5, 17, 33, 2, 9]
    cached = timed(prompt[:-2], None, logits_to_keep=1)  # the cache holds 3 tokens; 2 come with the tree
    parents = [-1, -1, 0, 0, 1, 2]
    tokens = [40, 41, 42, 43, 44, 45]
    depths = [1, 1, 2, 2, 2, 3]
    out = timed(
        prompt[-2:] + tokens,
        cached.cache,
        position_ids=tree_position_ids(3, 2, depths),
        attention_mask=tree_attention_mask(3, 2, parents, torch.float64),
        logits_to_keep=None,
    )
    paths = {0: [40], 1: [41], 2: [40, 42], 3: [40, 43], 4: [41, 44], 5: [40, 42, 45]}
    torch.testing.assert_close(out.logits[1], full_last(model, prompt), atol=1e-10, rtol=0)
    for node, path in paths.items():
        torch.testing.assert_close(out.logits[2 + node], full_last(model, prompt + path), atol=1e-10, rtol=0)
    # accept 40 -> 42 -> 45: keep those entries after the prompt, compacted
    n = len(prompt)
    assert keep_positions(out.cache, [*range(n), n + 0, n + 2, n + 5]) == n + 3
    nxt = timed([7], out.cache, logits_to_keep=1)
    torch.testing.assert_close(nxt.logits[-1], full_last(model, prompt + [40, 42, 45, 7]), atol=1e-10, rtol=0)


@pytest.mark.parametrize("method", list(METHODS))
@torch.no_grad()
def test_drafter_expands_the_tree_with_the_logits_of_each_path(method, tiny_pairs):
    """Every node's children were drawn from the drafter's distribution after that node's path
    (one forward per depth, tree mask over the drafter's cache)."""
    _, drafter = tiny_pairs["llama"]
    kw = {k: v for k, v in METHODS[method].items() if k != "method"}
    proposer = TreeProposer(TimedModel(drafter), 128, method, **kw)
    params = SamplingParams(temperature=1.0)
    stats = SimpleNamespace(
        drafter_calls=0, drafter_time=0.0, drafter_prefill_calls=0, drafter_prefill_time=0.0
    )
    seq = [3, 8, 21, 4]
    proposer.start()
    draft = proposer.propose(seq, 3, params, torch.Generator().manual_seed(0), frozenset(), stats)
    assert stats.drafter_calls == 3  # the prefix, then one forward per depth below the first
    assert draft.q is not None and len(draft) == draft.q.shape[0]
    lines = {-1: []}
    for i, parent in enumerate(draft.parents):
        lines[i] = [*lines[parent], draft.tokens[i]]
        expected = warp(full_last(drafter, seq + lines[parent]), params)
        torch.testing.assert_close(draft.q[i], expected, atol=1e-5, rtol=1e-4)
    depths = draft.depths()
    assert max(depths) == 3
    if method == "rsd_s":
        assert all(depths.count(d) <= 3 for d in (1, 2, 3))
    else:
        assert [depths.count(d) for d in (1, 2, 3)] == [2, 4, 4]


# ------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_equals_hf_generate(arch, method, tiny_pairs):
    verifier, drafter = tiny_pairs[arch]
    decoder = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method])
    for prompt, n in (([0, 5, 9, 3, 7], 23), ([0, 44], 9), ([0, 12, 99, 100, 7, 7, 8], 1)):
        ids = torch.tensor([prompt])
        result = decoder.generate(ids, n)
        assert result.tokens.tolist() == hf_greedy(verifier, ids, n), (arch, method, prompt)
        stats = result.stats
        assert stats.new_tokens == n and stats.verifier_calls <= n
        assert stats.verifier_tokens >= stats.verifier_calls  # every call scores its tree and context


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_a_drafter_close_to_the_verifier(arch, method, tiny_pairs):
    """Long accepted paths, some through second children: the compacted caches must hold exactly the
    accepted path (a crop to the accepted length would keep the wrong tree nodes)."""
    verifier, _ = tiny_pairs[arch]
    drafter = copy.deepcopy(verifier)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=gen))
    decoder = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method])
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    result = decoder.generate(ids, 40)
    assert result.tokens.tolist() == hf_greedy(verifier, ids, 40)
    assert result.stats.accepted >= 20  # the paths were long: the test exercised compaction


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_stops_at_eos_and_never_overshoots_the_limit(method, tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    decoder = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method])
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 30)
    for eos in ref[1:12]:  # every token of the reference as the EOS in turn: inside trees, as bonus, ...
        out = decoder.generate(ids, 30, eos_token_id=eos).tokens.tolist()
        assert out == ref[: ref.index(eos) + 1]
    for n in range(1, 8):
        assert decoder.generate(ids, n).tokens.tolist() == ref[:n]
    assert decoder.generate(ids, 0).tokens.tolist() == []


def test_a_one_child_tree_is_chain_speculative_decoding(tiny_pairs):
    verifier, drafter = tiny_pairs["qwen3"]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    chain = SpeculativeDecoder(verifier, drafter, gamma=3).generate(ids, 20)
    tree = TreeSpeculativeDecoder(verifier, drafter, method="rsd_c", branching=(1, 1, 1)).generate(ids, 20)
    assert tree.tokens.tolist() == chain.tokens.tolist()
    assert tree.stats.verifier_calls == chain.stats.verifier_calls
    assert tree.stats.accepted == chain.stats.accepted


def test_bad_shapes_are_rejected(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    for kw in (
        dict(method="beam"),
        dict(method="rsd_c"),
        dict(method="rsd_c", branching=(2, 0)),
        dict(method="specinfer", branching=(2,), depth=2),
        dict(method="rsd_s", depth=3),
        dict(method="rsd_s", depth=0, beam_width=2),
        dict(method="rsd_s", depth=2, beam_width=2, branching=(2,)),
    ):
        with pytest.raises(ValueError):
            TreeSpeculativeDecoder(verifier, drafter, **kw)


# ------------------------------------------------------------------------------ sampling without replacement


def test_gumbel_top_k_draws_without_replacement_with_the_right_first_draw():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(n):
        tokens, _ = gumbel_top_k(torch.log(q), 3, torch.rand(5, generator=gen, dtype=torch.float64))
        assert len(set(tokens.tolist())) == 3 and 4 not in tokens.tolist()
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    torch.testing.assert_close(first / n, q, atol=0.015, rtol=0)
    # P(second = j) = sum_i q_i q_j / (1 - q_i)
    expected = torch.stack([sum(q[i] * q[j] / (1 - q[i]) for i in range(5) if i != j) for j in range(5)])
    torch.testing.assert_close(second / n, expected.float(), atol=0.015, rtol=0)


def test_sbs_scores_keep_the_gumbel_order_and_the_parents_maximum():
    log_phi = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]], dtype=torch.float64))
    u = torch.tensor([[0.3, 0.9, 0.6, 0.5], [0.2, 0.7, 0.4, 0.9]], dtype=torch.float64)
    parents = torch.tensor([0.0, -1.5], dtype=torch.float64)
    scores = sbs_scores(parents, log_phi, u)
    plain = gumbel_scores(log_phi, u)
    for row in range(2):
        finite = torch.isfinite(plain[row])
        assert scores[row][finite].argsort().tolist() == plain[row][finite].argsort().tolist()
        assert abs(float(scores[row].max()) - float(parents[row])) < 1e-12  # the best child keeps it
    assert scores[0, 3] == -float("inf")  # q = 0: never a child
    top, tokens = sbs_top(parents, log_phi, u, 2)  # what the proposer computes: each row's best 2
    expected, expected_tokens = scores.topk(2, dim=-1)
    torch.testing.assert_close(top, expected, atol=1e-12, rtol=0)
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.parametrize("method", ["rsd_c", "rsd_s"])
def test_siblings_without_replacement_are_distinct(method, tiny_pairs):
    _, drafter = tiny_pairs["gpt2"]
    kw = {"rsd_c": dict(branching=(4, 3, 2)), "rsd_s": dict(depth=3, beam_width=4)}[method]
    proposer = TreeProposer(TimedModel(drafter), 128, method, **kw)
    stats = SimpleNamespace(
        drafter_calls=0, drafter_time=0.0, drafter_prefill_calls=0, drafter_prefill_time=0.0
    )
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=2.0, top_k=8)  # a small support makes repeats likely for i.i.d.
    for _ in range(20):
        proposer.start()
        draft = proposer.propose([0, 6, 50], 3, params, gen, frozenset(), stats)
        for node in [-1, *range(len(draft))]:
            kids = [draft.tokens[c] for c in draft.children(node)]
            assert len(kids) == len(set(kids)), (method, node, kids)


def test_specinfer_siblings_repeat():
    """The i.i.d. baseline does draw the same token twice among siblings (why RSD beats it)."""
    _, drafter = build(tiny_config("gpt2", 64), 1), build(tiny_config("gpt2", 32), 2)
    proposer = TreeProposer(TimedModel(drafter), 128, "specinfer", branching=(4,))
    stats = SimpleNamespace(
        drafter_calls=0, drafter_time=0.0, drafter_prefill_calls=0, drafter_prefill_time=0.0
    )
    gen = torch.Generator().manual_seed(1)
    repeats = 0
    for _ in range(20):
        proposer.start()
        draft = proposer.propose(
            [0, 6, 50], 1, SamplingParams(temperature=2.0, top_k=3), gen, frozenset(), stats
        )
        repeats += len(draft.tokens) - len(set(draft.tokens))
    assert repeats > 0


# ------------------------------------------------------------------------------ exact output law


class _KV:
    def __init__(self) -> None:
        self.keys = torch.zeros(1, 1, 0, 1)
        self.values = torch.zeros(1, 1, 0, 1)


class TreeFakeCache:
    """A one-layer cache of token ids that ``crop`` and ``keep_positions`` can edit."""

    def __init__(self) -> None:
        self.layers = [_KV()]

    def get_seq_length(self) -> int:
        return int(self.layers[0].keys.shape[-2])

    def crop(self, n: int) -> None:
        keep = self.get_seq_length() + n if n < 0 else n
        layer = self.layers[0]
        layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]

    @property
    def tokens(self) -> list[int]:
        return [int(x) for x in self.layers[0].keys.flatten().tolist()]


class PositionalTableLM(torch.nn.Module):
    """A ``TableLM`` (logits = table[token] + pos_bias[position % P]) that takes ``position_ids`` (tree
    forwards) and keeps a :class:`TreeFakeCache`; attention masks do not change its output."""

    def __init__(self, table_lm) -> None:
        super().__init__()
        self.table, self.pos_bias = table_lm.table, table_lm.pos_bias
        self.config = table_lm.config

    def forward(self, input_ids, past_key_values=None, use_cache=True, position_ids=None, **kwargs):
        cache = TreeFakeCache() if past_key_values is None else past_key_values
        start = cache.get_seq_length()
        ids = input_ids[0]
        pos = torch.arange(start, start + len(ids)) if position_ids is None else position_ids[0].cpu()
        layer = cache.layers[0]
        new = ids.float().view(1, 1, -1, 1)
        layer.keys = torch.cat([layer.keys, new], dim=-2)
        layer.values = torch.cat([layer.values, new], dim=-2)
        logits = self.table[ids] + self.pos_bias[pos % self.pos_bias.shape[0]]
        return SimpleNamespace(logits=logits[None], past_key_values=cache)


V, EOS = 4, 3
PROMPT = (2, 0)
T1 = SamplingParams(temperature=1.0)


def fake_pair(kind: str):
    verifier = peaked_table_lm(V, 1, 3.0, 0.0)
    drafter = {
        "q!=p": peaked_table_lm(V, 2, 4.5, 1.5),
        "q=p": verifier,
        "generic": peaked_table_lm(V, 5, 1.0, 0.5, jitter=1.2),
    }[kind]
    return PositionalTableLM(verifier), PositionalTableLM(drafter), verifier


@functools.cache
def exact_law(params: SamplingParams, max_new: int) -> dict:
    _, _, verifier = fake_pair("q!=p")
    return verifier_joint(table_next(verifier, params), PROMPT, max_new, (EOS,))


def sample_counts(decoder, params, max_new: int, n: int, seed: int):
    return run_many(decoder, PROMPT, max_new, params, n, seed, eos=EOS)


CASES = {  # name -> (drafter kind, decoder kwargs, params, max_new_tokens, N)
    "specinfer q!=p": ("q!=p", METHODS["specinfer"], T1, 4, 3000),
    "rsd_c q!=p": ("q!=p", METHODS["rsd_c"], T1, 4, 3000),
    "rsd_s q!=p": ("q!=p", METHODS["rsd_s"], T1, 4, 3000),
    "rsd_c generic T0.8 top_k3": (
        "generic",
        dict(method="rsd_c", branching=(3, 1)),
        SamplingParams(0.8, top_k=3),
        4,
        3000,
    ),
    "rsd_s generic top_p0.9": (
        "generic",
        dict(method="rsd_s", depth=2, beam_width=2),
        SamplingParams(1.0, top_p=0.9),
        4,
        3000,
    ),
    "specinfer q=p": ("q=p", METHODS["specinfer"], T1, 4, 2000),
    "rsd_s q=p": ("q=p", METHODS["rsd_s"], T1, 4, 2000),
}


DEFAULT_CASES = ["specinfer q!=p", "rsd_c q!=p", "rsd_s q!=p", "rsd_c generic T0.8 top_k3", "rsd_s q=p"]


@pytest.mark.parametrize(
    ("case", "seeds"),
    [(c, (0,)) for c in DEFAULT_CASES]
    + [pytest.param(c, (1, 2), marks=pytest.mark.slow, id=f"{c}-slow") for c in CASES],
)
def test_output_law_is_the_verifiers(case, seeds):
    kind, kw, params, max_new, n = CASES[case]
    verifier, drafter, table = fake_pair(kind)
    law = verifier_joint(table_next(table, params), PROMPT, max_new, (EOS,))
    decoder = TreeSpeculativeDecoder(verifier, drafter, **kw)
    for seed in seeds:
        runs = sample_counts(decoder, params, max_new, n, seed)
        stat, df = chi_square(runs.counts, law, n)
        assert stat < chi2_critical(df), (case, seed, stat, df)
    if kind == "q=p":  # a drafter equal to the verifier: its first child is always accepted, no rejection
        assert all(s.tested == s.accepted and s.accepted > 0 for s in runs.stats)


def test_disjoint_support_accepts_nothing_and_keeps_the_law():
    verifier_table = peaked_table_lm(V, 1, 3.0, 0.0)
    params = SamplingParams(temperature=1.0, top_k=1)  # the verifier's argmax only ...
    drafter_table = peaked_table_lm(V, 1, 3.0, 0.0)
    drafter_table.table = -verifier_table.table  # ... and the drafter's argmax is a different token
    verifier, drafter = PositionalTableLM(verifier_table), PositionalTableLM(drafter_table)
    law = verifier_joint(table_next(verifier_table, params), PROMPT, 4, (EOS,))
    for kw in METHODS.values():
        runs = sample_counts(TreeSpeculativeDecoder(verifier, drafter, **kw), params, 4, 200, 0)
        assert all(s.accepted == 0 for s in runs.stats)
        assert set(runs.counts) <= set(law)


def _broken(monkeypatch, how: str) -> None:
    """Break the recursive rule on purpose (what the distribution test must catch)."""
    original = rules.recursive_rejection

    def wrong_kind(p, candidates, q, kind, u_accept, u_next):
        return original(p, candidates, q, "iid" if kind == "without_replacement" else kind, u_accept, u_next)

    def residual_from_p(p, candidates, q, kind, u_accept, u_next):
        choice, token = original(p, candidates, q, kind, u_accept, u_next)
        return choice, torch.where(choice >= 0, token, rules.sample_with_uniform(p, u_next))

    def biased(p, candidates, q, kind, u_accept, u_next):
        return original(p, candidates, q, kind, u_accept / 0.97, u_next)

    fn = {"wrong_kind": wrong_kind, "residual_from_p": residual_from_p, "acceptance_x0.97": biased}[how]
    monkeypatch.setattr("train.decoding.rules.tree_walk.recursive_rejection", fn)


@pytest.mark.parametrize(
    ("case", "how", "n"),
    [
        ("rsd_c q!=p", "wrong_kind", 3000),
        ("rsd_s q!=p", "residual_from_p", 3000),
        pytest.param("rsd_c q!=p", "acceptance_x0.97", 20000, marks=pytest.mark.slow),
    ],
)
def test_distribution_test_catches_broken_rules(monkeypatch, case, how, n):
    kind, kw, params, max_new, _ = CASES[case]
    verifier, drafter, table = fake_pair(kind)
    law = verifier_joint(table_next(table, params), PROMPT, max_new, (EOS,))
    _broken(monkeypatch, how)
    runs = sample_counts(TreeSpeculativeDecoder(verifier, drafter, **kw), params, max_new, n, 0)
    stat, df = chi_square(runs.counts, law, n)
    assert stat > chi2_critical(df), (case, how, stat, df)


# ------------------------------------------------------------------------------ caches across blocks


@pytest.mark.parametrize("method", list(METHODS))
def test_caches_hold_exactly_the_committed_tokens_between_blocks(method):
    """After every block the verifier's cache holds every committed token but the last and the
    drafter's a prefix of them: no tree node that was not accepted survives the compaction."""
    verifier, drafter, _ = fake_pair("generic")
    decoder = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method])
    seen: list[tuple[list[int], list[int]]] = []
    original = decoder._proposer.propose

    def spy(sequence, *args):
        d_cache = decoder._proposer._cache
        seen.append((list(sequence), d_cache.tokens if d_cache is not None else []))
        return original(sequence, *args)

    verifier_seen: list[list[int]] = []
    forward = verifier.forward

    def verifier_spy(input_ids, past_key_values=None, **kwargs):
        verifier_seen.append(past_key_values.tokens if past_key_values is not None else [])
        return forward(input_ids, past_key_values=past_key_values, **kwargs)

    decoder._proposer.propose = spy  # type: ignore[method-assign]
    verifier.forward = verifier_spy  # type: ignore[method-assign]
    out = decoder.generate(torch.tensor([list(PROMPT)]), 12, T1, generator=torch.Generator().manual_seed(3))
    final = [*PROMPT, *out.tokens.tolist()]
    assert len(seen) > 2 and len(verifier_seen) > 2
    for sequence, drafter_tokens in seen:
        assert drafter_tokens == sequence[: len(drafter_tokens)]  # a prefix of the committed sequence
    for cached in verifier_seen:
        assert cached == final[: len(cached)]  # only committed tokens, in order


def test_autoregressive_and_tree_agree_on_stats_contract(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    ids = torch.tensor([[0, 5, 9]])
    ar = AutoregressiveDecoder(verifier).generate(ids, 12)
    tree = TreeSpeculativeDecoder(verifier, drafter, **METHODS["rsd_c"]).generate(ids, 12)
    assert tree.tokens.tolist() == ar.tokens.tolist()
    s = tree.stats
    assert s.new_tokens == 12 and s.accepted + s.verifier_calls == 12
    assert s.verifier_tokens <= s.verifier_calls * (1 + 2 + 4 + 4) + len(ids[0])
    # every block but the last drafts (one token left: nothing to draft); near the limit trees get shallower
    assert s.position_drafted[0] == s.verifier_calls - 1 and len(s.position_drafted) == 3
    assert s.position_drafted == sorted(s.position_drafted, reverse=True) and s.drafted == sum(
        s.position_drafted
    )


def test_on_support_keeps_the_ids_some_row_can_draw():
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.25, 0.75]])
    sub, ids = on_support(q)
    assert ids.tolist() == [0, 2, 3]
    assert torch.equal(sub, q[:, [0, 2, 3]])
    full = torch.full((2, 4), 0.25)
    sub, ids = on_support(full)
    assert ids is None and sub is full
