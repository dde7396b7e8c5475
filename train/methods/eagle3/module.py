"""EAGLE-3: a one-layer drafter on the verifier's fused hidden states, trained online with the
training-time test (docs/eagle3.md).

Each step runs the frozen verifier over a batch of its own answers (prompt + answer,
:mod:`train.training.answer_data`) with ``output_hidden_states``; the drafter reads the states entering
its ``aux_layers`` (concatenated, fused by ``fc``) and unrolls ``ttt_steps`` drafting steps over every
position at once (:func:`train.models.eagle3_ttt.ttt_loss`): step k's loss is the forward KL from the
verifier's distribution k + 1 rows ahead, renormalised over the draft vocabulary, weighted
``decay**k``; only rows that predict an answer token count. The verifier's forward is part of the step
(online, as SpecForge's online mode and speculators do); with ``feature_cache_gb`` > 0 each row's
features are kept in memory after its first pass and later epochs skip the verifier
(:mod:`train.training.feature_cache`); with ``feature_cache_dir`` too they are saved after each
epoch that added rows and the next run with the same verifier starts from them (offline).

The verifier is frozen and stays outside the module's children (never checkpointed, optimised or
sharded). The drafter is a child and trains in float32 whatever ``model.dtype`` is (its frozen
embedding, a copy of the verifier's, too: FSDP flattens a module's parameters into one tensor of one
dtype); the export is written back in ``model.dtype``.

Logged: ``train/loss``, ``train/acc_k`` and ``train/loss_k`` per step; validation ``val/acc_k`` (the
drafter's argmax is the verifier's at step k, over positions whose verifier argmax is in the draft
vocabulary), ``val/cond_acc_k`` (the same among the chains still alive at step k) and
``val/simulated_block_efficiency`` (1 + the mean teacher-forced chain length over ``ttt_steps`` steps;
:func:`train.models.eagle3_ttt.chain_counts`).

The finish step (:mod:`train.methods.eagle3.finish`) exports ``eagle3/`` (``save_pretrained``) and the
speculators layout vLLM loads (``eagle3_speculators/``), then evaluates :class:`train.decoding.Eagle3Decoder`
(and, with ``compare_pair_drafter``, the pair's own drafter under chain SD) against autoregressive
decoding.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.finish import Eagle3Finish
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.eagle3_ttt import TTTResult, chain_counts, ttt_loss
from train.training.across_ranks import summed_over_ranks
from train.training.callbacks import describe_nonfinite, nonfinite_losses
from train.training.feature_cache import FeatureCache
from train.training.optim import WholeNormClipping, configure_optimizers, weights_dtype
from train.training.verifier_features import VerifierFeatures

log = logging.getLogger(__name__)


class Eagle3Module(VerifierFeatures, Eagle3Finish, WholeNormClipping, L.LightningModule):
    """Trains ``drafter`` on ``verifier``'s features (see the module docstring)."""

    verifier: Any
    comparison: torch.nn.Module | None

    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: Eagle3Drafter,
        cfg: Eagle3Config,
        tokenizer: Any = None,
        comparison: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.export_dtype = weights_dtype(verifier)  # the drafter is served beside this verifier
        self.drafter = drafter.float()  # float32 master weights (see the module docstring)
        object.__setattr__(self, "verifier", verifier)  # not a child: never checkpointed or optimised
        object.__setattr__(self, "comparison", comparison)  # the pair's drafter, for the finish step
        verifier.eval()
        verifier.requires_grad_(False)
        self._sums: dict[str, float] = {}
        self.last_validation: dict[str, float] = {}
        self.feature_cache = FeatureCache(int(cfg.feature_cache_gb * 2**30))
        self._head_checked = False

    # ------------------------------------------------------------------ training

    def configure_optimizers(self) -> Any:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        return configure_optimizers(params, self.cfg.optimizer, self.cfg.scheduler, self)

    def ttt(self, batch: dict[str, torch.Tensor], chain_stats: bool = True) -> TTTResult:
        """The training-time test on ``batch``;
        ``chain_stats``: with the per-position hits validation reads."""
        aux, targets = self.features_and_targets(batch)
        return ttt_loss(
            self.drafter,
            aux,
            batch["input_ids"],
            targets,
            batch["loss_mask"],
            steps=self.cfg.ttt_steps,
            decay=self.cfg.decay,
            chain_stats=chain_stats,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        result = self.ttt(batch, chain_stats=False)
        bad = nonfinite_losses(result.loss, self)  # every rank, so all raise together
        if bad:
            raise FloatingPointError(
                f"the EAGLE-3 loss is {describe_nonfinite(bad, self)} "
                f"at step {self.global_step}; lower method.optimizer.lr"
            )
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", result.loss, prog_bar=True, batch_size=batch_size)
        for k, (loss, accuracy) in enumerate(zip(result.losses, result.accuracies, strict=True)):
            self.log(f"train/acc_{k}", accuracy, prog_bar=k == 0, batch_size=batch_size)
            self.log(f"train/loss_{k}", loss.detach(), batch_size=batch_size)
        return result.loss

    # ------------------------------------------------------------------ validation

    def on_validation_epoch_start(self) -> None:
        self._sums = {}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        result = self.ttt(batch)
        chains = chain_counts(result.hits, result.eligible)
        # one host copy per batch for every figure, not one per step and figure
        figures = [result.loss.detach(), *result.accuracies, *result.counts, *chains.values()]
        on_host = torch.stack([f.double() for f in figures]).tolist()  # float64 holds each exactly
        loss, on_host = on_host[0], on_host[1:]
        steps = len(result.accuracies)
        accuracies, kept, chain_values = on_host[:steps], on_host[steps : 2 * steps], on_host[2 * steps :]
        counts: dict[str, float] = {"loss": loss * batch["input_ids"].shape[0]}
        counts["batches"] = batch["input_ids"].shape[0]
        for k, (accuracy, n) in enumerate(zip(accuracies, kept, strict=True)):
            counts[f"hit_{k}"] = accuracy * int(n)
            counts[f"n_{k}"] = int(n)
        counts.update(dict(zip(chains, chain_values, strict=True)))
        for key, value in counts.items():
            self._sums[key] = self._sums.get(key, 0.0) + value

    def on_validation_epoch_end(self) -> None:
        # every rank's counts (a collective), so rank 0's last_validation is the whole validation's
        metrics = validation_metrics(summed_over_ranks(self._sums, self.device), self.cfg.ttt_steps)
        for key, value in metrics.items():
            prog = key in ("val/acc_0", "val/simulated_block_efficiency")
            self.log(key, value, prog_bar=prog, sync_dist=True)
        if metrics:
            self.last_validation = metrics


def validation_metrics(sums: dict[str, float], steps: int) -> dict[str, float]:
    """``val/loss``, ``val/acc_k``, ``val/cond_acc_k`` and ``val/simulated_block_efficiency`` from the
    summed counts of an epoch (empty when no batch was seen)."""
    if not sums.get("batches"):
        return {}
    metrics = {"val/loss": sums["loss"] / sums["batches"]}
    for k in range(steps):
        metrics[f"val/acc_{k}"] = sums.get(f"hit_{k}", 0.0) / max(sums.get(f"n_{k}", 0.0), 1.0)
        metrics[f"val/cond_acc_{k}"] = sums.get(f"cond_hit_{k}", 0.0) / max(sums.get(f"cond_n_{k}", 0.0), 1.0)
    metrics["val/simulated_block_efficiency"] = 1.0 + sums.get("run", 0.0) / max(sums.get("starts", 0.0), 1.0)
    return metrics
