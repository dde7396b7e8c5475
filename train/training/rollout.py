"""Batched rollouts for training: left-padded prompts -> sampled continuations, with a KV cache.

DistillSpec / GKD (docs/distillspec.md) train the drafter on continuations sampled from the
verifier or from the drafter itself. Those rollouts use the evaluator's own :func:`warp` and
:func:`sample`, so a drafter is trained under the regime it is evaluated under. No gradient flows
through sampling (everything here runs under ``torch.no_grad``).

Shapes: ``B`` prompts, ``P`` the padded prompt width, ``N = max_new_tokens``. Tokens after a row's
first EOS are replaced by ``pad_token_id`` and masked out; generation stops early once every row has
finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from train.decoding.decoders.base import eos_set
from train.decoding.sampling import SamplingParams, sample, warp
from train.models.introspect import cache_keyword, output_vocab_size, returned_cache, supports_logits_to_keep
from train.models.loading import eos_token_ids

__all__ = ["Rollout", "RolloutSampler", "last_prompt_tokens", "position_ids_from_mask", "rollout"]


@dataclass
class Rollout:
    """One batch of generated sequences.

    sequences: (B, P + N') long; the left-padded prompt followed by the continuation (N' <= N when
        every row hit EOS early), ``pad_token_id`` after a row's EOS.
    attention_mask: (B, P + N') long; 1 on real prompt tokens and on continuation tokens up to and
        including the first EOS.
    continuation_mask: (B, P + N') bool; True exactly on the generated tokens that count (up to and
        including the first EOS), False on the prompt and on padding.
    prompt_width: P, the padded prompt width.
    scores: (B, N', V) or None; where kept (``rollout(keep_scores=True)``, a
        :class:`~train.training.answer_cache.AnswerCache` that stores them), the generating model's logits
        (or log-probabilities) predicting each continuation position, the scores a scoring forward over the
        sequence would give up to rounding. Meaningless where ``continuation_mask`` is False.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    continuation_mask: torch.Tensor
    prompt_width: int
    scores: torch.Tensor | None = None


def last_prompt_tokens(rollouts: Rollout, context: int | None) -> Rollout:
    """``rollouts`` with each prompt cut to its last ``context`` tokens (left padding kept where a prompt is
    shorter), the continuations and scores unchanged; as it is when ``context`` is None or covers the
    padded prompt width. Positions restart at 0 (from the mask), which rotary attention does not see."""
    if context is None or context >= rollouts.prompt_width:
        return rollouts
    cut = rollouts.prompt_width - context
    return Rollout(
        sequences=rollouts.sequences[:, cut:],
        attention_mask=rollouts.attention_mask[:, cut:],
        continuation_mask=rollouts.continuation_mask[:, cut:],
        prompt_width=context,
        scores=rollouts.scores,
    )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) positions counting real tokens only (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


# more than 8 parameters: a generation request as transformers' generate takes it
@torch.no_grad()
def rollout(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_id: int | Iterable[int] | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    keep_scores: bool = False,
) -> Rollout:
    """Sample up to ``max_new_tokens`` tokens after each left-padded prompt, in one batch.

    Args:
        model: a Hugging Face causal LM (anything taking ``input_ids``, ``attention_mask``,
            ``position_ids`` and its cache as ``cache`` or ``past_key_values``, whichever its
            transformers takes (:func:`~train.models.introspect.cache_keyword`), returning
            ``.logits`` and the cache).
        input_ids: (B, P) long, prompts left-padded (see :func:`train.data.lm.collate_left_pad`).
        attention_mask: (B, P) 0/1, or None when no row is padded.
        params: the decoding regime; temperature 0 is greedy (argmax), otherwise :func:`warp` then
            :func:`sample` with ``generator``.
        vocab_size: sample only among the first ``vocab_size`` ids (the vocabulary shared with the
            other model when embeddings are padded); default the model's output size.
        keep_scores: also return every step's logits (the model's whole output row) as ``Rollout.scores``:
            the generating model's scores of its own continuation, which a distillation loss would
            otherwise recompute with a second forward.

    Returns:
        :class:`Rollout`. Padded prompt positions get position id 0 and are masked, so row ``i``'s
        continuation equals what the model generates for that prompt alone (up to float rounding).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, P), got {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    device = input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
    vocab = vocab_size or output_vocab_size(model)
    eos = torch.tensor(sorted(eos_set(eos_token_id)), dtype=torch.long, device=device)
    request = _Request(max_new_tokens, params, eos, pad_token_id, generator, vocab, keep_scores)
    was_training = model.training
    model.eval()  # no dropout in rollouts
    try:
        new_tokens, mask, step_scores = _sample_tokens(model, input_ids, mask, request)
    finally:
        model.train(was_training)
    return _as_rollout(input_ids, new_tokens, mask, step_scores)


@dataclass(frozen=True)
class _Request:
    """:func:`rollout`'s settings as its sampling loop reads them (the EOS ids as a tensor on the
    prompts' device, the vocabulary resolved)."""

    max_new_tokens: int
    params: SamplingParams
    eos: torch.Tensor
    pad_token_id: int
    generator: torch.Generator | None
    vocab: int
    keep_scores: bool

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) last-position logits -> (B,) next tokens among the first ``vocab`` ids: the argmax at
        temperature 0, else sampled from the warped distribution."""
        logits = logits[:, : self.vocab]
        if self.params.temperature == 0.0:
            return logits.argmax(dim=-1)
        return sample(warp(logits, self.params), self.generator)


def _sample_tokens(
    model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, request: _Request
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """The sampling loop over a KV cache: each step's (B,) tokens (``pad_token_id`` once a row has
    ended), the (B, P + N') mask grown by one column a step, and each step's whole (B, V) logits row
    when ``keep_scores``; stops early once every row has ended."""
    keep = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
    cache_kw = cache_keyword(model)
    new_tokens: list[torch.Tensor] = []
    step_scores: list[torch.Tensor] = []
    alive = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    positions = position_ids_from_mask(mask)
    next_pos = positions[:, -1:] + 1
    feed, feed_pos, cache = input_ids, positions, None
    for _ in range(request.max_new_tokens):
        out = model(
            input_ids=feed,
            attention_mask=mask,
            position_ids=feed_pos,
            use_cache=True,
            **{cache_kw: cache},
            **keep,
        )
        cache = returned_cache(out)
        if request.keep_scores:
            step_scores.append(out.logits[:, -1])
        x = request.pick(out.logits[:, -1])
        x = torch.where(alive, x, torch.full_like(x, request.pad_token_id))
        new_tokens.append(x)
        mask = torch.cat([mask, alive.long().unsqueeze(1)], dim=1)
        if request.eos.numel():
            alive = alive & ~torch.isin(x, request.eos)
            if not bool(alive.any()):
                break
        feed, feed_pos = x.unsqueeze(1), next_pos
        next_pos = next_pos + 1
    return new_tokens, mask, step_scores


def _as_rollout(
    input_ids: torch.Tensor,
    new_tokens: list[torch.Tensor],
    mask: torch.Tensor,
    step_scores: list[torch.Tensor],
) -> Rollout:
    """The loop's per-step tokens after the prompts, and the prompts masked out of the continuation."""
    width = input_ids.shape[1]
    cont = torch.stack(new_tokens, dim=1) if new_tokens else input_ids.new_zeros((input_ids.shape[0], 0))
    cont_mask = mask.bool().clone()
    cont_mask[:, :width] = False
    scores = torch.stack(step_scores, dim=1) if step_scores else None
    return Rollout(torch.cat([input_ids, cont], dim=1), mask, cont_mask, width, scores)


@dataclass(frozen=True)
class RolloutSampler:
    """How a method samples its rollouts (DistillSpec's on-policy and verifier batches, SD^2's verifier
    answers): their length and temperature, the ids that end them, the pad id, and the vocabulary prefix
    all the method's models share."""

    max_new_tokens: int
    params: SamplingParams
    eos_token_id: tuple[int, ...]
    pad_token_id: int
    vocab_size: int

    @classmethod
    def for_models(
        cls, tokenizer: Any, max_new_tokens: int, temperature: float, *models: torch.nn.Module
    ) -> RolloutSampler:
        """EOS ids of the tokenizer and every model, the tokenizer's pad id (else the first EOS id), the
        smallest output vocabulary of ``models``."""
        eos = eos_token_ids(tokenizer, *models)
        pad = tokenizer.pad_token_id
        return cls(
            int(max_new_tokens),
            SamplingParams(temperature=float(temperature)),
            tuple(eos),
            int(pad if pad is not None else eos[0]),
            min(output_vocab_size(m) for m in models),
        )

    def sample(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generator: torch.Generator | None,
        keep_scores: bool = False,
    ) -> Rollout:
        """:func:`rollout` of ``model`` with these settings."""
        return rollout(
            model,
            input_ids,
            attention_mask,
            self.max_new_tokens,
            self.params,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=generator,
            vocab_size=self.vocab_size,
            keep_scores=keep_scores,
        )
