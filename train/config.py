"""Typed, validated run configuration.

Every Hydra group that is not a Lightning object points its ``_target_`` at one of these dataclasses,
so ``hydra.utils.instantiate`` builds it and ``__post_init__`` rejects a bad value before any model
loads. Errors name the config key (``trainer.devices``) and the allowed range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

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


#: ``_target_`` names that moved (the 0.2 layout; the pair recipes' classes, 2026-11-28), old -> new:
#: configs written before still build, with one deprecation line each (train.log and the terminal's warnings).
RENAMED_TARGETS: dict[str, str] = {
    "train.models.tiny.TinyPairConfig": "train.pairs.tiny.TinyPairConfig",
    "train.models.tiny.TinyModelSpec": "train.pairs.tiny.TinyModelRecipe",
    "train.pairs.tiny.TinyModelSpec": "train.pairs.tiny.TinyModelRecipe",
    "train.models.smol_pair.SmolPairConfig": "train.pairs.smollm2_pair.SmolPairConfig",
    "train.models.smol_pair.SmolDrafterSpec": "train.pairs.smollm2_pair.SmolDrafterRecipe",
    "train.pairs.smollm2_pair.SmolDrafterSpec": "train.pairs.smollm2_pair.SmolDrafterRecipe",
    "train.methods.distillspec.DistillSpecConfig": "train.methods.distillspec.config.DistillSpecConfig",
    "train.methods.medusa.MedusaConfig": "train.methods.medusa.config.MedusaConfig",
    "train.methods.steering.SteeringConfig": "train.methods.steering.config.SteeringConfig",
    "train.methods.pretrain.PretrainConfig": "train.methods.pretrain.config.PretrainConfig",
    "train.callbacks.NonFiniteLossGuard": "train.training.callbacks.NonFiniteLossGuard",
    "train.export.HubConfig": "train.export.hub.HubConfig",
    "train.decoding.MedusaDecoder": "train.decoding.HeadsDecoder",
    "train.models.steering.SteeringModule.from_pretrained": (
        "train.models.steering_module.SteeringModule.from_pretrained"
    ),
}


#: Settings renamed to docs/architecture.md's glossary words (issue 53), per settings class (its
#: ``_target_``), old key -> new key: configs written before still build, with one deprecation line each.
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "train.methods.distillspec.config.DistillSpecConfig": {
        "cache_teacher": "cache_answers",
        "teacher_temperature": "verifier_temperature",
        "teacher_answers": "answers",
        "teacher_cache_mb": "verifier_cache_mb",
    },
    # EAGLE's tree width: top_k is the sampling cut-off only (eval.top_k)
    "train.decoding.Eagle3Decoder": {"top_k": "branching"},
    "train.decoding.decoders.eagle3_decoder.Eagle3Decoder": {"top_k": "branching"},
    # the log-probabilities kept per answer token (model.smollm2.top_logprobs)
    "train.pairs.smollm2_pair.SmolPairConfig": {"top_k": "top_logprobs"},
}
#: Setting values renamed the same way, per settings class and key, old value -> new value.
RENAMED_VALUES: dict[str, dict[str, dict[str, str]]] = {
    "train.methods.distillspec.config.DistillSpecConfig": {
        "data_source": {"teacher": "verifier", "student": "drafter", "mixed_teacher": "mixed_verifier"},
    },
}


_Callable = TypeVar("_Callable", bound=Callable[..., Any])


def renamed_keywords(**renamed: str) -> Callable[[_Callable], _Callable]:
    """A function's or class's keyword arguments renamed to the glossary's words (issue 53), ``old="new"``:
    a call with an old keyword raises a TypeError naming the new one (``top_k`` became ``branching``), not
    Python's bare "unexpected keyword argument". A class keeps its type; its ``__init__`` is checked."""

    def check(name: str, kwargs: dict[str, Any]) -> None:
        for old in (old for old in renamed if old in kwargs):
            raise TypeError(f"{name}() got the keyword {old!r}, renamed (issue 53): use {renamed[old]}=")

    def wrap(obj: _Callable) -> _Callable:
        if isinstance(obj, type):
            init: Callable[..., None] = obj.__init__  # type: ignore[misc]

            @functools.wraps(init)
            def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
                check(obj.__name__, kwargs)
                init(self, *args, **kwargs)

            obj.__init__ = checked_init  # type: ignore[misc]
            return obj

        @functools.wraps(obj)
        def checked(*args: Any, **kwargs: Any) -> Any:
            check(obj.__name__, kwargs)
            return obj(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return wrap


def _deprecated(message: str) -> None:
    """One deprecation line: in the warnings (the terminal) and in the log (train.log)."""
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning("%s", message)


def renamed_keys_of(target: Any) -> dict[str, str]:
    """The renamed keys (old -> new) of the settings class ``target`` names (an old name included)."""
    return RENAMED_KEYS.get(RENAMED_TARGETS.get(target, target), {}) if isinstance(target, str) else {}


def renamed_settings(node: Any, path: str = "") -> None:
    """``node``'s old keys and values (:data:`RENAMED_KEYS`, :data:`RENAMED_VALUES` of the class it builds)
    replaced in place, each with a deprecation line naming old and new (``path``: the node's dotted key).
    An old key beside its new one wins: in a composed config the new one holds the group's default."""
    keys, values = renamed_keys_of(node.get("_target_")), RENAMED_VALUES.get(str(node.get("_target_")), {})
    prefix = f"{path}." if path else ""
    with open_dict(node) if isinstance(node, DictConfig) else contextlib.nullcontext():
        for old, new in [(old, new) for old, new in keys.items() if old in node]:
            raw: Any = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
            value = raw[old]  # an interpolation moves as written
            was = f" (its value {value!r} replaces {prefix}{new}={raw[new]!r})" if new in node else ""
            _deprecated(f"{prefix}{old} is deprecated; it is now {prefix}{new}{was}")
            del node[old]
            node[new] = value
        for key, renamed in values.items():
            if isinstance(value := node.get(key), str) and value in renamed:
                _deprecated(f"{prefix}{key}={value} is deprecated; it is now {prefix}{key}={renamed[value]}")
                node[key] = renamed[value]


def renamed_targets(node: Any, path: str = "") -> Any:
    """``node`` (a DictConfig, dict or list, walked in place) with old ``_target_`` names replaced by
    :data:`RENAMED_TARGETS`, and the old settings of the classes they name by :func:`renamed_settings`,
    each with a deprecation line (``path``: the node's dotted key, for the messages)."""
    if isinstance(node, (DictConfig, dict)):
        target = node.get("_target_")
        if isinstance(target, str) and target in RENAMED_TARGETS:
            new = RENAMED_TARGETS[target]
            _deprecated(f"_target_: {target} is deprecated; it is now {new}")
            node["_target_"] = new
        renamed_settings(node, path)
        for key, value in node.items():
            renamed_targets(value, f"{path}.{str(key)}" if path else str(key))
    elif isinstance(node, (ListConfig, list)):
        for i, value in enumerate(node):
            renamed_targets(value, f"{path}[{i}]")
    return node


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
