"""Typed, validated run configuration.

Every Hydra group that is not a Lightning object points its ``_target_`` at one of these dataclasses,
so ``hydra.utils.instantiate`` builds it and ``__post_init__`` rejects a bad value before any model
loads. Errors name the config key (``trainer.devices``) and the allowed range.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from train.renames import (  # noqa: F401 (re-exported: the renames were defined here)
    RENAMED_KEYS,
    RENAMED_TARGETS,
    RENAMED_VALUES,
    renamed_keys_of,
    renamed_keywords,
    renamed_settings,
    renamed_targets,
)

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the key."""


def require(condition: bool, key: str, allowed: str, value: Any) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def require_decoder_shape(prefix: str, hidden_size: int, num_heads: int, num_layers: int) -> None:
    """The checks every Llama recipe we build shares (``prefix``: its config key, ``model.tiny.*``):
    heads divide the hidden size, at least one layer."""
    require(hidden_size % num_heads == 0, f"{prefix}.num_heads", "a divisor of hidden_size", num_heads)
    require(num_layers >= 1, f"{prefix}.num_layers", ">= 1", num_layers)


def looks_local(path: str) -> bool:
    """True when ``path`` is meant as a filesystem path rather than a Hub id."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or os.path.exists(path)


def check_model_source(key: str, source: str, may_be_built: bool = False) -> None:
    """Fail early on a local model path that does not exist (unless it will be built)."""
    require(isinstance(source, str) and bool(source), key, "a Hub id or a local path", source)
    if looks_local(source):
        if not may_be_built and not os.path.isdir(os.path.expanduser(source)):
            raise ConfigError(f"{key}: no model folder at {source!r} (not a Hub id either)")
    else:
        require(bool(_HUB_ID.match(source)), key, "a Hub id like 'org/name' or a local path", source)


def is_config_node(value: Any) -> bool:
    """True for a mapping still unbuilt (a node without ``_target_``, or one Hydra did not instantiate)."""
    return isinstance(value, (dict, DictConfig))


STRATEGIES = (
    "auto",
    "ddp",
    "ddp_spawn",
    "ddp_find_unused_parameters_true",
    "fsdp",
    "deepspeed",
    "single_device",
)
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class TrainerConfig:
    """Arguments for ``lightning.Trainer``; see conf/trainer/*.yaml."""

    accelerator: str = "cpu"
    strategy: Any = "auto"
    """A Lightning strategy name (``STRATEGIES``) or a ``_target_`` node Hydra builds into a strategy
    object (``trainer=fsdp``: ``FSDPStrategy`` with float32 buffers and reductions)."""
    devices: Any = 1
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 100
    max_time: str | None = None
    """A wall-clock budget for training, ``"DD:HH:MM:SS"`` (Lightning's ``max_time``): training stops at
    whichever of it and ``max_steps`` comes first; null: no budget."""
    val_check_interval: Any = 50
    limit_val_batches: Any = 1.0
    log_every_n_steps: int = 10
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    deterministic: bool = False
    enable_progress_bar: bool = True
    plugins: list[Any] = field(default_factory=list)
    """Lightning plugins, each a ``_target_`` node; e.g. a ``SLURMEnvironment`` to change or turn off
    SLURM auto-requeue (docs/scale.md)."""

    def __post_init__(self) -> None:
        require(
            self.accelerator in ACCELERATORS,
            "trainer.accelerator",
            f"one of {ACCELERATORS}",
            self.accelerator,
        )
        require(
            self.strategy in STRATEGIES
            if isinstance(self.strategy, str)
            else not is_config_node(self.strategy),
            "trainer.strategy",
            f"one of {STRATEGIES} or a _target_ node",
            self.strategy,
        )
        require(
            self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1),
            "trainer.devices",
            "an integer >= 1 or 'auto'",
            self.devices,
        )
        require(
            isinstance(self.num_nodes, int) and self.num_nodes >= 1,
            "trainer.num_nodes",
            ">= 1",
            self.num_nodes,
        )
        require(
            str(self.precision) in PRECISIONS, "trainer.precision", f"one of {PRECISIONS}", self.precision
        )
        require(self.max_steps >= 1, "trainer.max_steps", ">= 1", self.max_steps)
        require(
            self.max_time is None or _is_duration(self.max_time),
            "trainer.max_time",
            'null or "DD:HH:MM:SS"',
            self.max_time,
        )
        require(isinstance(self.plugins, list), "trainer.plugins", "a list of _target_ nodes", self.plugins)
        require(self.log_every_n_steps >= 1, "trainer.log_every_n_steps", ">= 1", self.log_every_n_steps)
        require(
            self.accumulate_grad_batches >= 1,
            "trainer.accumulate_grad_batches",
            ">= 1",
            self.accumulate_grad_batches,
        )
        require(
            self.gradient_clip_val is None or self.gradient_clip_val > 0,
            "trainer.gradient_clip_val",
            "> 0 or null",
            self.gradient_clip_val,
        )

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``lightning.Trainer``."""
        return {
            "accelerator": self.accelerator,
            "strategy": self.strategy,
            "devices": self.devices,
            "num_nodes": self.num_nodes,
            "precision": self.precision,
            "max_steps": self.max_steps,
            "max_time": self.max_time,
            "val_check_interval": self.val_check_interval,
            "check_val_every_n_epoch": None,
            "limit_val_batches": self.limit_val_batches,
            "log_every_n_steps": self.log_every_n_steps,
            "gradient_clip_val": self.gradient_clip_val,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "deterministic": self.deterministic,
            "enable_progress_bar": self.enable_progress_bar,
            "enable_model_summary": False,  # run.fit logs the summary to train.log instead
            "plugins": list(self.plugins) or None,
        }


def _is_duration(value: Any) -> bool:
    """``"DD:HH:MM:SS"`` with whole non-negative numbers."""
    parts = str(value).split(":")
    return len(parts) == 4 and all(p.isdigit() for p in parts)


@dataclass
class LoggerConfig:
    """Which loggers write: W&B (offline unless credentials exist) and a local CSV logger."""

    wandb: bool = True
    csv: bool = True
    offline: Any = "auto"
    project: str = "draftsmith"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 30.0
    """Seconds W&B may take to start an online run; past it the run logs offline instead."""

    def __post_init__(self) -> None:
        require(
            self.offline in ("auto", True, False), "logger.offline", "'auto', true or false", self.offline
        )
        require(bool(self.project), "logger.project", "a non-empty string", self.project)
        require(self.init_timeout > 0, "logger.init_timeout", "> 0 seconds", self.init_timeout)

    def wandb_offline(self) -> bool:
        """Offline unless forced online, or (``auto``) unless an API key is configured and
        ``WANDB_MODE`` does not say offline."""
        if self.offline == "auto":
            mode = os.environ.get("WANDB_MODE", "").lower()
            return not os.environ.get("WANDB_API_KEY") or mode in ("offline", "dryrun")
        return bool(self.offline)


@dataclass
class ModelConfig:
    """The verifier/drafter pair. ``tiny`` / ``smollm2`` hold the recipe of a pair built on first use."""

    name: str
    verifier: str
    drafter: str
    tokenizer: str | None = None
    dtype: str = "float32"
    verifier_dtype: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = "sdpa"
    tiny: Any = None
    smollm2: Any = None
    """The real pair's recipe (:class:`train.pairs.smollm2_pair.SmolPairConfig`) for ``model=smollm2``."""

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "model.dtype", f"one of {DTYPES}", self.dtype)
        require(
            self.verifier_dtype is None or self.verifier_dtype in DTYPES,
            "model.verifier_dtype",
            f"null or one of {DTYPES}",
            self.verifier_dtype,
        )
        built = self.tiny is not None or self.smollm2 is not None
        check_model_source("model.verifier", self.verifier, may_be_built=built)
        check_model_source("model.drafter", self.drafter, may_be_built=built)
        if self.tokenizer is not None:
            check_model_source("model.tokenizer", self.tokenizer, may_be_built=built)

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.verifier


@dataclass
class PathsConfig:
    """Where data, caches and run directories live (conf/paths/default.yaml)."""

    root_dir: str
    data_dir: str
    checkpoints_dir: str
    tiny_dir: str
    run_dir: str

    def __post_init__(self) -> None:
        for key in ("root_dir", "data_dir", "checkpoints_dir", "tiny_dir", "run_dir"):
            require(bool(getattr(self, key)), f"paths.{key}", "a non-empty path", getattr(self, key))


_UNEXPECTED_KEYWORD = re.compile(r"unexpected keyword argument '(\w+)'")


def unknown_key_message(key: str, valid: Iterable[str]) -> str:
    """``key`` (dotted, e.g. ``method.divergance``) is not one of ``valid`` (the keys of its parent):
    a message naming the closest key and all of them."""
    parent, _, leaf = key.rpartition(".")
    keys = sorted(valid)
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    return f"{key} is not a setting of {parent or 'the config'}{hint} Valid keys: {', '.join(keys)}"


def _settings_of(node: Any) -> list[str]:
    """The fields of the dataclass a group node builds (its ``_target_``), else the node's keys."""
    try:
        return [f.name for f in dataclasses.fields(get_class(node["_target_"]))]
    except Exception:
        return [str(k) for k in node if not str(k).startswith("_")]


def instantiate_group(cfg: Any, key: str) -> Any:
    """Build one config group's dataclass, prefixing any validation error with the group's key.

    cfg: the composed DictConfig; returns None when the group is absent.
    """
    node = cfg.get(key)
    if node is None:
        return None
    try:
        return instantiate(renamed_targets(node, key), _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        message = str(cause)
        if isinstance(cause, ConfigError) or message.startswith(f"{key}."):
            raise ConfigError(message) from None
        unknown = _UNEXPECTED_KEYWORD.search(message)
        if isinstance(cause, TypeError) and unknown:
            raise ConfigError(unknown_key_message(f"{key}.{unknown.group(1)}", _settings_of(node))) from None
        raise ConfigError(f"{key}: {message}") from None
    except Exception as err:  # interpolation or missing-value errors from OmegaConf
        raise ConfigError(f"{key}: {err}") from None
