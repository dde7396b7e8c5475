"""The verifier's reused outputs: prompt caches and generation logits score a batch as a full forward does."""

from __future__ import annotations

import pytest
import torch

from tests.decoding.decoding_helpers import BOS, VOCAB, build, tiny_config
from train.data.lm import collate_left_pad
from train.decoding.sampling import SamplingParams
from train.training.answer_cache import AnswerCache, continuation_logits, with_continuation
from train.training.byte_budget import ByteBudget
from train.training.rollout import Rollout, rollout
from train.training.verifier_scores import PrefixScorer

SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """2 layers, hidden 32, random weights, float32."""
    return build(tiny_config("llama", 32), 3)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _batch(model: torch.nn.Module, prompts: list[list[int]], n: int = 7, seed: int = 1) -> Rollout:
    left = collate_left_pad(prompts, pad_id=BOS)
    gen = torch.Generator().manual_seed(seed)
    return rollout(
        model, left["input_ids"], left["attention_mask"], n, SAMPLED, pad_token_id=BOS, generator=gen
    )


def _close_where_counted(got: torch.Tensor, want: torch.Tensor, batch: Rollout) -> None:
    mask = batch.continuation_mask[:, batch.prompt_width :]
    assert got.shape == want.shape
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_a_kept_prompt_cache_scores_as_a_full_forward_whatever_the_batch(model):
    """First sight (prefill then continuation) and reuse in a batch of another width and order: the
    logits over every counted continuation position equal one forward over prompt and continuation."""
    prompts = _prompts((5, 11, 3, 8))
    scorer = PrefixScorer(model, ByteBudget(64))
    assert scorer.reuses_prompts
    first = _batch(model, prompts)
    _close_where_counted(scorer(first), continuation_logits(model, first), first)
    assert len(scorer) == 4
    # the same prompts, reordered, beside a new, longer one: a wider left padding around the kept caches
    again = _batch(model, [prompts[2], *_prompts((14,), seed=5), prompts[0]], seed=2)
    _close_where_counted(scorer(again), continuation_logits(model, again), again)
    assert len(scorer) == 5


def test_a_prompt_over_the_budget_is_scored_the_same_and_not_kept(model):
    prompts = _prompts((6, 9))
    scorer = PrefixScorer(model, ByteBudget(0.0005))  # 524 bytes: less than one prompt's cache
    batch = _batch(model, prompts)
    _close_where_counted(scorer(batch), continuation_logits(model, batch), batch)
    assert len(scorer) == 0


def test_one_token_continuations_and_a_stand_in_without_cache_layers(model):
    prompts = _prompts((4, 7))
    batch = _batch(model, prompts, n=1)
    _close_where_counted(PrefixScorer(model, ByteBudget(64))(batch), continuation_logits(model, batch), batch)
    stand_in = PrefixScorer(torch.nn.Identity(), ByteBudget(64))
    assert not stand_in.reuses_prompts


def test_the_generation_keeps_the_scores_a_scoring_forward_gives(model):
    batch = _batch(model, _prompts((5, 11, 3)), n=6)
    left = collate_left_pad(_prompts((5, 11, 3)), pad_id=BOS)
    kept = rollout(
        model,
        left["input_ids"],
        left["attention_mask"],
        6,
        SAMPLED,
        pad_token_id=BOS,
        generator=torch.Generator().manual_seed(1),
        keep_scores=True,
    )
    assert torch.equal(kept.sequences, batch.sequences) and batch.scores is None
    assert kept.scores is not None
    _close_where_counted(kept.scores, continuation_logits(model, kept), kept)


def test_the_answer_cache_returns_kept_scores_and_keeps_given_ones(model):
    """Answers, generated or given in advance, come back with their scores once these were computed and
    kept (keep_scores); without a budget no scores are kept."""
    prompts = _prompts((5, 8, 3))
    left = collate_left_pad(prompts, pad_id=BOS)
    ids, attn = left["input_ids"], left["attention_mask"]

    def generate(i: torch.Tensor, a: torch.Tensor, g: torch.Generator) -> Rollout:
        return rollout(model, i, a, 5, SAMPLED, pad_token_id=BOS, generator=g)

    cache = AnswerCache(generate, BOS, ByteBudget(16))
    cache.add(prompts[1], [7, 8, 9])
    first = cache(ids, attn, torch.Generator().manual_seed(0))
    assert first.scores is None  # nothing scored yet
    scores = continuation_logits(model, first)
    cache.keep_scores(first, scores)
    assert len(cache.scores) == 3
    second = cache(ids, attn, torch.Generator().manual_seed(3))
    assert second.scores is not None
    assert torch.equal(second.sequences, first.sequences)
    _close_where_counted(second.scores, scores, second)

    plain = AnswerCache(generate, BOS)
    plain.keep_scores(plain(ids, attn, torch.Generator().manual_seed(0)), scores)
    assert plain(ids, attn, torch.Generator().manual_seed(0)).scores is None


def test_a_restored_cache_drops_scores_and_keeps_answers(model):
    prompts = _prompts((5, 8))
    left = collate_left_pad(prompts, pad_id=BOS)
    cache = AnswerCache(
        lambda i, a, g: rollout(model, i, a, 4, SAMPLED, pad_token_id=BOS, generator=g), BOS, ByteBudget(16)
    )
    batch = cache(left["input_ids"], left["attention_mask"], torch.Generator().manual_seed(0))
    cache.keep_scores(batch, continuation_logits(model, batch))
    assert len(cache.scores) == 2
    cache.load(cache.state())
    got = cache(left["input_ids"], left["attention_mask"], torch.Generator().manual_seed(0))
    assert got.scores is None and len(cache) == 2


def test_with_continuation_carries_no_scores():
    ro = with_continuation(
        torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), torch.tensor([[3]]), torch.tensor([[1]])
    )
    assert ro.scores is None
