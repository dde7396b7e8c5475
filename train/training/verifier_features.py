"""What a drafter trained on the verifier's hidden states (EAGLE-3, DFlash) asks of the verifier each step:
its auxiliary states at the drafter's layers and its targets over the draft vocabulary, from a verifier
pass or, after a row's first pass, from the feature cache (:mod:`train.training.feature_cache`, saved
across runs with ``feature_cache_dir``).

:class:`VerifierFeatures` is the LightningModule side of that: a mixin for a module that holds
``verifier`` (frozen, not a child), ``drafter`` (with ``aux_layers``, ``aux_features``, ``draft_ids``,
``t2d``), ``cfg`` (with ``feature_cache_gb`` and ``feature_cache_dir``) and ``feature_cache``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from train.config import ConfigError
from train.models.eagle3_ttt import VerifierTargets, head_matches, head_targets, verifier_targets
from train.training.feature_cache import FeatureCache, fingerprint, padded_rows, row_keys

__all__ = ["VerifierFeatures"]

log = logging.getLogger(__name__)


class VerifierFeatures:
    """The verifier's features and targets for a training batch (see the module docstring)."""

    verifier: Any
    drafter: Any
    cfg: Any
    feature_cache: FeatureCache
    _head_checked: bool = False
    # what the LightningModule provides
    device: torch.device
    global_rank: int
    _trainer: Any
    trainer: Any

    def setup(self, stage: str) -> None:
        self.verifier.to(self.device)

    def on_fit_start(self) -> None:
        self.verifier.to(self.device)
        folder = self.cfg.feature_cache_dir
        if folder is None:
            return
        stamp, own = self.feature_stamp(), f"features.rank{self.global_rank}.pt"
        # this rank's own file first: its rows are the ones this rank's pinned share asks for
        for path in sorted(Path(folder).glob("features.rank*.pt"), key=lambda p: (p.name != own, p.name)):
            added = self.feature_cache.load(path, stamp, own=path.name == own)
            if added:
                log.info("Read the verifier's features of %d rows from %s", added, path)

    def on_train_epoch_end(self) -> None:
        self.save_features()

    def on_train_end(self) -> None:
        self.save_features()

    def feature_stamp(self) -> dict[str, Any]:
        """The :func:`fingerprint` the saved features carry: this verifier, these layers, this precision."""
        precision = str(self.trainer.precision) if self._trainer is not None else "none"
        return fingerprint(self.verifier, self.drafter.aux_layers, precision, self.device.type)

    def save_features(self) -> None:
        """The kept rows to ``feature_cache_dir`` when rows were added since the last save. A cache: a
        failed write is logged and training goes on."""
        folder = self.cfg.feature_cache_dir
        if folder is None or not self.feature_cache.unsaved:
            return
        path = Path(folder) / f"features.rank{self.global_rank}.pt"
        try:
            self.feature_cache.save(path, self.feature_stamp())
        except Exception:  # a cache: losing it costs the next run time, never this run's drafter
            log.warning(
                "method.feature_cache_dir: could not save the features to %s; training goes on",
                path,
                exc_info=True,
            )
            return
        log.info("Saved the verifier's features of %d rows to %s", len(self.feature_cache), path)

    def verifier_pass(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The verifier's concatenated auxiliary states (B, T, len(aux_layers) h), logits (B, T, V) and
        last hidden state (B, T, h), after its final norm."""
        with torch.no_grad():
            out = self.verifier(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                output_hidden_states=True,
                use_cache=False,
            )
        aux = torch.cat(self.drafter.aux_features(out.hidden_states), dim=-1)
        return aux, out.logits, out.hidden_states[-1]

    def features_and_targets(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, VerifierTargets]:
        """The auxiliary states and the verifier's targets of ``batch``: from the feature cache when every
        row of the batch is there, else from a verifier pass (whose rows are then cached, budget allowing)."""
        draft_ids, t2d = self.drafter.draft_ids, self.drafter.t2d
        keep = self.feature_cache.max_bytes > 0
        lengths: list[int] = []
        keys: list[str] = []
        if keep:  # (reading the lengths and tokens on the host syncs a GPU: only when caching)
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            keys = row_keys(batch["input_ids"], lengths)
            rows = self.feature_cache.lookup(keys)
            if rows is not None:
                width = batch["input_ids"].shape[1]
                aux, hidden, argmax = padded_rows(rows, width, batch["input_ids"].device)
                head = self.verifier.get_output_embeddings()
                return aux, head_targets(hidden, head, argmax, draft_ids, t2d)
        aux, logits, hidden = self.verifier_pass(batch)
        targets = verifier_targets(logits, draft_ids, t2d)
        if keep:
            self.check_head(hidden, logits)
            self.feature_cache.store(keys, lengths, aux, hidden, targets.argmax)
        return aux, targets

    def check_head(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Once per run: the cache recomputes the targets from the last hidden state with the verifier's
        head (:func:`head_targets`); a ConfigError when that does not give the verifier's logits."""
        if self._head_checked:
            return
        head = self.verifier.get_output_embeddings()
        # a few rounding steps of the logits' dtype: a different summation order, not a different function
        atol = 4 * torch.finfo(logits.dtype).eps * float(logits.abs().max())
        if head is None or not head_matches(hidden, head, logits, self.drafter.draft_ids, atol):
            raise ConfigError(
                "method.feature_cache_gb: the verifier's logits are not its output layer applied to its last "
                "hidden state (a logit scale or soft cap?), so cached features cannot recompute its targets; "
                "set method.feature_cache_gb=0 to train online"
            )
        self._head_checked = True
