"""Plain causal language-model pretraining: the embedded tiny pair's models, the real pair's drafter.

A model with a reduced draft vocabulary (FR-Spec; ``draft_ids``) is trained over it only: the head's rows
for those ids give the logits (the full-vocabulary ones are never built), and a next token outside the
draft vocabulary is not a target (the drafter can never draft it).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import lightning as L
import torch
from transformers import PreTrainedModel

from train.methods.pretrain.config import PretrainConfig
from train.models.draft_vocab import draft_head_logits, draft_rows_of
from train.training.optim import WholeNormClipping, configure_optimizers


def draft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is a row (>= 0); 0 when none is."""
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="sum"
    )
    return total / (targets >= 0).sum().clamp_min(1)


class PretrainModule(WholeNormClipping, L.LightningModule):
    """Next-token cross-entropy on packed sequences of ``input_ids`` (over ``draft_ids`` when given)."""

    def __init__(
        self, model: PreTrainedModel, cfg: PretrainConfig, draft_ids: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.draft_ids: torch.Tensor | None
        self.register_buffer("draft_ids", None if draft_ids is None else draft_ids.clone(), persistent=False)
        self._val_nll = 0.0
        self._val_tokens = 0
        self._val_correct = 0.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss: no argmax, no host sync (a step on a GPU never waits for the CPU here)."""
        ids = batch["input_ids"]
        if self.draft_ids is None:
            return self.model(input_ids=ids, labels=ids).loss
        return draft_cross_entropy(*self._draft_logits_and_targets(ids))

    def _draft_logits_and_targets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over the draft vocabulary and each next token's row in it (-1 outside: not a target)."""
        assert self.draft_ids is not None
        logits = draft_head_logits(self.model, ids, None, self.draft_ids, drop_last=True)
        return logits, draft_rows_of(ids[:, 1:], self.draft_ids)

    def _loss_and_correct(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(mean cross-entropy, count of top-1 hits, count of targets) over the next tokens of the batch:
        what validation reports."""
        ids = batch["input_ids"]
        if self.draft_ids is None:
            out = self.model(input_ids=ids, labels=ids)
            hits = (out.logits[:, :-1].argmax(-1) == ids[:, 1:]).sum()
            return out.loss, hits.detach(), ids.numel() - ids.shape[0]
        logits, targets = self._draft_logits_and_targets(ids)
        counted = targets >= 0
        hits = (logits.argmax(-1) == targets)[counted].sum()
        return draft_cross_entropy(logits, targets), hits.detach(), int(counted.sum())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_end(self) -> None:
        # One line per process, so a distributed run shows that every rank trained; one write call
        # with its newline, so lines of concurrent ranks never run into each other.
        sys.stdout.write(
            f"rank {self.global_rank}/{self.trainer.world_size}: trained {self.global_step} steps\n"
        )
        sys.stdout.flush()

    def on_validation_epoch_start(self) -> None:
        self._val_nll, self._val_tokens, self._val_correct = 0.0, 0, 0.0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, correct, n = self._loss_and_correct(batch)
        self._val_nll += float(loss) * n
        self._val_correct += float(correct)
        self._val_tokens += n

    def on_validation_epoch_end(self) -> None:
        nll = self._val_nll / max(self._val_tokens, 1)
        self.log("val/loss", nll, prog_bar=True, sync_dist=True)
        self.log("val/perplexity", math.exp(min(nll, 50.0)), sync_dist=True)
        self.log("val/accuracy", self._val_correct / max(self._val_tokens, 1), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.model.parameters(), self.cfg.optimizer, self.cfg.scheduler, self)

    def save_trained(self, trainer: L.Trainer, spec: Any) -> str | None:
        """Save the trained model (rank 0 only) as a Hugging Face folder in the run directory: this
        method's end of a run, in place of the shared finish step (:func:`train.report.finish`)."""
        if not trainer.is_global_zero:
            return None
        out = os.path.join(spec.run_dir, "model")
        self.model.save_pretrained(out)
        print(f"Model: {os.path.abspath(out)}\nRun directory: {os.path.abspath(spec.run_dir)}", flush=True)
        return out
