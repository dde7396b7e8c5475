"""A drafter with a reduced vocabulary (``config.draft_vocab``, FR-Spec; train/models/draft_vocab.py):
its logits, its cache, greedy equality with Hugging Face ``generate`` for every decoder, the exact law at
T = 1 (the verifier's mass outside the draft vocabulary included), and the saved drafter as a plain
Hugging Face model, re-wrapped by the evaluator and usable as ``assistant_model``.

The law test's drafter leaves out the verifier's two most likely first tokens, which carry over a
quarter of its mass: only corrections (residual ``max(p - q, 0) = p`` there) can emit them. A decoder
whose verifier were cut to the draft vocabulary never emits them; the test asserts its power against
that defect (the chi-square's noncentrality, as tests/decoding/test_decoding_exact_sampling.py does).
"""

from __future__ import annotations

import itertools
import logging
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from train.decoding import (
    SamplingParams,
    SpeculativeDecoder,
    TreeSpeculativeDecoder,
)
from train.evaluation import EvalConfig, build_decoders, evaluate_drafters, find_run
from train.models.draft_vocab import DraftVocabModel, draft_vocab_of, set_draft_vocab, with_draft_vocab
from train.models.loading import load_model
from train.training.rollout import rollout

from .decoding_helpers import build, hf_greedy, overlapped, tiny_config
from .spec_reference import chi2_critical, chi2_power, chi_square, noncentrality, run_many
from .test_decoding_cache import CheckedLM

IDS = list(range(0, 128, 2))  # every even id: half the vocabulary
OUTSIDE = torch.ones(128, dtype=torch.bool)
OUTSIDE[IDS] = False
TREES = {
    "specinfer": dict(method="specinfer", branching=(2, 2, 1)),
    "rsd_c": dict(method="rsd_c", branching=(2, 2, 1)),
    "rsd_s": dict(method="rsd_s", depth=3, beam_width=3),
}


def prompt(n: int = 8, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ the wrapper


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_logits_are_the_models_on_the_draft_ids_and_minus_infinity_elsewhere(tiny_pairs, arch):
    _, drafter = tiny_pairs[arch]
    ids = prompt()
    with torch.no_grad():
        out = drafter(input_ids=ids, output_hidden_states=True)
        wrapped = DraftVocabModel(drafter, IDS)(input_ids=ids, output_hidden_states=True)
        reduced = DraftVocabModel(drafter, IDS, full_logits=False)(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(wrapped.logits[..., IDS], out.logits[..., IDS])
    assert torch.isneginf(wrapped.logits[..., OUTSIDE]).all()
    assert reduced.shape == (1, 1, len(IDS))
    torch.testing.assert_close(reduced[0, -1], out.logits[0, -1, IDS])
    for mine, theirs in zip(wrapped.hidden_states, out.hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_the_wrapper_reads_as_its_model(llama_pair):
    _, drafter = llama_pair
    model = DraftVocabModel(drafter, IDS)
    assert model.config is drafter.config and model.generation_config is drafter.generation_config
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in drafter.parameters())
    assert model.get_output_embeddings() is drafter.get_output_embeddings()
    with pytest.raises(ValueError, match="draft ids must lie in"):
        DraftVocabModel(drafter, [0, 128])


def test_the_kept_head_rows_follow_updates_and_moves_of_the_weights():
    """The rows kept between calls (no gradient) are refreshed after an in-place update (an optimizer
    step) and after ``.to(dtype)``; with gradients they are sliced per call and the gradient reaches
    the head (tied: the embeddings) at the draft ids only."""
    drafter = build(tiny_config("llama", 32), 5)
    model = DraftVocabModel(drafter, IDS)
    ids = prompt()

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=ids).logits[..., IDS], drafter(input_ids=ids).logits[..., IDS]
            )

    check()
    with torch.no_grad():
        drafter.get_output_embeddings().weight.mul_(1.5)
    check()
    drafter.to(torch.float64)
    check()
    assert model(input_ids=ids).logits.dtype == torch.float64
    drafter.to(torch.float32)
    model(input_ids=ids).logits[..., IDS].sum().backward()
    grad = drafter.get_output_embeddings().weight.grad
    assert grad is not None and grad[IDS].abs().sum() > 0
    check()


