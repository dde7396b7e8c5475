"""DFlash: a drafter of several layers that proposes a whole block in one non-causal forward over the
verifier's fused hidden states (docs/dflash.md).

Each step reads the frozen verifier's states at the drafter's ``aux_layers`` over a batch of its own answers
(a verifier pass, or the feature cache after a row's first pass: :mod:`train.training.verifier_features`)
and trains ``num_anchors`` blocks per row in one forward (:func:`train.models.dflash_loss.block_loss`): each
block is an answer token (the anchor) and ``block_size - 1`` mask tokens, sees the context before its anchor
and its own block, and slot k is scored against the verifier's distribution for position anchor + k
(forward KL over the draft vocabulary, weight ``exp(-(k - 1) / slot_decay)``).

The verifier is frozen and stays outside the module's children; the drafter trains in float32 master
weights whatever ``model.dtype`` is, and is exported in ``model.dtype``.

Logged: ``train/loss``, ``train/acc_k`` (slot k's argmax is the verifier's); validation ``val/acc_k`` and
``val/simulated_block_efficiency`` (1 + the mean run of hits from slot 1, per block). Validation draws its
anchors from a generator seeded by the batch index, so every validation sees the same blocks.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from train.methods.dflash.config import DFlashConfig
from train.methods.dflash.finish import DFlashFinish
from train.models.dflash_drafter import DFlashDrafter
from train.models.dflash_loss import BlockResult, block_loss
from train.training.across_ranks import summed_over_ranks
from train.training.callbacks import describe_nonfinite, nonfinite_losses
from train.training.feature_cache import FeatureCache
from train.training.optim import WholeNormClipping, configure_optimizers, weights_dtype
from train.training.verifier_features import VerifierFeatures


class DFlashModule(VerifierFeatures, DFlashFinish, WholeNormClipping, L.LightningModule):
    """Trains ``drafter`` on ``verifier``'s features (see the module docstring)."""

    verifier: Any
    comparison: torch.nn.Module | None

    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: DFlashDrafter,
        cfg: DFlashConfig,
        tokenizer: Any = None,
        comparison: torch.nn.Module | None = None,
        eagle3: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.export_dtype = weights_dtype(verifier)
        self.drafter = drafter.float()
        object.__setattr__(self, "verifier", verifier)  # not a child: never checkpointed or optimised
        object.__setattr__(self, "comparison", comparison)
        object.__setattr__(self, "eagle3", eagle3)  # measured beside DFlash by the finish step; not a child
        verifier.eval()
        verifier.requires_grad_(False)
        self._sums: dict[str, float] = {}
        self.last_validation: dict[str, float] = {}
        self.feature_cache = FeatureCache(int(cfg.feature_cache_gb * 2**30))
        self._head_checked = False

    def configure_optimizers(self) -> Any:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        return configure_optimizers(params, self.cfg.optimizer, self.cfg.scheduler, self)

    def blocks(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> BlockResult:
        """The block loss of ``batch`` (anchors from ``generator``, None: the global one)."""
        aux, targets = self.features_and_targets(batch)
        return block_loss(
            self.drafter, aux, batch, targets, self.cfg.num_anchors, self.cfg.slot_decay, generator
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        result = self.blocks(batch)
        bad = nonfinite_losses(result.loss, self)  # every rank, so all raise together
        if bad:
            raise FloatingPointError(
                f"the DFlash loss is {describe_nonfinite(bad, self)} "
                f"at step {self.global_step}; lower method.optimizer.lr"
            )
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", result.loss, prog_bar=True, batch_size=batch_size)
        for k, accuracy in enumerate(result.accuracies, start=1):
            self.log(f"train/acc_{k}", accuracy, prog_bar=k == 1, batch_size=batch_size)
        return result.loss

    def on_validation_epoch_start(self) -> None:
        self._sums = {}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        result = self.blocks(batch, torch.Generator().manual_seed(batch_idx))
        assert result.runs is not None and result.blocks is not None
        figures = [result.loss.detach(), *result.accuracies, *result.counts, result.runs, result.blocks]
        values = torch.stack([f.double() for f in figures]).tolist()  # one host copy per batch
        slots = len(result.accuracies)
        sums = {"loss": values[0] * batch["input_ids"].shape[0], "batches": batch["input_ids"].shape[0]}
        for k in range(slots):
            sums[f"hit_{k + 1}"] = values[1 + k] * values[1 + slots + k]
            sums[f"n_{k + 1}"] = values[1 + slots + k]
        sums["run"], sums["starts"] = values[-2], values[-1]
        for key, value in sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + value

    def on_validation_epoch_end(self) -> None:
        sums = summed_over_ranks(self._sums, self.device)  # a collective: every rank's blocks
        if not sums.get("batches"):
            return
        metrics = {"val/loss": sums["loss"] / sums["batches"]}
        for k in range(1, self.cfg.block_size):
            metrics[f"val/acc_{k}"] = sums.get(f"hit_{k}", 0.0) / max(sums.get(f"n_{k}", 0.0), 1.0)
        metrics["val/simulated_block_efficiency"] = 1.0 + sums["run"] / max(sums["starts"], 1.0)
        for key, value in metrics.items():
            self.log(
                key, value, prog_bar=key in ("val/acc_1", "val/simulated_block_efficiency"), sync_dist=True
            )
        self.last_validation = metrics
