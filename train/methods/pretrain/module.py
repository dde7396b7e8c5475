"""Plain causal language-model pretraining; builds the embedded tiny verifier/drafter pair."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import lightning as L
import torch
from transformers import PreTrainedModel

from train.methods.pretrain.config import PretrainConfig
from train.training.optim import configure_optimizers


class PretrainModule(L.LightningModule):
    """Next-token cross-entropy on packed sequences of ``input_ids``."""

    def __init__(self, model: PreTrainedModel, cfg: PretrainConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self._val_nll = 0.0
        self._val_tokens = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        return self.model(input_ids=ids, labels=ids).loss

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
        self._val_nll, self._val_tokens = 0.0, 0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        n = ids.numel() - ids.shape[0]
        self._val_nll += float(self._loss(batch)) * n
        self._val_tokens += n

    def on_validation_epoch_end(self) -> None:
        nll = self._val_nll / max(self._val_tokens, 1)
        self.log("val/loss", nll, prog_bar=True, sync_dist=True)
        self.log("val/perplexity", math.exp(min(nll, 50.0)), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.model.parameters(), self.cfg.optimizer, self.cfg.scheduler)

    def finish(self, trainer: L.Trainer, spec: Any) -> str | None:
        """Save the trained model (rank 0 only) as a Hugging Face folder in the run directory."""
        if not trainer.is_global_zero:
            return None
        out = os.path.join(spec.run_dir, "model")
        self.model.save_pretrained(out)
        print(f"Model: {os.path.abspath(out)}\nRun directory: {os.path.abspath(spec.run_dir)}", flush=True)
        return out