def test_the_cache_through_the_wrapper_gives_the_uncached_logits(llama_pair):
    _, drafter = llama_pair
    model = DraftVocabModel(drafter, IDS)
    ids = prompt(10)
    with torch.no_grad():
        first = model(input_ids=ids[:, :6], use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        assert cache is not None and cache.get_seq_length() == 6
        second = model(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True)
        whole = model(input_ids=ids).logits
    torch.testing.assert_close(second.logits, whole[:, 6:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.7)], ids=["greedy", "T=0.7"]
)
def test_every_cached_call_of_a_decoder_equals_a_fresh_forward(llama_pair, params):
    """tests/decoding/test_decoding_cache.py's check, through the wrapper: after every crop."""
    verifier, drafter = llama_pair
    checked = CheckedLM(DraftVocabModel(drafter, IDS))
    res = SpeculativeDecoder(verifier, checked, gamma=3).generate(
        prompt(7), 20, params, generator=torch.Generator().manual_seed(0)
    )
    assert res.stats.accepted < res.stats.drafted and checked.checked == res.stats.drafter_calls


def test_no_deprecated_cache_name_is_used(llama_pair, monkeypatch):
    """As test_model_call.py asks of every model: no FutureWarning, no ``past_key_values`` deprecation."""
    verifier, drafter = llama_pair
    model = DraftVocabModel(drafter, IDS)
    logged: list[str] = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, msg, *a, **k: logged.append(str(msg)))
    monkeypatch.setattr(logging.Logger, "warning", lambda self, msg, *a, **k: logged.append(str(msg)))
    decoders = [
        SpeculativeDecoder(verifier, model, gamma=3),
        TreeSpeculativeDecoder(verifier, model, method="rsd_c", branching=(2, 2)),
        overlapped(verifier, model, gamma=3),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for decoder in decoders:
            for params in (SamplingParams(), SamplingParams(temperature=1.0)):
                decoder.generate(prompt(5), 8, params, generator=torch.Generator().manual_seed(0))
        out = rollout(model, torch.tensor([[0, 0, 5, 9], [3, 4, 5, 6]]), None, 6, SamplingParams(1.0))
        model(input_ids=prompt(5), use_cache=False)  # as training computes its logits
    assert not [m for m in logged if "past_key_values" in m or "deprecated" in m], logged
    assert not OUTSIDE[out.sequences[:, 4:]].any()  # rollouts sample inside the draft vocabulary


# ------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_greedy_output_is_the_verifiers_generate(tiny_pairs, arch):
    verifier, drafter = tiny_pairs[arch]
    model = DraftVocabModel(drafter, IDS)
    decoders = {
        **{f"sd@g{g}": SpeculativeDecoder(verifier, model, gamma=g) for g in (1, 3, 5)},
        "sd@g5 adaptive": SpeculativeDecoder(verifier, model, gamma=5, confidence_threshold=0.02),
        **{name: TreeSpeculativeDecoder(verifier, model, **kw) for name, kw in TREES.items()},
    }
    outside = 0
    for seed in (0, 1):
        ids = prompt(6 + 4 * seed, seed)
        ref = hf_greedy(verifier, ids, 24, eos=None)
        outside += sum(t % 2 for t in ref)
        for name, decoder in decoders.items():
            assert decoder.generate(ids, 24).tokens.tolist() == ref, (arch, name, seed)
    assert outside > 0  # some of the verifier's greedy tokens lie outside the draft vocabulary


# ------------------------------------------------------------------------------ the law at T = 1

LAW_VOCAB = 8
LAW_PROMPT = (1, 5, 2)


def _law_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    verifier = build(tiny_config("llama", 32, vocab=LAW_VOCAB), 3)
    drafter = build(tiny_config("llama", 16, vocab=LAW_VOCAB), 4)
    ids = torch.tensor([LAW_PROMPT])
    with torch.no_grad():
        # Random tiny models are near uniform over 8 tokens (p and q within 0.11-0.14), where a drafted
        # token mapped to the wrong id or a q placed on the wrong ids hardly shows; sharper heads make
        # p and q far apart (first-token q 0.03-0.34, p 0.02-0.26), so such a defect fails the test.
        verifier.lm_head.weight.mul_(10.0)
        drafter.lm_head.weight.mul_(10.0)
        p1 = torch.softmax(verifier(input_ids=ids).logits[0, -1].double(), -1)
        nxt = torch.cat([ids.repeat(LAW_VOCAB, 1), torch.arange(LAW_VOCAB).reshape(-1, 1)], dim=1)
        p2 = torch.softmax(verifier(input_ids=nxt).logits[:, -1].double(), -1)
    return verifier, drafter, p1[:, None] * p2  # the exact law of the first two tokens, (V, V)


def _as_cells(joint: torch.Tensor) -> dict[tuple[int, int], float]:
    return {(a, b): float(joint[a, b]) for a, b in itertools.product(range(LAW_VOCAB), repeat=2)}


LAW_CASES = {  # name -> (decoder kwargs or None for the chain, draft vocabulary, runs)
    "chain g2": (None, "all but the top 2", 1500),
    "rsd_c (3,) one id": (dict(method="rsd_c", branching=(3,)), "one id", 800),
    "specinfer (2,)": (dict(method="specinfer", branching=(2,)), "all but the top 2", 1500),
    "rsd_c (2,)": (dict(method="rsd_c", branching=(2,)), "all but the top 2", 1500),
    "rsd_s w2": (dict(method="rsd_s", depth=1, beam_width=2), "all but the top 2", 1500),
}


@pytest.mark.parametrize(
    "case",
    ["chain g2", "rsd_c (3,) one id"]
    + [pytest.param(c, marks=pytest.mark.slow) for c in ("specinfer (2,)", "rsd_c (2,)", "rsd_s w2")],
)
def test_sampling_keeps_the_verifiers_law_with_a_reduced_vocabulary(case):
    """The first two tokens at T = 1 against the verifier's exact law (64 cells). ``one id``: a draft
    vocabulary smaller than the tree's branching (a drafter that can propose a single token)."""
    kw, vocab_kind, runs = LAW_CASES[case]
    verifier, drafter, joint = _law_pair()
    first = joint.sum(1)
    top2 = first.topk(2).indices.tolist()
    if vocab_kind == "one id":
        draft_ids = [int(first.argsort()[-3])]  # the verifier's third most likely first token
    else:
        draft_ids = [i for i in range(LAW_VOCAB) if i not in top2]
    model = DraftVocabModel(drafter, draft_ids)
    decoder = (
        SpeculativeDecoder(verifier, model, gamma=2)
        if kw is None
        else TreeSpeculativeDecoder(verifier, model, **kw)
    )
    law = _as_cells(joint)
    # power against a decoder whose verifier were cut to the draft vocabulary (p renormalised there)
    inside = torch.zeros(LAW_VOCAB, dtype=torch.double)
    inside[draft_ids] = 1.0
    cut = joint * inside[:, None] * inside[None, :]
    lam = noncentrality(law, _as_cells(cut / cut.sum()), runs)
    assert chi2_power(len(law) - 1, lam) > 0.999, lam
    sampled = run_many(decoder, LAW_PROMPT, 2, SamplingParams(temperature=1.0), runs, seed=0)
    emitted_outside = sum(n for (a, _), n in sampled.counts.items() if a not in draft_ids) / runs
    assert emitted_outside > 0.2  # the verifier's mass outside the draft vocabulary reaches the output
    stat, df = chi_square(sampled.counts, law, runs)
    assert stat < chi2_critical(df), (case, stat, df)


def test_a_chain_over_the_draft_ids_keeps_q_compact_and_is_verified_as_if_placed(llama_pair):
    """At T > 0 the proposer hands the chain rule q over the draft ids alone (``Draft.support``); the rule
    decides every block exactly as on q placed in the verifier's vocabulary (zero elsewhere)."""
    from train.decoding import DecodeStats, Draft, ModelProposer, TimedModel
    from train.decoding.rules.chain import verify_chain

    verifier, drafter = llama_pair
    proposer = ModelProposer(TimedModel(DraftVocabModel(drafter, IDS, full_logits=False)), vocab_size=128)
    gen = torch.Generator().manual_seed(0)
    decisions = set()
    for trial in range(40):
        proposer.start()
        params = SamplingParams(temperature=1.0) if trial % 2 else SamplingParams(0.8, top_k=20)
        draft = proposer.propose(prompt(seed=trial)[0].tolist(), 3, params, gen, frozenset(), DecodeStats())
        assert draft.support is not None and draft.q is not None and draft.q.shape == (len(draft), len(IDS))
        assert draft.tokens == [IDS[c] for c in draft.columns]
        dense = draft.dense_q(128)
        assert dense.shape == (len(draft), 128) and bool((dense[:, OUTSIDE] == 0).all())
        torch.testing.assert_close(dense.sum(-1), torch.ones(len(draft)))
        logits = torch.randn(len(draft) + 1, 128, generator=torch.Generator().manual_seed(trial)) * 2
        for lenience, eps in ((None, 1.0), ("linear", 0.5)):
            seed = 1000 + trial
            compact = verify_chain(logits, draft, params, torch.Generator().manual_seed(seed), lenience, eps)
            placed = verify_chain(
                logits,
                Draft.chain(draft.tokens, dense),
                params,
                torch.Generator().manual_seed(seed),
                lenience,
                eps,
            )
            assert (compact.accepted, compact.next, compact.tested) == (
                placed.accepted,
                placed.next,
                placed.tested,
            )
            assert compact.expected == pytest.approx(placed.expected, abs=1e-6)
            decisions.add((compact.accepted, compact.accepted < len(draft)))
    assert len(decisions) >= 3  # rejections and full acceptances both met


def test_a_compact_q_names_its_support_and_columns():
    from train.decoding import Draft

    q = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="one column per draft token"):
        Draft.chain([2, 4], q, support=torch.tensor([0, 2, 4, 6]))
    with pytest.raises(ValueError, match="4 columns for a support of 3"):
        Draft.chain([2, 4], q, support=torch.tensor([0, 2, 4]), columns=[1, 2])
    with pytest.raises(ValueError, match="give its support"):
        Draft.chain([2, 4], q, columns=[1, 2])
    placed = Draft.chain([2, 4], q, support=torch.tensor([0, 2, 4, 6]), columns=[1, 2]).dense_q(8)
    assert placed is not None and placed[:, 1::2].eq(0).all() and placed[:, ::2].eq(0.25).all()


