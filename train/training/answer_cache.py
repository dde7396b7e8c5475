"""The verifier's answers to training prompts, generated once per run and reused (DistillSpec's and SD^2's
training data; "answers" in docs/architecture.md's glossary).

:class:`AnswerCache` looks each prompt of a batch up by its tokens; the prompts it has not seen are
answered together, in one batched rollout (the caller's ``generate``, e.g. :func:`train.training.rollout.
rollout` with the engine's sampling), and kept. Later epochs, and a run resumed from a checkpoint that
carries :meth:`AnswerCache.state`, reuse them: a prompt's answer is drawn once per run.
Given a :class:`~train.training.byte_budget.ByteBudget`, it also keeps each answer's scores once the
caller has computed them (:meth:`AnswerCache.keep_scores`: the frozen model's logits over it), so that
a loss that needs them reads them (``Rollout.scores``) instead of recomputing them every epoch. A
checkpoint carries the answers but not their scores (hundreds of MB for a real vocabulary): a resumed
run computes them again, the same way, on first use.
:func:`with_continuation` lays a batch out as a :class:`~train.training.rollout.Rollout` (left-padded
prompt, then the continuation), whatever the continuation's source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from train.training.across_ranks import merged_over_ranks
from train.training.byte_budget import ByteBudget
from train.training.rollout import Rollout, position_ids_from_mask

__all__ = ["CHECKPOINT_ENTRY", "AnswerCache", "continuation_logits", "prompt_keys", "with_continuation"]

Generate = Callable[[torch.Tensor, torch.Tensor, torch.Generator], Rollout]
#: Where a method's checkpoint keeps its :meth:`AnswerCache.state`.
CHECKPOINT_ENTRY = "verifier_answers"


def with_continuation(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    continuation_ids: torch.Tensor,
    continuation_mask: torch.Tensor,
) -> Rollout:
    """Prompt (B, P, left-padded) + continuation (B, N, right-padded) in the layout a rollout has."""
    width = input_ids.shape[1]
    full_mask = torch.cat([attention_mask, continuation_mask], dim=1)
    cont_mask = full_mask.bool().clone()
    cont_mask[:, :width] = False
    return Rollout(torch.cat([input_ids, continuation_ids], dim=1), full_mask, cont_mask, width)


def continuation_logits(model: torch.nn.Module, rollouts: Rollout, **kwargs: Any) -> torch.Tensor:
    """(B, N, V) logits predicting the continuation positions of ``rollouts`` (the prompt's logits are never
    built); ``kwargs`` go to the model's forward."""
    n = rollouts.sequences.shape[1] - rollouts.prompt_width
    out = model(
        input_ids=rollouts.sequences,
        attention_mask=rollouts.attention_mask,
        position_ids=position_ids_from_mask(rollouts.attention_mask),
        logits_to_keep=n + 1,
        use_cache=False,
        **kwargs,
    )
    return out.logits[:, :-1]


def prompt_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[bytes]:
    """One key per row of a left-padded prompt batch: its real tokens' bytes."""
    return [input_ids[i][attention_mask[i].bool()].cpu().numpy().tobytes() for i in range(input_ids.shape[0])]


class AnswerCache:
    """``cache(input_ids, attention_mask, generator)`` -> the batch with each prompt's cached answer.

    generate: samples answers for a sub-batch of left-padded prompts; pad_token_id: fills the
    continuations of rows shorter than the batch's longest answer; budget: keep the answers' scores
    within it (None: answers only)."""

    def __init__(self, generate: Generate, pad_token_id: int, budget: ByteBudget | None = None) -> None:
        self.generate = generate
        self.pad_token_id = int(pad_token_id)
        self.budget = budget
        self.answers: dict[bytes, torch.Tensor] = {}
        self.scores: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.answers)

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gen: torch.Generator
    ) -> Rollout:
        keys = prompt_keys(input_ids, attention_mask)
        missing = [keys.index(k) for k in dict.fromkeys(keys) if k not in self.answers]  # once per prompt
        if missing:
            sub = self.generate(input_ids[missing], attention_mask[missing], gen)
            tail = slice(sub.prompt_width, None)
            for row, i in enumerate(missing):
                self.answers[keys[i]] = sub.sequences[row, tail][sub.continuation_mask[row, tail]].cpu()
        conts = [self.answers[k] for k in keys]
        n = max(len(c) for c in conts)
        cont = torch.full(
            (input_ids.shape[0], n), self.pad_token_id, dtype=input_ids.dtype, device=input_ids.device
        )
        cmask = torch.zeros_like(cont)
        for i, c in enumerate(conts):
            cont[i, : len(c)] = c.to(input_ids.device)
            cmask[i, : len(c)] = 1
        batch = with_continuation(input_ids, attention_mask, cont, cmask)
        if all(k in self.scores for k in keys):
            batch.scores = _stacked([self.scores[k] for k in keys], n, input_ids.device)
        return batch

    def keep_scores(self, batch: Rollout, scores: torch.Tensor) -> None:
        """Keep ``scores`` ((B, N, V), the frozen model's logits over ``batch``'s continuations, a batch this
        cache returned) for the answers that have none yet, while the budget lasts."""
        width = batch.prompt_width
        keys = prompt_keys(batch.sequences[:, :width], batch.attention_mask[:, :width])
        for i, key in enumerate(keys):
            if key in self.answers and key not in self.scores:
                self._keep(key, scores[i, : len(self.answers[key])])

    def _keep(self, key: bytes, scores: torch.Tensor) -> None:
        if self.budget is not None and self.budget.take([scores]):
            self.scores[key] = scores.detach().clone()

    def add(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Give ``prompt`` (its real tokens, no padding) the answer ``answer`` in advance."""
        key = torch.tensor(list(prompt), dtype=torch.long).numpy().tobytes()
        self.answers[key] = torch.tensor(list(answer), dtype=torch.long)

    def state(self) -> dict[str, Any]:
        """What a checkpoint carries so a resumed run reuses the answers drawn so far: every rank's (a
        collective under DDP / FSDP, where Lightning builds the checkpoint on every rank and rank 0 writes
        it; any rank can serve any prompt after a resume). The layout (``prompts``, ``continuations``) is
        the one checkpoints have always had."""
        answers = merged_over_ranks(self.answers)
        return {"prompts": list(answers), "continuations": list(answers.values())}

    def load(self, saved: dict[str, Any] | None) -> None:
        if saved:
            self.answers = dict(zip(saved["prompts"], saved["continuations"], strict=True))
            self.scores = {}  # scores travel in no checkpoint: recomputed (and kept) on first use


def _stacked(rows: list[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """(B, n, V) from per-row (L_i, V) scores, zeros after each row's end (masked positions)."""
    out = rows[0].new_zeros((len(rows), n, rows[0].shape[-1]), device=device)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out
