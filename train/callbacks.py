"""Lightning callbacks of our own: stopping cleanly on a non-finite loss."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss; the weights were not updated with it."""


class NonFiniteLossGuard(L.Callback):
    """Stop before a non-finite loss reaches the optimizer, naming the step and the last good checkpoint.

    Raising in ``on_before_backward`` means no gradient or weight update comes from the bad batch, so
    the last checkpoint written by ``ModelCheckpoint`` (and the in-memory weights) stay good.
    """

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if torch.isfinite(loss).all():
            return
        last = _last_checkpoint(trainer)
        where = f"last good checkpoint: {last}" if last else "no checkpoint was written yet"
        raise NonFiniteLossError(
            f"non-finite loss ({loss.detach().float().item()}) at global step {trainer.global_step} "
            f"(epoch {trainer.current_epoch}); {where}. Lower the learning rate or check the data, then "
            "resume with ckpt_path=last."
        )


def _last_checkpoint(trainer: L.Trainer) -> Any:
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, ModelCheckpoint) and (cb.last_model_path or cb.best_model_path):
            return cb.last_model_path or cb.best_model_path
    return None