def test_every_cell_of_the_law_is_in_play():
    """The law test's 64 cells all carry mass (no empty expected cell hides a defect)."""
    _, _, joint = _law_pair()
    assert joint.numel() == 64 and (joint > 0).all() and abs(float(joint.sum()) - 1) < 1e-9


# ------------------------------------------------------------------------------ saved, loaded, evaluated


def test_saved_drafter_is_a_plain_model_rewrapped_for_decoding_and_an_assistant_model(llama_pair, tmp_path):
    verifier, _ = llama_pair
    drafter = build(tiny_config("llama", 32), 2)
    set_draft_vocab(drafter, IDS)
    DraftVocabModel(drafter, IDS).save_pretrained(tmp_path / "drafter")  # saves the plain model
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter").eval()
    assert draft_vocab_of(plain) == IDS and type(plain).__name__ == "LlamaForCausalLM"
    loaded = load_model(str(tmp_path / "drafter"))  # what load_pair / load_drafter return: plain too
    assert not isinstance(loaded, DraftVocabModel) and draft_vocab_of(loaded) == IDS
    assert isinstance(with_draft_vocab(loaded), DraftVocabModel)
    assert with_draft_vocab(verifier) is verifier  # no draft vocabulary: unchanged
    decoders = build_decoders(verifier, loaded, EvalConfig(decoders=["sd", "specinfer"]))
    assert all(isinstance(d.drafter, DraftVocabModel) for d in decoders.values())
    ids = prompt(seed=2)
    mask = torch.ones_like(ids)
    reference = verifier.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assisted = verifier.generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=plain
    )
    assert torch.equal(assisted, reference)


