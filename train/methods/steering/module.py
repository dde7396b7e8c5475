"""SD^2: train a steering module (and the drafter) so the verifier's hidden states steer a pretrained
drafter (docs/steering.md; Berdoz, Rheinboldt, Wattenhofer, arXiv 2511.09844).

**Data.** The frozen verifier answers each training prompt once per run at ``temperature`` (T = 1 by
default), in batched rollouts with the engine's sampling (:class:`train.training.answer_cache.AnswerCache`);
the answers travel with the run's checkpoints, so a resumed run trains on the same ones.

**Arms.** One run trains, on the very same batches, steps and loss, every drafter the comparison needs,
each with its own parameters (one verifier forward per batch serves them all):

==========================  ===================================================================
``steered``                 ``method.drafter`` (default: the pair's drafter) + a steering module
``distilled``               the same drafter without steering: the paper's "distilled" baseline
                            (``distilled_baseline``)
``distillspec_steered``     an exported DistillSpec drafter + its own steering module
                            (``distillspec_drafter``: a path, or ``auto`` = the newest
                            ``checkpoints/distillspec`` run of this verifier, skipped when none)
==========================  ===================================================================

The drafters train fully, through LoRA (``lora``) or not at all (``train_drafter: false``: the
steering modules alone; no ``distilled`` arm, since nothing of it would train, and the baseline of the
ratios is the untouched drafter, ``pretrained``). The loss is a divergence of
:mod:`train.losses` by name (forward KL by default) between the verifier's and the drafter's
distributions on the answer tokens. Gradients are clipped per arm, so arms never interact.

**Stale guides.** Training steers each drafter position with the guide decoding would give it, by
the same rule (:func:`train.models.steering_module.guide_for`: the latest guide position strictly before
it). Guide positions are the verifier positions that produced each verification's last committed token;
each batch draws one o in 1..gamma (the authors' draw) and simulates verifications that commit o
tokens each (:func:`~train.models.steering_module.simulated_guides`): the first o answer tokens are drafted
unsteered (decoding's first block, before any verification), then staleness runs 1..o in every block.
Validation measures each steered arm at every o and logs ``val/expected_acceptance`` (mean over
staleness 1..gamma) and ``val/simulated_block_efficiency`` (block position i with the acceptance at
staleness i) for the ``steered`` arm, ``val/<arm>/...`` for every arm.

**Finish** (:func:`train.report.finish`): exports ``steering/`` (mixin folder; its config records the
verifier layers, the sizes and the pair it fits) with ``drafter/`` beside it (loads alone as a plain
drafter), ``distilled_drafter/`` and ``distillspec_steered/{drafter,steering}``; then evaluates the
pretrained drafter, every arm (steered ones as :class:`~train.models.steering_module.SteeredDrafter`) and the
DistillSpec drafter as it was, with ratios to ``distilled``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from train.decoding.metrics import positional_block_efficiency
from train.losses import acceptance_from_logits, divergence
from train.methods.steering.config import DISTILLED_ARM, MAIN_ARM, SteeringConfig, log
from train.methods.steering.finish import SteeringFinish
from train.models.lora import apply_lora
from train.models.steering_module import (
    SteeringModule,
    guide_for,
    simulated_guides,
    stale_guide_states,
)
from train.training.answer_cache import CHECKPOINT_ENTRY, AnswerCache, continuation_logits
from train.training.checkpoint_names import renamed_checkpoint
from train.training.optim import (
    clip_gradients,
    configure_optimizers,
    float32_trainables,
    partial_kwarg,
    weights_dtype,
)
from train.training.rollout import Rollout, RolloutSampler, position_ids_from_mask
from train.training.seeding import mix_seed, seeded_generator

#: Checkpoints saved before issue 53 kept the verifier's answers as ``verifier_responses``.
OLD_ENTRIES = {"verifier_responses": CHECKPOINT_ENTRY}


class SteeringTrainingModule(SteeringFinish, L.LightningModule):
    """Every arm's drafter (and steering module) learns the verifier's distributions on its answers.

    ``arms``: {label: (drafter, steering module or None)}; ``references``: {label: loader} of drafters
    evaluated as they are (the pretrained drafter, the DistillSpec drafter)."""

    verifier: torch.nn.Module

    def __init__(
        self,
        verifier: torch.nn.Module,
        arms: dict[str, tuple[torch.nn.Module, SteeringModule | None]],
        tokenizer: Any,
        cfg: SteeringConfig,
        seed: int = 0,
        references: dict[str, Callable[[], torch.nn.Module]] | None = None,
    ) -> None:
        super().__init__()
        if MAIN_ARM not in arms or arms[MAIN_ARM][1] is None:
            raise ValueError(f"arms must include {MAIN_ARM!r} with a steering module")
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = tokenizer
        self.references = dict(references or {})
        self.sources: dict[str, Any] = {}
        object.__setattr__(self, "verifier", verifier)  # frozen, outside checkpoints and the optimizer
        verifier.eval()
        verifier.requires_grad_(False)
        self.drafters = torch.nn.ModuleDict()
        self.steering = torch.nn.ModuleDict()
        if not cfg.train_drafter and any(steering is None for _, steering in arms.values()):
            log.info("method.train_drafter=false: unsteered arms have nothing to train and are left out")
            arms = {label: arm for label, arm in arms.items() if arm[1] is not None}
        for label, (drafter, steering) in arms.items():
            if not cfg.train_drafter:
                drafter.requires_grad_(False)  # the steering modules alone train; no drafter moves
            elif cfg.lora.enabled:
                drafter = apply_lora(drafter, cfg.lora)  # adapters train, the base stays frozen
            else:
                drafter.requires_grad_(True)
            self.drafters[label] = drafter
            if steering is not None:
                self.steering[label] = steering
                for other in self.steering.values():  # one verifier forward must serve every module
                    if other.verifier_layers != steering.verifier_layers:
                        raise ValueError("every steering module must read the same verifier layers")
        self.export_dtype = weights_dtype(arms[MAIN_ARM][0])  # model.dtype, read before the upcast
        float32_trainables(self.drafters)  # float32 master weights for all that trains (docs/scale.md)
        float32_trainables(self.steering)
        self.layers = list(self.steering_of(MAIN_ARM).verifier_layers)
        self.sampler = RolloutSampler.for_models(
            tokenizer, cfg.max_new_tokens, cfg.temperature, verifier, *self.drafters.values()
        )
        self.answers = AnswerCache(self._generate, self.sampler.pad_token_id)
        self._val_cache: dict[int, Rollout] = {}
        self._val_sums: dict[tuple[str, int], list[float]] = {}
        self._val_stale: dict[
            tuple[str, int], list[float]
        ] = {}  # (arm, staleness) -> [sum of acceptance, count]
        self.last_validation: dict[str, float] = {}
        # ratios are taken against the paper's baseline when it trains, else against the untouched drafter
        self.reference_drafter: str | None = DISTILLED_ARM if DISTILLED_ARM in self.drafters else "pretrained"

    # ---------------------------------------------------------------- plumbing

    def setup(self, stage: str) -> None:
        self.verifier.to(self.device)

    def on_fit_start(self) -> None:
        self.verifier.to(self.device)
        self.drafters.train()
        self.steering.train()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_ENTRY] = self.answers.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.answers.load(renamed_checkpoint(checkpoint, entries=OLD_ENTRIES).get(CHECKPOINT_ENTRY))

    def configure_optimizers(self) -> Any:
        lr = partial_kwarg(self.cfg.optimizer, "lr") or 1e-3
        groups = [
            {"params": [p for p in self.drafters.parameters() if p.requires_grad], "lr": lr},
            {
                "params": [p for p in self.steering.parameters() if p.requires_grad],
                "lr": lr * self.cfg.steering_lr_multiplier,
            },
        ]
        return configure_optimizers(
            [g for g in groups if g["params"]], self.cfg.optimizer, self.cfg.scheduler, self
        )

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip each arm by its own norm (drafter and steering module together): a global norm over all
        arms would couple their updates. Under FSDP each arm's norm is summed over the shards."""
        groups = []
        for label, drafter in self.drafters.items():
            params = list(drafter.parameters())
            if label in self.steering:
                params += self.steering[label].parameters()
            groups.append(params)
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm, groups)

    def _generator(self, *salt: int) -> torch.Generator:
        """Seeded by (run seed, salt): reproducible on resume, distinct per rank."""
        return seeded_generator(self.device, self.seed, *salt)

    def _generate(self, ids: torch.Tensor, attn: torch.Tensor, gen: torch.Generator) -> Rollout:
        return self.sampler.sample(self.verifier, ids, attn, gen)

    def offset_for(self, step: int) -> int:
        """The guide staleness o in 1..gamma of a training step (reproducible on resume)."""
        return random.Random(mix_seed(self.seed, step, -3)).randint(1, self.cfg.gamma)

    # ---------------------------------------------------------------- loss

    @torch.no_grad()
    def verifier_view(self, rollouts: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The verifier's logits on the answer positions (B, N, V) and its states entering the guide's
        layers at every position (B, T, S, d), from one forward."""
        out = self.verifier(
            input_ids=rollouts.sequences,
            attention_mask=rollouts.attention_mask,
            position_ids=position_ids_from_mask(rollouts.attention_mask),
            logits_to_keep=rollouts.sequences.shape[1] - rollouts.prompt_width + 1,
            output_hidden_states=True,
            use_cache=False,
        )
        states = torch.stack([out.hidden_states[i] for i in self.layers], dim=2)
        return out.logits[:, :-1], states

    def arm_logits(self, label: str, rollouts: Rollout, states: torch.Tensor, offset: int) -> torch.Tensor:
        """The arm's drafter logits on the answer positions, steered with guides ``offset`` stale."""
        drafter = self.drafters[label]
        if label not in self.steering:
            return continuation_logits(drafter, rollouts)
        steering = self.steering_of(label)
        guides, has_guide = stale_guide_states(
            states, simulated_guides(rollouts.prompt_width, offset, states.shape[1])
        )
        deltas = steering(guides.to(steering.norm.weight.dtype))
        deltas = deltas * has_guide[..., None, None].to(deltas.dtype)
        with steering.attach(drafter) as handle:
            handle.set(deltas)
            return continuation_logits(drafter, rollouts)

    def staleness(self, rollouts: Rollout, offset: int) -> torch.Tensor:
        """(N,) how stale the guide of each answer logit is in :meth:`arm_logits` (t - guide of its
        drafter position t; 0: no guide, the first block)."""
        width, length = rollouts.prompt_width, rollouts.sequences.shape[1]
        guides = simulated_guides(width, offset, length)
        sources = {t: guide_for(t, guides) for t in range(width - 1, length - 1)}
        return torch.tensor(
            [t - g if g >= 0 else 0 for t, g in sources.items()], device=rollouts.sequences.device
        )

    def _divergence(
        self, logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return divergence(
            self.cfg.divergence,
            logits,
            verifier_logits,
            mask,
            temperature=self.cfg.temperature,
            beta=self.cfg.beta,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.global_step
        rollouts = self.answers(
            batch["input_ids"], batch["attention_mask"], self._generator(step, self.global_rank)
        )
        mask = rollouts.continuation_mask[:, rollouts.prompt_width :]
        verifier_logits, states = self.verifier_view(rollouts)
        offset = self.offset_for(step)
        batch_size = batch["input_ids"].shape[0]
        total = torch.zeros((), device=self.device)
        for label in self.drafters:
            logits = self.arm_logits(label, rollouts, states, offset)
            loss = self._divergence(logits, verifier_logits, mask)
            total = total + loss
            acceptance = acceptance_from_logits(
                logits.detach(), verifier_logits, mask, temperature=self.cfg.temperature
            )
            prefix = "train" if label == MAIN_ARM else f"train/{label}"
            self.log(f"{prefix}/divergence", loss.detach(), batch_size=batch_size)
            self.log(
                f"{prefix}/expected_acceptance", acceptance, prog_bar=label == MAIN_ARM, batch_size=batch_size
            )
        self.log("train/loss", total, prog_bar=True, batch_size=batch_size)
        self.log("train/guide_offset", float(offset), batch_size=batch_size)
        self.log("train/answer_tokens", float(mask.sum()), batch_size=batch_size, reduce_fx="sum")
        return total

    # ---------------------------------------------------------------- validation

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}
        self._val_stale = {}

    @torch.no_grad()
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if batch_idx not in self._val_cache:  # held-out verifier answers: generated once per run
            self._val_cache[batch_idx] = self._generate(
                batch["input_ids"], batch["attention_mask"], self._generator(-1, batch_idx, self.global_rank)
            )
        rollouts = self._val_cache[batch_idx]
        mask = rollouts.continuation_mask[:, rollouts.prompt_width :]
        n = float(mask.sum())
        verifier_logits, states = self.verifier_view(rollouts)
        for label in self.drafters:
            steered = label in self.steering
            for o in range(1, self.cfg.gamma + 1) if steered else (0,):
                logits = self.arm_logits(label, rollouts, states, max(o, 1))
                acceptance = float(
                    acceptance_from_logits(logits, verifier_logits, mask, temperature=self.cfg.temperature)
                )
                loss = float(self._divergence(logits, verifier_logits, mask))
                sums = self._val_sums.setdefault((label, o), [0.0, 0.0, 0.0])
                sums[0] += loss * n
                sums[1] += acceptance * n
                sums[2] += n
                if not steered:
                    continue
                stale = self.staleness(rollouts, o)
                for s in range(1, o + 1):  # acceptance by staleness: draft i of a block has staleness i
                    selected = mask & (stale == s)
                    count = float(selected.sum())
                    if count:
                        a = float(
                            acceptance_from_logits(
                                logits, verifier_logits, selected, temperature=self.cfg.temperature
                            )
                        )
                        by_staleness = self._val_stale.setdefault((label, s), [0.0, 0.0])
                        by_staleness[0] += a * count
                        by_staleness[1] += count

    def on_validation_epoch_end(self) -> None:
        metrics: dict[str, float] = {}
        for label in self.drafters:
            per_offset = {o: s for (arm, o), s in self._val_sums.items() if arm == label and s[2] > 0}
            if not per_offset:
                continue
            overall = sum(s[1] for s in per_offset.values()) / sum(s[2] for s in per_offset.values())
            # block position i is drafted with staleness i; unsteered: the same at every position
            stale = [self._val_stale.get((label, i), [0.0, 0.0]) for i in range(1, self.cfg.gamma + 1)]
            acceptance = [min(max(a / k if k > 0 else overall, 0.0), 1.0) for a, k in stale]
            prefix = "val" if label == MAIN_ARM else f"val/{label}"
            metrics[f"{prefix}/loss"] = sum(s[0] / s[2] for s in per_offset.values()) / len(per_offset)
            metrics[f"{prefix}/expected_acceptance"] = sum(acceptance) / len(acceptance)
            metrics[f"{prefix}/simulated_block_efficiency"] = positional_block_efficiency(acceptance)
        for key, value in metrics.items():
            self.log(key, value, prog_bar=key in ("val/loss", "val/expected_acceptance"), sync_dist=True)
        self.last_validation = metrics
