"""The training progress bar: optimizer steps out of ``trainer.max_steps``, short metric names.

Lightning's ``RichProgressBar`` counts batches per epoch and titles the bar ``Epoch 21/-2`` when a
run is bounded by ``max_steps`` only (``max_epochs=-1``), which is how every draftsmith run is bounded.
:class:`StepProgressBar` keeps one bar for the whole run (``train 120/600``, starting where a resumed
run starts), drops the logger's ``v_num`` and shortens metric names so they fit an 80-column terminal.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepProgressBar", "short_metric_name"]

_SHORT = {"expected_acceptance": "accept", "simulated_block_efficiency": "tau_sim"}


def short_metric_name(name: str) -> str:
    """``train/loss`` -> ``loss``, ``val/expected_acceptance`` -> ``val_accept``."""
    split, _, metric = name.rpartition("/")
    metric = _SHORT.get(metric, metric)
    return metric if split in ("", "train") else f"{split}_{metric}"


class StepProgressBar(RichProgressBar):
    """One bar over the run's optimizer steps (see the module docstring)."""

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'train':{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.is_disabled:
            return
        if self.progress is not None and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
            self._update(self.train_progress_bar_id, trainer.global_step)
        self.refresh()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {short_metric_name(k): v for k, v in items.items()}
