"""DistillSpec / GKD: distil the drafter (student) towards the frozen verifier (teacher).

ALGORITHMS.md section 2 (Zhou et al. 2023, arXiv 2310.08461; Agarwal et al. 2023, arXiv 2306.13649).
Each training step draws a batch of prompts, picks where its continuations come from, and minimises
the mean per-token divergence D(p || q_theta) over the continuation tokens only:

``data_source`` (``G`` in the paper) -- which continuations a batch trains on:

==================  ===========================================================================
``fixed``           the ground-truth continuations of the corpus (no generation)
``teacher``         sampled from the verifier (cached: one per prompt per run, see below)
``student``         sampled from the current drafter: on-policy, every batch
``mixed_fixed``     on-policy with probability ``lmbda``, otherwise ``fixed``
``mixed_teacher``   on-policy with probability ``lmbda``, otherwise ``teacher``
==================  ===========================================================================

``lmbda`` only matters for the two ``mixed_*`` sources (``student`` is lmbda = 1, ``fixed`` and
``teacher`` are lmbda = 0). Rollouts use :func:`train.decoding.rollout.rollout` -- the evaluator's
``warp``/``sample`` with a KV cache, batched with left padding -- under ``torch.no_grad``.
Teacher continuations depend only on the prompt, so they are generated once per prompt and run and
cached in memory (``cache_teacher``): later epochs reuse them, which makes teacher batches cost one
teacher + one student forward instead of a full generation.

The verifier is held outside the module's registered children, so it is never written to Lightning
checkpoints and never receives an optimizer; it is reloaded from its source on resume.
``finish`` exports the distilled drafter and compares it with the pretrained one in the evaluator.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch

from train.config import require
from train.decoding.metrics import simulated_block_efficiency
from train.decoding.rollout import Rollout, position_ids_from_mask, rollout
from train.decoding.sampling import SamplingParams
from train.losses import DIVERGENCES, divergence, expected_acceptance
from train.methods.pretrain import check_optimizer, configure_optimizers

log = logging.getLogger(__name__)

DATA_SOURCES: tuple[str, ...] = ("fixed", "teacher", "student", "mixed_fixed", "mixed_teacher")


@dataclass
class LoraSettings:
    """peft LoRA on the drafter (``method.lora.*``); ``enabled: false`` is a full fine-tune."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self) -> None:
        require(isinstance(self.r, int) and self.r >= 1, "method.lora.r", "an integer >= 1", self.r)
        require(self.alpha > 0, "method.lora.alpha", "> 0", self.alpha)
        require(0.0 <= self.dropout < 1.0, "method.lora.dropout", "in [0, 1)", self.dropout)
        require(
            bool(self.target_modules), "method.lora.target_modules", "a non-empty list", self.target_modules
        )


@dataclass
class EvalSettings:
    """The finish step's before/after comparison (``method.eval.*``)."""

    enabled: bool = True
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    gamma: int = 4
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    num_prompts: int = 8
    prompt_len: int = 64
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        require(
            bool(self.temperatures) and all(t >= 0 for t in self.temperatures),
            "method.eval.temperatures",
            "a non-empty list of values >= 0",
            self.temperatures,
        )
        require(self.gamma >= 1, "method.eval.gamma", ">= 1", self.gamma)
        require(len(self.seeds) >= 1, "method.eval.seeds", "a non-empty list", self.seeds)
        require(self.num_prompts >= 1, "method.eval.num_prompts", ">= 1", self.num_prompts)
        require(self.prompt_len >= 2, "method.eval.prompt_len", ">= 2", self.prompt_len)
        require(self.max_new_tokens >= 1, "method.eval.max_new_tokens", ">= 1", self.max_new_tokens)


