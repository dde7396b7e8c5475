"""Pretraining a drafter on the verifier's own answers, over the drafter's draft vocabulary.

Each example is a prompt and the verifier's answer with its top-k log-probabilities at every answer
token (:mod:`train.models.answers`). The loss is the cross-entropy from that teacher distribution to
the drafter's, both over the draft vocabulary only: the teacher's top-k entries outside it are
dropped and the rest renormalised (what FR-Spec / EAGLE-3 training does with a reduced head). Only
answer positions count: they are what the drafter will be asked to guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from train.methods.answer_distill.config import AnswerDistillConfig
from train.models.answers import Answer


def answer_example(answer: Answer, index: torch.Tensor, max_len: int) -> dict[str, torch.Tensor] | None:
    """One training row: ``input_ids`` (prompt + answer, cut to ``max_len`` from the left of the
    prompt), ``targets`` / ``target_logprobs`` ``(len, k)`` in draft-vocabulary rows (-1 where the
    position is not an answer token or the teacher's token is outside the draft vocabulary)."""
    if not answer.answer:
        return None
    ids = answer.prompt + answer.answer
    cut = max(0, len(ids) - max_len)
    if cut >= len(answer.prompt):
        return None  # the answer alone is longer than max_len: rare, dropped
    k = answer.top_ids.shape[1]
    targets = torch.full((len(ids), k), -1, dtype=torch.long)
    logprobs = torch.zeros((len(ids), k), dtype=torch.float32)
    first = len(answer.prompt) - 1  # the position whose next token is the answer's first
    rows = slice(first, first + len(answer.answer))
    targets[rows] = index[answer.top_ids.long()]
    logprobs[rows] = answer.top_logprobs.float()
    return {
        "input_ids": torch.tensor(ids[cut:], dtype=torch.long),
        "targets": targets[cut:],
        "target_logprobs": logprobs[cut:],
    }


def collate_right_pad(rows: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    k = rows[0]["targets"].shape[1]
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "targets": torch.full((len(rows), width, k), -1, dtype=torch.long),
        "target_logprobs": torch.zeros((len(rows), width, k), dtype=torch.float32),
    }
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = row["input_ids"]
        batch["attention_mask"][i, :n] = 1
        batch["targets"][i, :n] = row["targets"]
        batch["target_logprobs"][i, :n] = row["target_logprobs"]
    return batch


def restricted_teacher_cross_entropy(
    draft_logits: torch.Tensor, targets: torch.Tensor, target_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, top-1 agreement) at the positions with a teacher.

    ``draft_logits`` ``(..., N)`` over the draft vocabulary; ``targets`` ``(..., k)`` rows of the draft
    vocabulary (-1: not in it, or no teacher at this position), ``target_logprobs`` the teacher's
    log-probabilities of them. The teacher is renormalised over its entries inside the draft vocabulary;
    a position counts when its greedy token (entry 0) is inside. Agreement: the drafter's argmax is the
    teacher's greedy token."""
    inside = targets >= 0
    counted = inside[..., 0]
    logits = draft_logits[counted].float()
    tgt, tlp, keep = targets[counted], target_logprobs[counted], inside[counted]
    if logits.numel() == 0:
        zero = draft_logits.sum() * 0.0
        return zero, zero.detach()
    teacher = torch.softmax(tlp.masked_fill(~keep, float("-inf")), dim=-1)
    student = torch.log_softmax(logits, dim=-1).gather(-1, tgt.clamp_min(0))
    loss = -(teacher * student.masked_fill(~keep, 0.0)).sum(-1).mean()
    agreement = (logits.argmax(-1) == tgt[:, 0]).float().mean()
    return loss, agreement.detach()


def draft_head_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, draft_ids: torch.Tensor
) -> torch.Tensor:
    """``(B, T, N)`` logits of a causal LM over ``draft_ids`` only (its head's rows for them)."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weight = model.get_output_embeddings().weight
    return F.linear(hidden, weight.index_select(0, draft_ids.to(weight.device)))


class AnswerDistillModule(L.LightningModule):
    """Trains ``model`` (a causal LM) with :func:`restricted_teacher_cross_entropy`."""

    def __init__(self, model: Any, draft_ids: torch.Tensor, cfg: AnswerDistillConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.draft_ids: torch.Tensor
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)

    def _step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = draft_head_logits(self.model, batch["input_ids"], batch["attention_mask"], self.draft_ids)
        return restricted_teacher_cross_entropy(logits, batch["targets"], batch["target_logprobs"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, agreement = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/agreement", agreement, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, agreement = self._step(batch)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/agreement", agreement, prog_bar=True)

    def configure_optimizers(self) -> Any:
        from transformers import get_cosine_schedule_with_warmup

        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.95)
        )
        schedule = get_cosine_schedule_with_warmup(optimizer, self.cfg.warmup_steps, self.cfg.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
