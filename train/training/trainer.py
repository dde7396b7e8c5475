"""Building the Lightning trainer, its loggers and callbacks from the validated config."""

from __future__ import annotations

import glob
import logging
import os
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig
from torch.distributed.fsdp import MixedPrecision

from train.config import ConfigError, LoggerConfig, TrainerConfig, renamed_targets
from train.progress import StepProgressBar

log = logging.getLogger(__name__)


def build_loggers(
    cfg: LoggerConfig, run_dir: str, name: str, config: dict[str, Any] | None = None
) -> list[Logger]:
    """CSV logs under ``run_dir/csv``; W&B (offline by default) under ``run_dir/wandb``.

    Tracking never stops training: when an online W&B run cannot start within ``cfg.init_timeout``
    (no network, service down, bad key), the run logs offline and says how to upload it later.
    """
    loggers: list[Logger] = []
    if cfg.csv:
        loggers.append(CSVLogger(save_dir=run_dir, name="csv", version=""))
    if cfg.wandb:
        os.makedirs(run_dir, exist_ok=True)
        offline = cfg.wandb_offline()
        wandb_logger = _wandb_logger(cfg, run_dir, name, offline)
        if not offline:
            try:
                wandb_logger.experiment  # noqa: B018 -- start the run now, where a failure can be caught
            except Exception as err:  # wandb raises CommError, UsageError, timeouts, ...
                wandb_logger = _wandb_logger(cfg, run_dir, name, offline=True)
                log.warning(
                    "W&B could not start online (%s: %s); logging offline instead. Upload later with: "
                    "wandb sync %s",
                    type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "",
                    os.path.join(run_dir, "wandb", "offline-run-*"),
                )
        if config is not None:
            wandb_logger.log_hyperparams(config)
        loggers.append(wandb_logger)
    return loggers


WANDB_ID_FILE = os.path.join("wandb", "run_id")
"""Where a run directory keeps its W&B run id, so that every start of it logs to the same W&B run."""

_WANDB_ID_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"


def wandb_run_id(run_dir: str, write: bool = True) -> str:
    """The W&B run id of ``run_dir``: the one its ``wandb/run_id`` holds, else a new one (8 base-36
    characters, as wandb makes them), written there when ``write`` (rank 0; another rank never starts a
    W&B run). A requeued SLURM job starts again in the same run directory and so continues the same W&B
    run (``resume="allow"``) instead of opening a new one."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            known = f.read().strip()
        if known:
            return known
    run_id = "".join(secrets.choice(_WANDB_ID_CHARS) for _ in range(8))
    if write:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            f.write(run_id + "\n")
        os.replace(partial, path)  # a reader sees no id or the whole id
    return run_id


def _wandb_logger(cfg: LoggerConfig, run_dir: str, name: str, offline: bool) -> WandbLogger:
    import wandb

    logger = WandbLogger(
        project=cfg.project,
        entity=cfg.entity,
        name=f"{name}-{os.path.basename(os.path.normpath(run_dir))}",
        # every start of this run directory (a requeued SLURM job) continues the same W&B run
        id=wandb_run_id(run_dir, write=getattr(rank_zero_only, "rank", 0) == 0),
        resume="allow",
        save_dir=run_dir,
        offline=offline,
        tags=list(cfg.tags),
        # silent: no run history / summary block in the terminal (it is in the run's W&B files)
        settings=wandb.Settings(init_timeout=cfg.init_timeout, silent=True),
    )
    # Lightning passes anonymous=None, which wandb now answers with a deprecation warning on every run.
    logger._wandb_init.pop("anonymous", None)
    return logger


def fsdp_mixed_precision(
    param_dtype: str = "bfloat16", reduce_dtype: str = "float32", buffer_dtype: str = "float32"
) -> MixedPrecision:
    """FSDP's mixed-precision policy for ``trainer=fsdp`` (conf/trainer/fsdp.yaml): computation in
    ``param_dtype``, gradients reduced and buffers kept in float32 by default.

    Lightning's ``bf16-mixed`` alone gives FSDP bfloat16 for all three, which rounds every rotary
    ``inv_freq`` buffer (:mod:`train.models.rotary`) and sums the ranks' gradients in bfloat16."""
    dtypes = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16")}
    for key, value in (
        ("param_dtype", param_dtype),
        ("reduce_dtype", reduce_dtype),
        ("buffer_dtype", buffer_dtype),
    ):
        if value not in dtypes:
            raise ConfigError(
                f"trainer.strategy.mixed_precision.{key} must be one of {tuple(dtypes)}, got {value!r}"
            )
    return MixedPrecision(
        param_dtype=dtypes[param_dtype], reduce_dtype=dtypes[reduce_dtype], buffer_dtype=dtypes[buffer_dtype]
    )


