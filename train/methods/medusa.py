"""Medusa-1: prediction heads trained on a frozen verifier (ALGORITHMS.md section 3).

Each step runs the frozen verifier over packed corpus blocks, takes its last hidden states, and
trains :class:`~train.models.heads.MedusaHeads` with :func:`~train.models.heads.medusa_loss`: head k
against the tokens k + 2 ahead, weighted ``decay**k``. Validation logs, per head, top-1 and top-5
accuracy against the corpus (``val/head{k}_top1``, ``val/head{k}_top5``) and its agreement with the
verifier's own greedy prediction of that token, and ``val/simulated_block_efficiency``: 1 + the mean
number of leading heads whose top-1 equals the verifier's argmax at the same position, i.e. the
blockwise top-1 chain's tokens per verifier call, teacher-forced on the corpus prefix (an
approximation: real decoding continues from the verifier's own tokens).

The verifier stays outside the module's registered children (never in a checkpoint or an
optimizer). ``finish`` exports the heads (``heads/`` and the vLLM layout ``heads_vllm/``, through
:mod:`train.export_heads`) and writes ``report.json`` / ``report.md`` with the final validation
figures (:func:`train.report.write_heads_report`). ``scripts/medusa_eval.py`` then measures the heads
with :class:`train.decoding.MedusaDecoder`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from train.config import require
from train.data.datamodule import packed_corpus
from train.export_heads import export_heads
from train.models.heads import MedusaHeads, medusa_loss, shifted_targets
from train.optim import check_optimizer, configure_optimizers
from train.report import write_heads_report

__all__ = ["MedusaConfig", "MedusaModule", "head_metrics"]


@dataclass
class MedusaConfig:
    """Hyperparameters of Medusa-1 (``method=medusa``); validated before any model loads."""

    optimizer: Any
    scheduler: Any = None
    num_heads: int = 4
    num_layers: int = 1
    decay: float = 0.8
    """Weight of head k's loss: decay**k (the authors' 0.8)."""
    seq_len: int = 64
    batch_size: int = 16

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(self.num_heads >= 1, "method.num_heads", ">= 1", self.num_heads)
        require(self.num_layers >= 0, "method.num_layers", ">= 0", self.num_layers)
        require(
            isinstance(self.decay, int | float) and 0 < self.decay <= 1,
            "method.decay",
            "in (0, 1]",
            self.decay,
        )
        require(
            self.seq_len > self.num_heads + 2,
            "method.seq_len",
            f"> num_heads + 2 ({self.num_heads + 2})",
            self.seq_len,
        )
        require(self.batch_size >= 1, "method.batch_size", ">= 1", self.batch_size)

    def build(self, pair: Any, spec: Any) -> tuple[MedusaModule, L.LightningDataModule]:
        """Heads initialised from the pair's verifier (its lm_head), trained on packed ``spec.data`` blocks."""
        data = packed_corpus(spec.data, pair.tokenizer, self.seq_len, self.batch_size, spec.seed)
        heads = MedusaHeads.from_verifier(pair.verifier, self.num_heads, self.num_layers)
        return MedusaModule(pair.verifier, heads, self), data


def head_metrics(
    head_logits: torch.Tensor, verifier_logits: torch.Tensor, input_ids: torch.Tensor, k_top: int = 5
) -> dict[str, torch.Tensor]:
    """Counts for validation, summed over the batch: per head ``top1``, ``top5`` (against the corpus
    token k + 2 ahead), ``agree`` (top-1 = the verifier's argmax for that token), ``n`` (positions);
    and ``run`` (sum over positions t of the leading heads that agree) with ``positions``.

    head_logits: (K, B, T, V); verifier_logits: (B, T, V); input_ids: (B, T)."""
    num_heads, _, length, _ = head_logits.shape
    top = head_logits.topk(min(k_top, head_logits.shape[-1]), dim=-1).indices  # (K, B, T, k)
    verifier_next = verifier_logits.argmax(dim=-1)  # (B, T): the verifier's token for t + 1
    out: dict[str, torch.Tensor] = {}
    agree_all = []
    usable = length - num_heads - 1  # positions where every head's target exists
    for k in range(num_heads):
        targets, valid = shifted_targets(input_ids, k)
        out[f"top1_{k}"] = ((top[k, ..., 0] == targets) & valid).sum()
        out[f"top5_{k}"] = ((top[k] == targets.unsqueeze(-1)).any(-1) & valid).sum()
        out[f"n_{k}"] = valid.sum()
        # head k at t guesses token t + k + 2, which the verifier predicts at position t + k + 1
        verifier_guess = torch.roll(verifier_next, -(k + 1), dims=-1)
        agree = (top[k, ..., 0] == verifier_guess) & valid
        out[f"agree_{k}"] = agree.sum()
        agree_all.append(agree[:, : max(usable, 0)])
    if usable > 0:
        leading = torch.stack(agree_all, dim=-1).long().cumprod(dim=-1).sum(dim=-1)  # (B, usable)
        out["run"] = leading.sum()
        out["positions"] = torch.tensor(leading.numel())
    return out


