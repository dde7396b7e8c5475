"""One training run: validate the config, build the pieces, fit, then the finish step.

``main(cfg)`` is what ``python train.py`` calls. Every config group is instantiated into its typed
dataclass first (:func:`load_spec`), so a bad value fails before any model or data loads. After
``Trainer.fit``, a method module that implements :class:`train.report.Finishable` goes through the
shared finish step on rank 0 (:func:`train.report.finish`: export, evaluation under the run's
``eval`` config, report); a module with its own ``save_trained(trainer, spec)`` (plain pretraining) runs that.

The run directory belongs to one live run (:class:`train.rundir.RunDirLock`, rank 0 only); a run that
fails before it wrote anything worth keeping removes the directory it made. SIGTERM or SIGINT during
fit saves the current step, skips the finish step, prints the command that resumes the run and exits
with 143 or 130 (:class:`train.training.callbacks.GracefulStop`). SLURM's requeue signal takes the same
path, then requeues the job, which starts again in the same run directory from that checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_summary import ModelSummary
from omegaconf import DictConfig, OmegaConf

from train.cli.console import is_rank_zero
from train.config import (
    ConfigError,
    TrainerConfig,
    instantiate_group,
)
from train.evaluation import EvalConfig, build_eval_config
from train.methods.registry import build_method
from train.methods.run_spec import RunSpec
from train.models.loading import load_pair, resolve_device
from train.pairs.built import ensure_built_pair
from train.pairs.tiny import build_tiny_pair, format_report
from train.report import Finishable, RunContext, finish
from train.rundir import RunDirLock, RunDirLocked, remove_if_unused
from train.training.callbacks import GracefulStop, requeue_slurm_job, slurm_job_id
from train.training.trainer import (
    build_callbacks,
    build_loggers,
    build_trainer,
    check_fsdp_dtypes,
    close_loggers,
    full_weights_on_rank_zero,
    requeued_checkpoint,
    resolve_ckpt_path,
)

log = logging.getLogger(__name__)


def load_eval_config(cfg: DictConfig) -> EvalConfig | None:
    """The ``eval`` node as an :class:`~train.evaluation.EvalConfig` (errors name ``eval.<key>``);
    None when the config has no ``eval`` node (the finish step then exports and reports only)."""
    node = cfg.get("eval")
    return build_eval_config(node) if node is not None else None


def finish_devices(cfg: DictConfig) -> tuple[torch.device | None, torch.device | None]:
    """``device`` / ``drafter_device`` of a training config (null: the training device), checked now, so
    ``device=cuda`` on a machine without CUDA fails before any model loads, naming the key."""
    device, drafter = cfg.get("device"), cfg.get("drafter_device")
    return (
        None if device is None else resolve_device(device, "device"),
        None if drafter is None else resolve_device(drafter, "drafter_device"),
    )


def load_spec(cfg: DictConfig) -> RunSpec:
    """Validate every group; the only place a config becomes typed objects."""
    OmegaConf.resolve(cfg)
    for key in ("name", "seed"):
        if cfg.get(key) is None:
            raise ConfigError(f"{key} must be set")
    return RunSpec(
        name=str(cfg.name),
        seed=int(cfg.seed),
        paths=instantiate_group(cfg, "paths"),
        model=instantiate_group(cfg, "model"),
        data=instantiate_group(cfg, "data"),
        method=instantiate_group(cfg, "method"),
        trainer=instantiate_group(cfg, "trainer"),
        logger=instantiate_group(cfg, "logger"),
        callbacks=tuple(build_callbacks(cfg.get("callbacks"))),
        ckpt_path=cfg.get("ckpt_path"),
        cfg=cfg,
        eval=load_eval_config(cfg),
        devices=finish_devices(cfg),
    )


def hydra_task() -> tuple[str | None, list[str] | None]:
    """The run directory Hydra made for this job and the job's command-line overrides (None, None
    when the config was composed without ``@hydra.main``, as tests do)."""
    if not HydraConfig.initialized():
        return None, None
    hydra_cfg = HydraConfig.get()
    return hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task)


def resume_command(checkpoint: str | None) -> str:
    """The command that continues this run: its overrides plus ``ckpt_path=<checkpoint>`` (in a new
    run directory; the interrupted one keeps its logs as they are)."""
    _, overrides = hydra_task()
    kept = [o for o in overrides or [] if o.lstrip("+~").split("=", 1)[0] != "ckpt_path"]
    if checkpoint:
        kept.append(f"ckpt_path={checkpoint}")
    script = sys.argv[0] if overrides is not None else "train.py"
    return shlex.join(["python", script, *kept])


def write_json(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def build_tiny_pair_run(spec: RunSpec) -> dict[str, Any]:
    """``experiment=tiny_pair``: (re)build the embedded pair, report and log its figures."""
    if spec.model.tiny is None:
        raise ConfigError("build_tiny_pair=true needs model=tiny (model.tiny holds the pair's recipe)")
    manifest = build_tiny_pair(spec.model.tiny, spec.trainer, log_dir=os.path.join(spec.run_dir, "logs"))
    metrics = {f"val/{k}": v for k, v in manifest["metrics"].items()}
    metrics.update({f"val/{role}_parameters": n for role, n in manifest["parameters"].items()})
    loggers = build_loggers(spec.logger, spec.run_dir, spec.name)
    for logger in loggers:
        logger.log_metrics(metrics, step=0)
    close_loggers(loggers)
    write_json(os.path.join(spec.run_dir, "tiny_pair.json"), manifest)
    print(format_report(manifest))
    return manifest


def main(cfg: DictConfig) -> Any:
    """Run one experiment end to end; returns what the finish step returns (the report)."""
    hydra_dir, _ = hydra_task()
    try:
        spec = load_spec(cfg)
    except Exception:
        if hydra_dir and is_rank_zero() and remove_if_unused(hydra_dir):
            log.info(
                "Removed the run directory %s: the config was rejected before anything was written", hydra_dir
            )
        raise
    made_here = not os.path.isdir(spec.run_dir)
    os.makedirs(spec.run_dir, exist_ok=True)
    # Only rank 0 holds the lock: the other ranks of a DDP run share its directory.
    lock: AbstractContextManager[Any] = RunDirLock(spec.run_dir) if is_rank_zero() else nullcontext()
    try:
        with lock:
            return run(spec, cfg)
    except RunDirLocked:
        raise
    except Exception:
        if is_rank_zero() and remove_if_unused(spec.run_dir, created_by_us=made_here):
            log.info("Removed the run directory %s: the run failed before writing anything", spec.run_dir)
        raise


def plan(spec: RunSpec) -> str:
    """The one line a run prints first: what it trains, for how long, what follows, where it writes."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    method = choices.get("method") or type(spec.method).__name__
    data = choices.get("data") or type(spec.data).__name__
    t = spec.trainer
    devices = f"{t.devices} {t.accelerator} device{'s' if t.devices != 1 else ''}"
    line = f"{spec.name}: {method} on {data} data, {t.max_steps} steps on {devices} (seed {spec.seed})"
    if spec.ckpt_path:
        line += f", resuming from ckpt_path={spec.ckpt_path}"
    ev = spec.eval
    if ev is not None:
        temps = ",".join(f"{x:g}" for x in ev.temperatures)
        line += (
            f"; then export and evaluate (T={temps}, {len(ev.seeds)} seeds, {ev.num_prompts} prompts x "
            f"{ev.max_new_tokens} tokens)"
        )
    return f"{line}\nRun directory: {os.path.abspath(spec.run_dir)} (full log: train.log)"