def check_fsdp_dtypes(module: torch.nn.Module, cfg: TrainerConfig) -> None:
    """A ConfigError, before training starts, when FSDP would refuse ``module``: Lightning's FSDP strategy
    (FSDP1) wraps the whole module as one unit and flattens it into one tensor of one dtype, so frozen
    bfloat16 weights beside float32 trainables (LoRA on a bfloat16 drafter, SD^2 with
    ``train_drafter=false``, Medusa-2's verifier) fail deep inside ``fit`` with ``Must flatten tensors
    with uniform dtype``. Nothing to check for another strategy."""
    strategy = cfg.strategy
    fsdp = isinstance(strategy, FSDPStrategy) or (isinstance(strategy, str) and strategy.startswith("fsdp"))
    if not fsdp:
        return
    by_dtype: dict[str, list[str]] = {}
    for name, param in module.named_parameters():
        by_dtype.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    if len(by_dtype) <= 1:
        return
    held = "; ".join(
        f"{dtype}: {len(names)} tensors, e.g. {names[0]}" for dtype, names in sorted(by_dtype.items())
    )
    raise ConfigError(
        f"trainer=fsdp: the module to train holds parameters of several dtypes ({held}), and FSDP as "
        "Lightning runs it flattens the module into one tensor of one dtype. Load the pair in float32 "
        "(model.dtype=float32: FSDP shards float32 weights and still computes in bfloat16 under "
        "bf16-mixed; the exports are float32), or train under trainer=ddp (docs/scale.md)"
    )


def build_callbacks(cfg: DictConfig | dict | None) -> list[L.Callback]:
    """Instantiate every ``_target_`` under the ``callbacks`` group; a callback that cannot be built is a
    :class:`ConfigError` naming its key."""
    if not cfg:
        return []
    callbacks = []
    for name, node in cfg.items():
        if node is None or "_target_" not in node:
            continue
        try:
            callbacks.append(instantiate(renamed_targets(node)))
        except Exception as err:  # hydra wraps the cause; the key is what the user can fix
            raise ConfigError(f"callbacks.{name!s}: {err.__cause__ or err}") from None
    return callbacks


def build_trainer(
    cfg: TrainerConfig, callbacks: list[L.Callback], loggers: list[Logger], run_dir: str, **overrides: Any
) -> L.Trainer:
    kwargs = cfg.trainer_kwargs() | overrides
    if not loggers:  # nothing to report learning rates to
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    if not kwargs["enable_progress_bar"]:  # Lightning refuses a progress-bar callback when bars are off
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    elif not any(isinstance(cb, ProgressBar) for cb in callbacks):  # not Lightning's "Epoch 0/-2" default
        callbacks = [*callbacks, StepProgressBar()]
    return L.Trainer(
        default_root_dir=run_dir,
        callbacks=callbacks,
        logger=loggers if loggers else False,
        **kwargs,
    )


def resolve_ckpt_path(ckpt_path: str | None, experiment_dir: str, run_dir: str) -> str | None:
    """Turn ``ckpt_path`` into a checkpoint file.

    ``last`` is the newest ``checkpoints/last.ckpt`` among this experiment's earlier run directories;
    a run directory means its ``checkpoints/last.ckpt``; a file is used as it is.
    """
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        here = os.path.abspath(run_dir)
        found = [
            p
            for p in glob.glob(
                os.path.join(experiment_dir, "**", "checkpoints", "last*.ckpt"), recursive=True
            )
            if not os.path.abspath(p).startswith(here + os.sep)
        ]
        if not found:
            raise FileNotFoundError(f"ckpt_path=last: no checkpoints/last.ckpt under {experiment_dir}")
        return max(found, key=os.path.getmtime)
    if os.path.isdir(ckpt_path):
        candidate = os.path.join(ckpt_path, "checkpoints", "last.ckpt")
        if not os.path.isfile(candidate):
            raise FileNotFoundError(f"ckpt_path={ckpt_path}: no checkpoints/last.ckpt in that run directory")
        return candidate
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return ckpt_path


def requeued_checkpoint(run_dir: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where a requeued SLURM job resumes when ``ckpt_path`` is unset: its run directory's own
    ``checkpoints/last.ckpt`` (written at the step the requeue signal came, or periodically), on a start
    with ``SLURM_RESTART_COUNT`` > 0; None on a first start or when that file does not exist."""
    if int(environ.get("SLURM_RESTART_COUNT") or 0) == 0:
        return None
    candidate = os.path.join(run_dir, "checkpoints", "last.ckpt")
    return candidate if os.path.isfile(candidate) else None


def close_loggers(loggers: list[Logger]) -> None:
    """Flush every logger; finish W&B runs so the offline run directory holds its summary."""
    for logger in loggers:
        logger.finalize("success")
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish()


@contextmanager
def full_weights_on_rank_zero(trainer: L.Trainer) -> Iterator[None]:
    """Inside, rank 0's modules hold their full trained weights, for the finish step (export, evaluation).

    Under FSDP each rank holds a shard of every parameter outside forward and backward, so a rank-0
    export would save fragments. Every rank must enter this context (gathering is a collective); the
    weights are gathered on rank 0 only, on its device, read-only (``writeback=False``). Under any other
    strategy it does nothing.
    """
    if not isinstance(trainer.strategy, FSDPStrategy):
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = trainer.strategy.model
    assert wrapped is not None, "the FSDP strategy holds no model: call this after Trainer.fit"
    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False, rank0_only=True):
        yield