class MedusaModule(L.LightningModule):
    """Trains ``heads`` on the frozen ``verifier``'s last hidden states (see the module docstring)."""

    verifier: torch.nn.Module

    def __init__(self, verifier: torch.nn.Module, heads: MedusaHeads, cfg: MedusaConfig) -> None:
        super().__init__()
        object.__setattr__(self, "verifier", verifier)  # not a child: never checkpointed or optimised
        verifier.eval()
        verifier.requires_grad_(False)
        self.heads = heads
        self.cfg = cfg
        self._sums: dict[str, float] = {}
        self.last_validation: dict[str, float] = {}

    def setup(self, stage: str) -> None:
        self.verifier.to(self.device)

    def on_fit_start(self) -> None:
        self.verifier.to(self.device)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.heads.parameters(), self.cfg.optimizer, self.cfg.scheduler)

    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = self.verifier(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1].to(self.heads.lm_heads[0].weight.dtype)
        return self.heads(hidden), out.logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        head_logits, _ = self._forward(ids)
        loss, per_head = medusa_loss(head_logits, ids, decay=self.cfg.decay)
        bs = ids.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        for k, ce in enumerate(per_head):
            self.log(f"train/head{k}_ce", ce, batch_size=bs)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._sums = {}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        head_logits, verifier_logits = self._forward(ids)
        loss, _ = medusa_loss(head_logits, ids, decay=self.cfg.decay)
        counts = head_metrics(head_logits, verifier_logits, ids)
        counts["loss"] = loss.detach() * ids.shape[0]
        counts["batches"] = torch.tensor(ids.shape[0])
        for key, value in counts.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)

    def on_validation_epoch_end(self) -> None:
        s = self._sums
        if not s.get("batches"):
            return
        metrics = {"val/loss": s["loss"] / s["batches"]}
        for k in range(self.cfg.num_heads):
            n = max(s.get(f"n_{k}", 0.0), 1.0)
            metrics[f"val/head{k}_top1"] = s[f"top1_{k}"] / n
            metrics[f"val/head{k}_top5"] = s[f"top5_{k}"] / n
            metrics[f"val/head{k}_agree"] = s[f"agree_{k}"] / n
        if s.get("positions"):
            metrics["val/simulated_block_efficiency"] = 1.0 + s["run"] / s["positions"]
        for key, value in metrics.items():
            self.log(
                key, value, prog_bar=key in ("val/loss", "val/simulated_block_efficiency"), sync_dist=True
            )
        self.last_validation = metrics

    def finish(self, trainer: L.Trainer, spec: Any) -> dict[str, Any] | None:
        """Export the heads (both layouts), then the report of the last validation (rank 0 only)."""
        if not trainer.is_global_zero:
            return None
        heads_dir = export_heads(self.heads, spec.run_dir)
        summary = {
            "method": "medusa",
            "num_heads": self.cfg.num_heads,
            "num_layers": self.cfg.num_layers,
            "decay": self.cfg.decay,
            "seq_len": self.cfg.seq_len,
            "steps": trainer.global_step,
        }
        metrics = {k: v for k, v in self.last_validation.items() if math.isfinite(v)}
        return write_heads_report(
            spec.run_dir,
            spec.name,
            summary,
            metrics,
            str(heads_dir),
            os.path.join(spec.run_dir, "heads_vllm"),
        )