def test_the_evaluator_decodes_a_draft_vocabulary_drafter_losslessly(llama_pair, monkeypatch):
    """evaluate_drafters drafts through the wrapper, and its strict greedy check passes (the T = 0
    outputs are the verifier's own)."""
    verifier, _ = llama_pair
    drafter = build(tiny_config("llama", 32), 2)
    set_draft_vocab(drafter, IDS)
    calls: list[int] = []
    forward = DraftVocabModel.forward
    monkeypatch.setattr(
        DraftVocabModel, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
    )
    cfg = EvalConfig(
        decoders=["sd"],
        gammas=[3],
        temperatures=[0.0, 1.0],
        seeds=[0],
        max_new_tokens=12,
        warmup=False,
        plots=False,
        progress=False,
    )
    results = evaluate_drafters(verifier, {"d": drafter}, [prompt(6, s) for s in range(2)], cfg)
    assert calls
    assert find_run(results, "d", 0.0)["greedy_match"] is True
    assert find_run(results, "d", 1.0)["metrics"]["block_efficiency"]["mean"] >= 1.0


def test_a_draft_vocabulary_must_hold_unique_ids_in_range():
    model = build(tiny_config("llama", 32), 2)
    for bad in ([], [1, 1], [-1, 3], [0, 128]):
        with pytest.raises(ValueError, match="unique ids in"):
            set_draft_vocab(model, bad)
    assert set_draft_vocab(model, [5, 2, 9]) == [2, 5, 9] and model.config.draft_vocab == [2, 5, 9]
