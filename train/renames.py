"""Names that changed, and what keeps the old ones working: ``_target_`` classes that moved, settings and
values renamed to docs/architecture.md's glossary words (issue 53), each read under its new name with one
deprecation line; Python keywords renamed likewise refused with a TypeError naming the new one."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


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
    # the asynchronous and DFlash decoders' draft length: gamma, as every chain's
    "train.decoding.AsyncSpeculativeDecoder": {"max_block": "gamma"},
    "train.decoding.decoders.async_decoder.AsyncSpeculativeDecoder": {"max_block": "gamma"},
    "train.decoding.DFlashDecoder": {"max_draft": "gamma"},
    "train.decoding.decoders.dflash_decoder.DFlashDecoder": {"max_draft": "gamma"},
    # DFlash's slot weight decay: gamma is the chain's draft length everywhere else
    "train.methods.dflash.config.DFlashConfig": {"gamma": "slot_decay"},
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