@dataclass
class DistillSpecConfig:
    """Hyperparameters of DistillSpec (``method=distillspec``); validated before any model loads."""

    optimizer: Any
    scheduler: Any = None
    divergence: str = "fkl"
    """One of ``fkl``, ``rkl``, ``jsd``, ``tvd`` (:func:`train.losses.divergence`)."""
    beta: float = 0.5
    """JSD interpolation in [0, 1]; 0 is FKL, 1 is RKL (GKD's convention)."""
    lmbda: float = 0.5
    """Probability of an on-policy batch for the ``mixed_*`` data sources."""
    data_source: str = "teacher"
    """Where continuations come from: see the module docstring."""
    temperature: float = 1.0
    """Sampling temperature of rollouts, also the softmax temperature of the loss; > 0."""
    max_new_tokens: int = 32
    prompt_len: int = 64
    batch_size: int = 16
    num_prompts: int = 1024
    """Training prompts cut from the corpus's train split."""
    num_val_prompts: int = 32
    """Held-out prompts (validation split) whose teacher continuations are generated once per run."""
    ce_weight: float = 0.0
    """Weight of an extra cross-entropy on the ground-truth continuation (0 = off)."""
    gamma: int = 4
    """Draft length for ``val/simulated_block_efficiency``."""
    cache_teacher: bool = True
    """Generate each training prompt's teacher continuation once and reuse it in later epochs."""
    lora: Any = None
    eval: Any = None

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(self.divergence in DIVERGENCES, "method.divergence", f"one of {DIVERGENCES}", self.divergence)
        require(_in_unit(self.beta), "method.beta", "in [0, 1]", self.beta)
        require(_in_unit(self.lmbda), "method.lmbda", "in [0, 1]", self.lmbda)
        require(
            self.data_source in DATA_SOURCES, "method.data_source", f"one of {DATA_SOURCES}", self.data_source
        )
        require(
            isinstance(self.temperature, int | float)
            and math.isfinite(self.temperature)
            and self.temperature > 0,
            "method.temperature",
            "> 0 (rollouts sample; greedy rollouts are not supported)",
            self.temperature,
        )
        require(self.max_new_tokens >= 1, "method.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.prompt_len >= 2, "method.prompt_len", ">= 2", self.prompt_len)
        require(self.batch_size >= 1, "method.batch_size", ">= 1", self.batch_size)
        require(
            self.num_prompts >= self.batch_size,
            "method.num_prompts",
            f">= method.batch_size ({self.batch_size})",
            self.num_prompts,
        )
        require(self.num_val_prompts >= 1, "method.num_val_prompts", ">= 1", self.num_val_prompts)
        require(self.ce_weight >= 0, "method.ce_weight", ">= 0", self.ce_weight)
        require(self.gamma >= 1, "method.gamma", ">= 1", self.gamma)
        self.lora = _settings(LoraSettings, self.lora, "method.lora")
        self.eval = _settings(EvalSettings, self.eval, "method.eval")

    @property
    def on_policy_probability(self) -> float:
        """lambda as the data source implies it."""
        return {"student": 1.0, "fixed": 0.0, "teacher": 0.0}.get(self.data_source, self.lmbda)

    @property
    def off_policy_source(self) -> str:
        """What a batch that is not on-policy trains on: ``fixed`` or ``teacher``."""
        return "fixed" if self.data_source in ("fixed", "mixed_fixed") else "teacher"

    def build(self, pair: Any, spec: Any) -> tuple[DistillSpecModule, L.LightningDataModule]:
        """Student = the pair's drafter (LoRA-wrapped if asked), teacher = the frozen verifier."""
        from train.data.datamodule import PromptDataModule
        from train.data.sources import load_text_dataset

        data = PromptDataModule(
            lambda: load_text_dataset(spec.data, pair.tokenizer),
            pair.tokenizer,
            prompt_len=self.prompt_len,
            batch_size=self.batch_size,
            continuation_len=self.max_new_tokens,
            max_prompts=self.num_prompts,
            max_val_prompts=self.num_val_prompts,
            seed=spec.seed,
        )
        module = DistillSpecModule(pair.drafter, pair.verifier, pair.tokenizer, self, seed=spec.seed)
        return module, data


def _in_unit(x: Any) -> bool:
    return isinstance(x, int | float) and 0.0 <= x <= 1.0


def _settings(cls: Any, value: Any, key: str) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    require(isinstance(value, dict), key, "a mapping", value)
    unknown = sorted(set(value) - set(cls.__dataclass_fields__) - {"_target_"})
    require(not unknown, key, f"keys among {sorted(cls.__dataclass_fields__)}", unknown)
    return cls(**{k: v for k, v in value.items() if k != "_target_"})


def apply_lora(model: torch.nn.Module, cfg: LoraSettings) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters (only they train)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


class DistillSpecModule(L.LightningModule):
    """The drafter learns the verifier's next-token distributions on continuation tokens."""

    teacher: torch.nn.Module

    def __init__(
        self,
        student: torch.nn.Module,
        teacher: torch.nn.Module,
        tokenizer: Any,
        cfg: DistillSpecConfig,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.student = apply_lora(student, cfg.lora) if cfg.lora.enabled else student
        # Not a registered child: the frozen verifier stays out of state_dict, checkpoints and the optimizer.
        object.__setattr__(self, "teacher", teacher)
        teacher.eval()
        teacher.requires_grad_(False)
        self.tokenizer = tokenizer
        self.params = SamplingParams(temperature=float(cfg.temperature))
        self.eos_token_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)
        self.vocab_size = min(_vocab(student), _vocab(teacher))
        self._teacher_cache: dict[bytes, torch.Tensor] = {}
        self._val_cache: dict[int, Rollout] = {}
        self._val_sums = [0.0, 0.0, 0]
        self.last_num_tokens = 0

    # ---------------------------------------------------------------- plumbing

    def setup(self, stage: str) -> None:
        self.teacher.to(self.device)

    def on_fit_start(self) -> None:
        self.teacher.to(self.device)
        self.student.train()  # from_pretrained returns eval mode; the teacher stays in eval mode

    def configure_optimizers(self) -> Any:
        params = [p for p in self.student.parameters() if p.requires_grad]
        return configure_optimizers(self, params, self.cfg.optimizer, self.cfg.scheduler)

    def _generator(self, *salt: int) -> torch.Generator:
        """Seeded by (run seed, salt): a resumed run draws the same rollouts the killed one would have."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_mix(self.seed, *salt))
        return gen

    # ---------------------------------------------------------------- data

    def _fixed(self, batch: dict[str, torch.Tensor]) -> Rollout:
        """Prompt + ground-truth continuation, in the same layout a rollout has."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        cont, cmask = batch["continuation_ids"], batch["continuation_mask"]
        width = ids.shape[1]
        full_mask = torch.cat([attn, cmask], dim=1)
        cont_mask = full_mask.bool().clone()
        cont_mask[:, :width] = False
        return Rollout(torch.cat([ids, cont], dim=1), full_mask, cont_mask, width)

    def _generate(
        self, model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, gen: torch.Generator
    ) -> Rollout:
        return rollout(
            model,
            ids,
            attn,
            self.cfg.max_new_tokens,
            self.params,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=gen,
            vocab_size=self.vocab_size,
        )

    def _teacher_rollout(self, batch: dict[str, torch.Tensor], gen: torch.Generator) -> Rollout:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        if not self.cfg.cache_teacher:
            return self._generate(self.teacher, ids, attn, gen)
        keys = [ids[i][attn[i].bool()].cpu().numpy().tobytes() for i in range(ids.shape[0])]
        missing = [i for i, k in enumerate(keys) if k not in self._teacher_cache]
        if missing:
            sub = self._generate(self.teacher, ids[missing], attn[missing], gen)
            for row, i in enumerate(missing):
                self._teacher_cache[keys[i]] = sub.sequences[row, sub.prompt_width :][
                    sub.continuation_mask[row, sub.prompt_width :]
                ].cpu()
        conts = [self._teacher_cache[k] for k in keys]
        n = max(len(c) for c in conts)
        cont = torch.full((ids.shape[0], n), self.pad_token_id, dtype=ids.dtype, device=ids.device)
        cmask = torch.zeros_like(cont)
        for i, c in enumerate(conts):
            cont[i, : len(c)] = c.to(ids.device)
            cmask[i, : len(c)] = 1
        return self._fixed(
            {"input_ids": ids, "attention_mask": attn, "continuation_ids": cont, "continuation_mask": cmask}
        )

    def make_batch(self, batch: dict[str, torch.Tensor], source: str, gen: torch.Generator) -> Rollout:
        """The training sequences for ``source`` in {fixed, teacher, student}."""
        if source == "fixed":
            return self._fixed(batch)
        if source == "teacher":
            return self._teacher_rollout(batch, gen)
        return self._generate(self.student, batch["input_ids"], batch["attention_mask"], gen)

    def pick_source(self, step: int) -> str:
        """On-policy with probability lambda, drawn from a per-step seed (reproducible on resume)."""
        lam = self.cfg.on_policy_probability
        if lam >= 1.0:
            return "student"
        if lam > 0.0 and random.Random(_mix(self.seed, step, -2)).random() < lam:
            return "student"
        return self.cfg.off_policy_source

    # ---------------------------------------------------------------- loss

    def logits(self, model: torch.nn.Module, ro: Rollout) -> torch.Tensor:
        """(B, N, V) logits predicting the continuation positions (the prompt's logits are never built)."""
        n = ro.sequences.shape[1] - ro.prompt_width
        out = model(
            input_ids=ro.sequences,
            attention_mask=ro.attention_mask,
            position_ids=position_ids_from_mask(ro.attention_mask),
            logits_to_keep=n + 1,
            use_cache=False,
        )
        return out.logits[:, :-1]

    def distill_loss(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, student logits, teacher logits, mask) on the continuation tokens of ``ro``."""
        mask = ro.continuation_mask[:, ro.prompt_width :]
        with torch.no_grad():
            teacher_logits = self.logits(self.teacher, ro)
        student_logits = self.logits(self.student, ro)
        loss = divergence(
            self.cfg.divergence,
            student_logits,
            teacher_logits,
            mask,
            temperature=self.cfg.temperature,
            beta=self.cfg.beta,
        )
        return loss, student_logits, teacher_logits, mask

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.global_step
        source = self.pick_source(step)
        ro = self.make_batch(batch, source, self._generator(step, 0))
        loss, s_logits, t_logits, mask = self.distill_loss(ro)
        self.last_num_tokens = int(mask.sum())
        total = loss
        if self.cfg.ce_weight > 0:
            ce = self.ground_truth_ce(batch)
            total = loss + self.cfg.ce_weight * ce
            self.log("train/ce", ce)
        ea = expected_acceptance(s_logits.detach(), t_logits, mask, temperature=self.cfg.temperature)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", total, prog_bar=True, batch_size=bs)
        self.log("train/divergence", loss.detach(), batch_size=bs)
        self.log("train/expected_acceptance", ea, prog_bar=True, batch_size=bs)
        self.log("train/on_policy_fraction", float(source == "student"), batch_size=bs)
        self.log("train/continuation_tokens", float(mask.sum()), batch_size=bs, reduce_fx="sum")
        return total

    def ground_truth_ce(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-token cross-entropy of the student on the corpus continuation."""
        ro = self._fixed(batch)
        logits = self.logits(self.student, ro)[..., : self.vocab_size]
        labels = ro.sequences[:, ro.prompt_width :]
        mask = ro.continuation_mask[:, ro.prompt_width :]
        return torch.nn.functional.cross_entropy(logits[mask].float(), labels[mask])

    # ---------------------------------------------------------------- validation

    def on_validation_epoch_start(self) -> None:
        self._val_sums = [0.0, 0.0, 0]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if batch_idx not in self._val_cache:  # held-out teacher continuations: generated once per run
            self._val_cache[batch_idx] = self._generate(
                self.teacher, batch["input_ids"], batch["attention_mask"], self._generator(-1, batch_idx)
            )
        loss, s_logits, t_logits, mask = self.distill_loss(self._val_cache[batch_idx])
        n = int(mask.sum())
        ea = expected_acceptance(s_logits, t_logits, mask, temperature=self.cfg.temperature)
        self._val_sums[0] += float(loss) * n
        self._val_sums[1] += float(ea) * n
        self._val_sums[2] += n

    def on_validation_epoch_end(self) -> None:
        loss_sum, ea_sum, n = self._val_sums
        if n == 0:
            return
        ea = min(max(ea_sum / n, 0.0), 1.0)
        self.log("val/loss", loss_sum / n, prog_bar=True, sync_dist=True)
        self.log("val/expected_acceptance", ea, prog_bar=True, sync_dist=True)
        self.log(
            "val/simulated_block_efficiency", simulated_block_efficiency(ea, self.cfg.gamma), sync_dist=True
        )

    # ---------------------------------------------------------------- finish

    def distilled_drafter(self) -> torch.nn.Module:
        """The student as a plain Hugging Face model (LoRA adapters merged into a copy)."""
        if self.cfg.lora.enabled:
            import copy

            peft_model: Any = copy.deepcopy(self.student)
            return peft_model.merge_and_unload()
        return self.student

    def finish(self, trainer: L.Trainer, spec: Any) -> dict[str, Any] | None:
        """Rank 0: export the drafter, evaluate before/after, write report.json / report.md."""
        if not trainer.is_global_zero:
            return None
        return finish_run(self, spec, loggers=trainer.loggers, step=trainer.global_step)


def _mix(*values: int) -> int:
    """A seed from integers, stable across processes (unlike ``hash`` of strings)."""
    seed = 0
    for v in values:
        seed = (seed * 1_000_003 + int(v)) % (2**61 - 1)
    return seed


def _vocab(model: torch.nn.Module) -> int:
    from train.decoding._common import output_vocab_size

    return output_vocab_size(model)


# -------------------------------------------------------------------- reporting

REPORT_METRICS = (
    "block_efficiency",
    "acceptance_rate",
    "expected_acceptance",
    "accepted_per_block",
    "mbsu",
    "speedup",
    "tokens_per_second",
)


def finish_run(module: DistillSpecModule, spec: Any, loggers: Any = None, step: int | None = None
               ) -> dict[str, Any]:
    """Evaluate the pretrained ("before") and distilled ("after") drafters, export, and report."""
    from train.models.loading import load_model

    cfg = module.cfg
    run_dir = spec.run_dir
    after = module.distilled_drafter().eval()
    before = load_model(
        spec.model.drafter, spec.model.dtype, spec.model.attn_implementation, spec.model.trust_remote_code
    ).eval()
    verifier = module.teacher.eval()
    for m in (after, before, verifier):
        m.to("cpu")
    report: dict[str, Any] = {"config": {"method": _method_summary(cfg)}}
    if cfg.eval.enabled:
        metrics = evaluate_before_after(verifier, before, after, module.tokenizer, spec, loggers, step)
        report.update(metrics)
    drafter_dir = os.path.join(run_dir, "drafter")
    _export(after, module.tokenizer, drafter_dir, report, spec)
    report["drafter_dir"] = drafter_dir
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    table = format_table(report)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(f"# DistillSpec: {spec.name}\n\n{table}\n\nDrafter exported to `{drafter_dir}`.\n")
    print(table)
    print(f"run directory: {os.path.abspath(run_dir)}")
    return report


def _method_summary(cfg: DistillSpecConfig) -> dict[str, Any]:
    keys = (
        "divergence",
        "beta",
        "lmbda",
        "data_source",
        "temperature",
        "max_new_tokens",
        "prompt_len",
        "batch_size",
        "num_prompts",
        "ce_weight",
        "gamma",
    )
    out = {k: getattr(cfg, k) for k in keys}
    out["lora"] = asdict(cfg.lora)
    out["eval"] = asdict(cfg.eval)
    return out


def evaluate_before_after(
    verifier: torch.nn.Module,
    before: torch.nn.Module,
    after: torch.nn.Module,
    tokenizer: Any,
    spec: Any,
    loggers: Any = None,
    step: int | None = None,
) -> dict[str, Any]:
    """``{"before": {T: contract}, "after": {T: contract}, "table": markdown}`` from the project's evaluator."""
    from train.evaluation import EvalConfig, build_prompts, by_temperature, evaluate_drafters, results_table

    ev = spec.method.eval
    cfg = EvalConfig(
        temperatures=list(ev.temperatures),
        gammas=[ev.gamma],
        seeds=list(ev.seeds),
        num_prompts=ev.num_prompts,
        prompt_len=ev.prompt_len,
        max_new_tokens=ev.max_new_tokens,
        progress=False,
    )
    prompts = build_prompts(tokenizer, spec.data, ev.num_prompts, ev.prompt_len, seed=spec.seed)
    results = evaluate_drafters(
        verifier,
        {"before": before, "after": after},
        prompts,
        cfg,
        eos_token_id=tokenizer.eos_token_id,
        out_dir=os.path.join(spec.run_dir, "eval"),
        loggers=loggers,
        step=step,
    )
    return {
        "before": by_temperature(results, "before", gamma=ev.gamma),
        "after": by_temperature(results, "after", gamma=ev.gamma),
        "evaluation_table": results_table(results),
        "evaluation_seconds": results.get("elapsed_seconds"),
    }


def _export(model: torch.nn.Module, tokenizer: Any, out_dir: str, report: dict[str, Any], spec: Any) -> None:
    """The drafter as a Hugging Face folder with the evaluation table and training config in its card."""
    from omegaconf import OmegaConf

    config: dict[str, Any] = OmegaConf.to_container(spec.cfg, resolve=True)  # type: ignore[assignment]
    evaluation: dict[str, Any] = {k: report[k] for k in ("before", "after") if k in report}
    from train.export import export_drafter

    export_drafter(model, tokenizer, out_dir, results=evaluation, config=config)


def format_table(report: dict[str, Any]) -> str:
    """Markdown: one row per (temperature, drafter) with mean +- std of the headline metrics."""
    if "before" not in report:
        return "(evaluation disabled)"
    lines = [
        "| T | drafter | block_efficiency | acceptance_rate | expected_acceptance | mbsu | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for temp in report["before"]:
        for name in ("before", "after"):
            row = report[name].get(temp, {})
            cells = [
                _fmt(row.get(m))
                for m in ("block_efficiency", "acceptance_rate", "expected_acceptance", "mbsu", "speedup")
            ]
            lines.append(f"| {temp} | {name} | " + " | ".join(cells) + " |")
        b = _mean(report["before"][temp].get("block_efficiency"))
        a = _mean(report["after"].get(temp, {}).get("block_efficiency"))
        if b and a:
            lines.append(f"| {temp} | after / before | {a / b:.3f}x | | | | |")
    return "\n".join(lines)


def _mean(value: Any) -> float | None:
    if isinstance(value, dict):
        value = value.get("mean")
    return float(value) if isinstance(value, int | float) else None


def _fmt(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("mean"), int | float):
        return f"{value['mean']:.3f} ± {value.get('std', 0.0):.3f}"
    if isinstance(value, int | float):
        return f"{value:.3f}"
    return "-"