def run(spec: RunSpec, cfg: DictConfig) -> Any:
    """The run itself, with the run directory held."""
    if is_rank_zero():
        OmegaConf.save(spec.cfg, os.path.join(spec.run_dir, "config.yaml"))
        if not cfg.get("build_tiny_pair"):
            print(plan(spec), flush=True)
    L.seed_everything(spec.seed, workers=True, verbose=False)
    if cfg.get("build_tiny_pair"):
        return build_tiny_pair_run(spec)
    ensure_built_pair(spec.model, spec.trainer)
    return fit(spec)


def fit(spec: RunSpec) -> Any:
    """Build the method's module and data, fit (resuming if asked), then the finish step."""
    ckpt = resolve_ckpt_path(spec.ckpt_path, spec.experiment_dir, spec.run_dir)
    ckpt = ckpt or requeued_checkpoint(spec.run_dir)  # a requeued SLURM job: its own last.ckpt
    if ckpt:
        refuse_finished(ckpt, spec.ckpt_path or ckpt, spec.trainer.max_steps)
        log.info("Resuming from %s", ckpt)
    pair = load_pair(spec.model)
    module, datamodule = build_method(spec.method, pair, spec)
    check_fsdp_dtypes(module, spec.trainer)  # before any data, logger or checkpoint
    # Data problems (an empty file, a missing column) surface here, before loggers and checkpoints
    # make the run directory worth keeping; Lightning's own setup call later finds the data ready.
    datamodule.setup("fit")
    config: dict[str, Any] = OmegaConf.to_container(spec.cfg, resolve=True)  # type: ignore[assignment]
    loggers = build_loggers(spec.logger, spec.run_dir, spec.name, config=config)
    log.info("Model summary:\n%s", ModelSummary(module, max_depth=1))
    stop = GracefulStop(spec.run_dir)
    trainer = build_trainer(spec.trainer, [*spec.callbacks, stop], loggers, spec.run_dir)
    try:
        try:
            if not ckpt and getattr(module, "validate_before_fit", False):
                # the starting model's validation, logged at step 0 (a method's before/after comparison)
                trainer.validate(module, datamodule=datamodule, verbose=False)
                stop_if_signalled(trainer, stop)
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
            history = getattr(module, "validation_history", None)
            if getattr(module, "validate_before_fit", False) and ended_between_validations(
                trainer, spec.trainer, history
            ):
                # the time budget ended training after the last validation: validate where it stopped
                trainer.validate(module, datamodule=datamodule, verbose=False)
        except SIGTERMException:
            if stop.signum is None:
                raise
        if stop.signum is not None:
            stopped(stop, trainer.global_step, trainer.is_global_zero)
        with full_weights_on_rank_zero(trainer):  # every rank enters: FSDP gathers its shards on rank 0
            return finish_run(module, trainer, spec, pair, config)
    finally:
        close_loggers(loggers)
        if stop.requeue and trainer.is_global_zero:
            requeue_slurm_job()  # after the checkpoint and the loggers: SLURM ends this start at once


