"""DistillSpec / GKD: distil the drafter towards the frozen verifier (the papers' student and teacher).

docs/distillspec.md (Zhou et al. 2023, arXiv 2310.08461; Agarwal et al. 2023, arXiv 2306.13649).
Each training step draws a batch of prompts, picks where its continuations come from, and minimises
the mean per-token divergence D(p || q_theta) over the continuation tokens only:

``data_source`` (``G`` in the paper) -- which continuations a batch trains on:

==================  ===========================================================================
``fixed``           the ground-truth continuations of the corpus (no generation)
``verifier``        sampled from the verifier (its answers, cached: one per prompt per run, see below)
``drafter``         sampled from the current drafter: on-policy, every batch
``mixed_fixed``     on-policy with probability ``lmbda``, otherwise ``fixed``
``mixed_verifier``  on-policy with probability ``lmbda``, otherwise ``verifier``
==================  ===========================================================================

``lmbda`` only matters for the two ``mixed_*`` sources (``drafter`` is lmbda = 1, ``fixed`` and
``verifier`` are lmbda = 0). Rollouts use :func:`train.training.rollout.rollout` -- the evaluator's
``warp``/``sample`` with a KV cache, batched with left padding -- under ``torch.no_grad``.
The verifier's continuations depend only on the prompt, so they are generated once per prompt and run
and kept (its answers, ``cache_answers``): later epochs reuse them instead of generating. What the
verifier computes and will be asked again is kept within ``verifier_cache_mb``
(:mod:`train.training.verifier_scores`): each training prompt's key/value cache, so that an on-policy
batch runs the verifier over its continuation only, and the logits over each cached answer, so that a
verifier batch seen before runs no verifier forward at all.

A drafter whose config names a draft vocabulary (``config.draft_vocab``, FR-Spec; docs/draft_vocab.md)
drafts and trains over it only: on-policy rollouts sample from it
(:class:`~train.models.draft_vocab.DraftVocabModel`, ``-inf`` outside), the divergence compares its
logits over the draft ids with the verifier's renormalised over them (``draft_divergence``), and
``expected_acceptance`` is what decoding sees: the verifier's whole distribution, q = 0 outside
(``draft_acceptance``). The drafter itself stays a plain model (export, LoRA, checkpoints).

The verifier is held outside the module's registered children, so it is never written to Lightning
checkpoints and never receives an optimizer; it is reloaded from its source on resume. A checkpoint saved
under the old names (:data:`OLD_PREFIXES`, :data:`OLD_ENTRIES`) still resumes.
The module holds no evaluation or export code: it implements :class:`train.report.Finishable`
(the pretrained drafter as ``before``, the distilled one as ``after``, export as a Hugging Face
folder) and :func:`train.report.finish` exports, evaluates and reports.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from train.decoding.metrics import simulated_block_efficiency
from train.decoding.sampling import SamplingParams
from train.losses import acceptance_from_logits, divergence
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.finish import DistillSpecFinish
from train.models.draft_vocab import (
    DraftVocabModel,
    argmax_agreement,
    draft_acceptance,
    draft_divergence,
    draft_vocab_of,
    vocab_index,
)
from train.models.lora import apply_lora
from train.training.answer_cache import CHECKPOINT_ENTRY, AnswerCache, continuation_logits, with_continuation
from train.training.byte_budget import ByteBudget
from train.training.checkpoint_names import renamed_checkpoint
from train.training.optim import (
    WholeNormClipping,
    configure_optimizers,
    float32_trainables,
    weights_dtype,
)
from train.training.rollout import Rollout, RolloutSampler, last_prompt_tokens
from train.training.seeding import mix_seed, seeded_generator
from train.training.verifier_scores import PrefixScorer

log = logging.getLogger(__name__)

#: Checkpoints saved before issue 53, old name -> new: the drafter's weights (the GKD paper's "student"),
#: and the entry of the verifier's answers (its "teacher" cache).
OLD_PREFIXES, OLD_ENTRIES = {"student.": "drafter."}, {"teacher_cache": CHECKPOINT_ENTRY}


class DistillSpecModule(DistillSpecFinish, WholeNormClipping, L.LightningModule):
    """The drafter learns the verifier's next-token distributions on continuation tokens.

    ``pretrained``: loads the drafter as it was before training (the finish step's ``before``);
    None: only the distilled drafter is evaluated.
    """

    verifier: torch.nn.Module

    def __init__(
        self,
        drafter: torch.nn.Module,
        verifier: torch.nn.Module,
        tokenizer: Any,
        cfg: DistillSpecConfig,
        seed: int = 0,
        pretrained: Callable[[], torch.nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.export_dtype = weights_dtype(drafter)  # model.dtype: what the export is written in
        # float32 master weights for what trains (full drafter or adapters); the frozen base keeps its dtype
        self.drafter = float32_trainables(apply_lora(drafter, cfg.lora) if cfg.lora.enabled else drafter)
        # Not a registered child: the frozen verifier stays out of state_dict, checkpoints and the optimizer.
        object.__setattr__(self, "verifier", verifier)
        verifier.eval()
        verifier.requires_grad_(False)
        self.tokenizer = tokenizer
        self.pretrained = pretrained
        self.sampler = RolloutSampler.for_models(
            tokenizer, cfg.max_new_tokens, cfg.temperature, verifier, drafter
        )
        ids = draft_vocab_of(drafter)
        #: A drafter with a reduced vocabulary (``config.draft_vocab``) samples and is trained over it only.
        self.draft_ids: torch.Tensor | None = torch.tensor(ids, dtype=torch.long) if ids else None
        #: The verifier's training continuations (``verifier_temperature``; validation keeps ``sampler``).
        self.verifier_sampler = dataclasses.replace(
            self.sampler, params=SamplingParams(temperature=cfg.verifier_rollout_temperature)
        )
        #: What the verifier computed and will be asked again, kept within ``verifier_cache_mb``: the
        #: prompts' key/value caches (``verifier_scorer``) and the logits over its cached answers. Those
        #: logits come from the scorer, not from the generation: a resumed run, whose checkpoint carries the
        #: answers only, recomputes them the same way and ends with the same weights.
        self.verifier_budget = ByteBudget(cfg.verifier_cache_mb)
        self.verifier_scorer = PrefixScorer(verifier, self.verifier_budget)
        #: The verifier's answers to the training prompts, generated once per prompt and run.
        self.answers = AnswerCache(
            lambda ids, attn, gen: self.verifier_sampler.sample(self.verifier, ids, attn, gen),
            self.sampler.pad_token_id,
            self.verifier_budget,
        )
        #: Greedy (T = 0) verifier continuations for ``val/greedy_agreement``.
        self.greedy_sampler = dataclasses.replace(self.sampler, params=SamplingParams(temperature=0.0))
        self._val_cache: dict[int, Rollout] = {}
        self._val_greedy_cache: dict[int, Rollout] = {}
        self._val_sums: dict[str, float] = {}
        #: One entry per validation (sanity checks excluded): the step and the validation metrics.
        self.validation_history: list[dict[str, float]] = []
        self.last_num_tokens = 0

    # ---------------------------------------------------------------- plumbing

    def setup(self, stage: str) -> None:
        self.verifier.to(self.device)
        if self.draft_ids is not None:
            self.draft_ids = self.draft_ids.to(self.device)

    def on_fit_start(self) -> None:
        self.verifier.to(self.device)
        self.drafter.train()  # from_pretrained returns eval mode; the verifier stays in eval mode

    def preload_answers(self, answers: Any) -> None:
        """The verifier's answers to some training prompts given in advance (generated offline,
        :class:`~train.models.answers.Answer`), each cut to ``max_new_tokens``: verifier batches on those
        prompts read them instead of generating."""
        n = self.cfg.max_new_tokens
        for answer in answers:
            self.answers.add(answer.prompt, answer.answer[:n])
        log.info("answers given in advance for %d training prompts", len(self.answers))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The answers generated so far travel with the checkpoint: a resumed run reuses them instead of
        sampling different ones at a later step (exact resume)."""
        checkpoint[CHECKPOINT_ENTRY] = self.answers.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before Lightning loads the weights: old names renamed, then the answers read."""
        self.answers.load(renamed_checkpoint(checkpoint, OLD_PREFIXES, OLD_ENTRIES).get(CHECKPOINT_ENTRY))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        return configure_optimizers(params, self.cfg.optimizer, self.cfg.scheduler, self)

    def _generator(self, *salt: int) -> torch.Generator:
        """Seeded by (run seed, salt): reproducible on resume, distinct per rank."""
        return seeded_generator(self.device, self.seed, *salt)

    # ---------------------------------------------------------------- data

    def _fixed(self, batch: dict[str, torch.Tensor]) -> Rollout:
        """Prompt + ground-truth continuation, in the same layout a rollout has."""
        return with_continuation(
            batch["input_ids"], batch["attention_mask"], batch["continuation_ids"], batch["continuation_mask"]
        )

    def _generate(
        self, model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, gen: torch.Generator
    ) -> Rollout:
        return self.sampler.sample(model, ids, attn, gen)

    def _verifier_rollout(self, batch: dict[str, torch.Tensor], gen: torch.Generator) -> Rollout:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        if not self.cfg.cache_answers:  # the generation's own logits score this batch
            return self.verifier_sampler.sample(self.verifier, ids, attn, gen, keep_scores=True)
        return self.answers(ids, attn, gen)

    def make_batch(self, batch: dict[str, torch.Tensor], source: str, gen: torch.Generator) -> Rollout:
        """The training sequences for ``source`` in {fixed, verifier, drafter}; ``scores`` are the
        verifier's logits over them where already known (verifier batches), never the drafter's."""
        if source == "fixed":
            return self._fixed(batch)
        if source == "verifier":
            return self._verifier_rollout(batch, gen)
        return self._generate(self.drafting_model(), batch["input_ids"], batch["attention_mask"], gen)

    def drafting_model(self, full_logits: bool = True) -> torch.nn.Module:
        """The drafter as it drafts: over its draft vocabulary when it has one (full-size logits with
        ``-inf`` outside, or, ``full_logits=False``, the draft ids' logits only)."""
        if self.draft_ids is None:
            return self.drafter
        return DraftVocabModel(self.drafter, self.draft_ids.to(self.device), full_logits=full_logits)

    def pick_source(self, step: int) -> str:
        """On-policy with probability lambda, drawn from a per-step seed (reproducible on resume)."""
        on_policy = self.cfg.on_policy_probability
        if on_policy >= 1.0:
            return "drafter"
        if on_policy > 0.0 and random.Random(mix_seed(self.seed, step, -2)).random() < on_policy:
            return "drafter"
        return self.cfg.off_policy_source

    # ---------------------------------------------------------------- loss

    def logits(self, model: torch.nn.Module, rollouts: Rollout) -> torch.Tensor:
        """(B, N, V) logits predicting the continuation positions."""
        return continuation_logits(model, rollouts)

    def distill_loss(
        self, rollouts: Rollout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, drafter logits, verifier logits, mask) on the continuation tokens of ``rollouts``; the
        verifier's logits are ``rollouts.scores`` where the batch carries them (the verifier generated it),
        else computed over the continuation on the prompt's kept cache (:class:`PrefixScorer`)."""
        mask = rollouts.continuation_mask[:, rollouts.prompt_width :]
        with torch.no_grad():
            verifier_logits = (
                rollouts.scores if rollouts.scores is not None else self.verifier_scorer(rollouts)
            )
        cfg = self.cfg
        seen = last_prompt_tokens(rollouts, cfg.drafter_context) if self.training else rollouts
        if self.draft_ids is None:
            drafter_logits = self.logits(self.drafter, seen)
            loss = divergence(
                cfg.divergence,
                drafter_logits,
                verifier_logits,
                mask,
                temperature=cfg.temperature,
                beta=cfg.beta,
            )
        else:  # (B, N, n_draft) logits; the verifier renormalised over the draft ids (FR-Spec, EAGLE-3)
            drafter_logits = self.logits(self.drafting_model(full_logits=False), seen)
            loss = draft_divergence(
                cfg.divergence,
                drafter_logits,
                verifier_logits,
                self.draft_ids,
                mask,
                temperature=cfg.temperature,
                beta=cfg.beta,
            )
        return loss, drafter_logits, verifier_logits, mask

    def acceptance(
        self, drafter_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """``expected_acceptance``: sum_v min(p, q) with the verifier's whole p; a drafter with a draft
        vocabulary has q = 0 outside it (:func:`~train.models.draft_vocab.draft_acceptance`), so the
        verifier's mass there counts as rejected, as in decoding."""
        t = self.cfg.temperature
        if self.draft_ids is None:
            return acceptance_from_logits(drafter_logits, verifier_logits, mask, temperature=t)
        return draft_acceptance(drafter_logits, verifier_logits, self.draft_ids, mask, temperature=t)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.global_step
        source = self.pick_source(step)
        rollouts = self.make_batch(
            batch, source, self._generator(step, self.global_rank)
        )  # each rank its own
        loss, d_logits, v_logits, mask = self.distill_loss(rollouts)
        if source == "verifier" and rollouts.scores is None and self.cfg.cache_answers:
            self.answers.keep_scores(rollouts, v_logits)  # answers given in advance, or a resume
        self.last_num_tokens = int(mask.sum())
        total = loss
        if self.cfg.ce_weight > 0:
            ce = self.ground_truth_ce(batch)
            total = loss + self.cfg.ce_weight * ce
            self.log("train/ce", ce)
        acceptance = self.acceptance(d_logits.detach(), v_logits, mask)
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", total, prog_bar=True, batch_size=batch_size)
        self.log("train/divergence", loss.detach(), batch_size=batch_size)
        self.log("train/expected_acceptance", acceptance, prog_bar=True, batch_size=batch_size)
        self.log("train/on_policy_fraction", float(source == "drafter"), batch_size=batch_size)
        self.log("train/continuation_tokens", float(mask.sum()), batch_size=batch_size, reduce_fx="sum")
        return total

    def ground_truth_ce(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-token cross-entropy of the drafter on the corpus continuation."""
        rollouts = self._fixed(batch)
        labels = rollouts.sequences[:, rollouts.prompt_width :]
        mask = rollouts.continuation_mask[:, rollouts.prompt_width :]
        if self.draft_ids is not None:  # over the draft vocabulary: labels outside it do not count
            labels = vocab_index(self.draft_ids.to(labels.device), self.sampler.vocab_size)[labels]
            mask = mask & (labels >= 0)
            logits = self.logits(self.drafting_model(full_logits=False), rollouts)
        else:
            logits = self.logits(self.drafter, rollouts)[..., : self.sampler.vocab_size]
        if not mask.any():  # no label inside the draft vocabulary: a zero still attached to the graph
            return logits.sum() * 0.0
        return torch.nn.functional.cross_entropy(logits[mask].float(), labels[mask])

    # ---------------------------------------------------------------- validation

    def on_validation_epoch_start(self) -> None:
        self._val_sums = dict.fromkeys(
            ("loss", "acceptance", "tokens", "greedy_agreement", "greedy_tokens"), 0.0
        )

    def _held_out(
        self, cache: dict[int, Rollout], sampler: RolloutSampler, batch: dict[str, torch.Tensor], index: int
    ) -> Rollout:
        """The verifier's continuations of validation batch ``index`` under ``sampler``: generated once per
        run (seeded), reused by every validation."""
        if index not in cache:
            held_out = sampler.sample(
                self.verifier,
                batch["input_ids"],
                batch["attention_mask"],
                self._generator(-1, index, self.global_rank),
                keep_scores=True,
            )
            if held_out.scores is not None and not self.verifier_budget.take([held_out.scores]):
                held_out.scores = None  # over the budget: scored again by each validation
            cache[index] = held_out
        return cache[index]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Sampled verifier continuations (``temperature``): loss and expected acceptance; greedy ones:
        the drafter's argmax agreement, T = 0's per-token acceptance in the contexts greedy decoding
        visits."""
        sums = self._val_sums
        loss, d_logits, v_logits, mask = self.distill_loss(
            self._held_out(self._val_cache, self.sampler, batch, batch_idx)
        )
        n = int(mask.sum())
        sums["loss"] += float(loss) * n
        sums["acceptance"] += float(self.acceptance(d_logits, v_logits, mask)) * n
        sums["tokens"] += n
        _, d_logits, v_logits, mask = self.distill_loss(
            self._held_out(self._val_greedy_cache, self.greedy_sampler, batch, batch_idx)
        )
        n = int(mask.sum())
        sums["greedy_agreement"] += float(argmax_agreement(d_logits, v_logits, mask, self.draft_ids)) * n
        sums["greedy_tokens"] += n

    def on_validation_epoch_end(self) -> None:
        sums = self._val_sums
        if not sums["tokens"]:
            return
        acceptance = min(max(sums["acceptance"] / sums["tokens"], 0.0), 1.0)
        self.log("val/loss", sums["loss"] / sums["tokens"], prog_bar=True, sync_dist=True)
        self.log("val/expected_acceptance", acceptance, prog_bar=True, sync_dist=True)
        self.log(
            "val/simulated_block_efficiency",
            simulated_block_efficiency(acceptance, self.cfg.gamma),
            sync_dist=True,
        )
        if sums["greedy_tokens"]:
            agreement = sums["greedy_agreement"] / sums["greedy_tokens"]
            self.log("val/greedy_agreement", agreement, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.validation_history.append(self._validation_entry(sums))

    def _validation_entry(self, sums: dict[str, float]) -> dict[str, float]:
        """This validation's metrics, token-weighted over every rank (a collective: all ranks call it)."""
        keys = ("loss", "acceptance", "tokens", "greedy_agreement", "greedy_tokens")
        local = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        total = dict(zip(keys, self.trainer.strategy.reduce(local, reduce_op="sum").tolist(), strict=True))
        entry = {
            "step": float(self.global_step),
            "expected_acceptance": min(max(total["acceptance"] / total["tokens"], 0.0), 1.0),
            "loss": total["loss"] / total["tokens"],
        }
        if total["greedy_tokens"]:
            entry["greedy_agreement"] = total["greedy_agreement"] / total["greedy_tokens"]
        return entry

    @property
    def validate_before_fit(self) -> bool:
        """Whether the train command validates the starting drafter before fitting (``validate_before``)."""
        return bool(self.cfg.validate_before)