def stop_if_signalled(trainer: L.Trainer, stop: GracefulStop) -> None:
    """After the validation before training: a SIGTERM that arrived during its last batch or its epoch end
    (where Lightning's evaluation loop no longer raises) would be forgotten by ``fit``, which registers its
    handlers afresh; stop here instead, before any step (a SIGTERM during an earlier batch raised already).
    Every rank stops if any rank was signalled (under DDP the signal may reach one rank only)."""
    if trainer.strategy.reduce_boolean_decision(bool(trainer.received_sigterm), all=False):
        if stop.signum is None:
            stop.signum = int(signal.SIGTERM)
        raise SIGTERMException


def ended_between_validations(
    trainer: L.Trainer, cfg: TrainerConfig, history: list[dict[str, float]] | None = None
) -> bool:
    """Whether ``trainer.max_time`` stopped training before ``max_steps`` at a step no validation of
    ``history`` (a module's ``validation_history``) measured."""
    if cfg.max_time is None or not 0 < trainer.global_step < cfg.max_steps:
        return False
    return not history or int(history[-1]["step"]) != trainer.global_step


def finish_run(module: Any, trainer: L.Trainer, spec: RunSpec, pair: Any, config: dict[str, Any]) -> Any:
    """The end of a completed fit: the shared finish step on rank 0 for a :class:`Finishable` module, else
    the module's own ``save_trained(trainer, spec)`` (plain pretraining), if it has one."""
    if isinstance(module, Finishable):
        if not trainer.is_global_zero:
            return None
        device = spec.devices[0] or trainer.strategy.root_device
        on_training_device(module, pair.verifier, trainer, device)
        context = RunContext(
            spec.run_dir,
            spec.eval,
            data=spec.data,
            seed=spec.seed,
            name=spec.name,
            config=config,
            loggers=trainer.loggers,
            step=trainer.global_step,
            device=device,
            drafter_device=spec.devices[1],
        )
        return finish(module, pair.verifier, pair.tokenizer, context)
    save_trained = getattr(module, "save_trained", None)
    return save_trained(trainer, spec) if save_trained is not None else None


def on_training_device(
    module: Any, verifier: torch.nn.Module, trainer: L.Trainer, device: torch.device | None = None
) -> None:
    """Move the trained module and the verifier back to the device training ran on (or to ``device``, the
    run's ``device=``), for the finish step.

    Lightning's teardown moves the LightningModule to the CPU after fit, so without this a GPU run would
    export and evaluate on the CPU (Medusa-2's LoRA verifier, a child module, included). Under FSDP the
    weights are gathered in place by ``full_weights_on_rank_zero`` and stay where FSDP keeps them (the
    finish step moves the copies it evaluates)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        return
    device = device or trainer.strategy.root_device
    module.to(device)
    verifier.to(device)


class FinishedRunError(ConfigError):
    """``ckpt_path`` points at a run that already reached ``trainer.max_steps``."""


def refuse_finished(ckpt: str, requested: str | None, max_steps: int) -> None:
    """Resuming a checkpoint that already reached ``max_steps`` would train nothing and redo the finish
    step: say so and stop, naming the two ways on (a fresh run, or more steps)."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    step = int(state.get("global_step", 0))
    if step >= max_steps:
        raise FinishedRunError(
            f"ckpt_path={requested}: {ckpt} is at global step {step}, and trainer.max_steps={max_steps}: "
            "that run already finished, there is nothing to resume. Drop ckpt_path to start a fresh run, "
            f"or raise trainer.max_steps above {step} to train it further."
        )


def stopped(stop: GracefulStop, step: int, is_global_zero: bool) -> None:
    """After a signal ended fit: say where the run stands and how to resume it (or, after SLURM's requeue
    signal, that the job is requeued), then exit 128 + signum (143 for SIGTERM, 130 for SIGINT, 138 for
    SIGUSR1) without the finish step."""
    signum = stop.signum
    assert signum is not None
    if is_global_zero:
        name = signal.Signals(signum).name
        saved = f"saved {stop.checkpoint}" if stop.checkpoint else "nothing trained yet, nothing saved"
        if stop.requeue:
            print(
                f"{name} (SLURM's requeue signal) at global step {step}: {saved}; the finish step was "
                f"skipped. Requeueing SLURM job {slurm_job_id()}: it starts again in this run directory and "
                "resumes from its checkpoints/last.ckpt",
                flush=True,
            )
            raise SystemExit(128 + signum)
        print(
            f"{name} at global step {step}: {saved}; the finish step was skipped. Resume with:\n"
            f"  {resume_command(stop.checkpoint)}",
            flush=True,
        )
    raise SystemExit(128 + signum)
