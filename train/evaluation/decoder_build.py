"""Which decoders a drafter gets: the kinds each decoder accepts, and the decoders built from the
evaluation's decoder configs for one verifier/drafter pair."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_object, instantiate

from train.config import ConfigError, renamed_targets
from train.decoding import (
    model_device,
)
from train.evaluation.eval_config import EvalConfig
from train.models.draft_vocab import with_draft_vocab
from train.models.steering_module import SteeredDrafter


def drafter_kind(obj: Any) -> str:
    """What kind of drafter a drafter is: ``model`` (a second language model, the default), ``heads``
    (prediction heads on the verifier) or ``steered`` (a model with its SD^2 steering module), from its
    ``drafter_kind`` attribute."""
    return str(getattr(obj, "drafter_kind", "model"))


def accepted_kinds(obj: Any) -> tuple[str, ...]:
    """The kinds of drafter a decoder class takes: its ``accepts``
    (:class:`~train.decoding.decoders.base.Decoder`).

    A decoder written before 0.2 names them ``drafter_kinds`` (or one ``drafter_kind``): still read, with
    a deprecation line."""
    kinds = getattr(obj, "accepts", None)
    if kinds is None:
        old = getattr(obj, "drafter_kinds", None) or (getattr(obj, "drafter_kind", None),)
        if old != (None,):
            warnings.warn(
                f"{getattr(obj, '__name__', obj)}: drafter_kinds / drafter_kind on a decoder is deprecated; "
                "name what it accepts in `accepts`",
                DeprecationWarning,
                stacklevel=2,
            )
        kinds = tuple(k for k in old if k is not None) or ("model",)
    return tuple(str(k) for k in kinds)


def _config_kinds(settings: dict[str, Any]) -> tuple[str, ...]:
    """The kinds of drafter a decoder config's class takes, read from the class itself: nothing the
    config names (n-gram models, steering modules, rescoring LMs) is loaded to find it out."""
    return accepted_kinds(get_object(settings["_target_"]))


def decoder_kinds(cfg: EvalConfig) -> dict[str, tuple[str, ...]]:
    """{label: the kinds of drafter that decoder config takes} (:func:`accepted_kinds`)."""
    return {label: _config_kinds(settings) for label, settings in cfg.decoder_configs.items()}


def build_decoders(verifier: torch.nn.Module, drafter: torch.nn.Module, cfg: EvalConfig) -> dict[str, Any]:
    """{label: decoder} for one drafter: each decoder config that takes this kind of drafter
    (:func:`drafter_kind` among :func:`accepted_kinds`), its partial called ``factory(verifier, drafter)``."""
    out = {}
    for label, settings in cfg.decoder_configs.items():
        if drafter_kind(drafter) not in _config_kinds(settings):
            continue
        try:
            factory = instantiate(renamed_targets({**settings, "_partial_": True}, f"eval.decoders[{label}]"))
            place_loaded_modules(factory.keywords.values(), drafter)
            out[label] = factory(verifier, over_draft_vocab(drafter))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"eval.decoders[{label}]: {err}") from None
    return out


def over_draft_vocab(drafter: torch.nn.Module) -> torch.nn.Module:
    """A drafter with a reduced vocabulary (``config.draft_vocab``) drafting over it only: a model, or a
    steered drafter's model (its steering module unchanged); anything else as it is. Unwrapped, a
    drafter computes its head over the whole vocabulary every step (the steered drafter did so until
    2026-11-29: 2-3x its step)."""
    if isinstance(drafter, SteeredDrafter):
        return SteeredDrafter(with_draft_vocab(drafter.drafter), drafter.steering)
    return with_draft_vocab(drafter) if drafter_kind(drafter) == "model" else drafter


def place_loaded_modules(objects: Any, drafter: torch.nn.Module) -> None:
    """Put the modules a decoder config loads (an SD^2 steering module, a BPD rescoring LM held by its
    refiner) on the drafter's device: they load on the CPU, and left there they would run every block
    on the CPU beside models on a GPU."""
    device = model_device(drafter)
    for obj in objects:
        for candidate in (obj, *getattr(obj, "__dict__", {}).values()):
            if isinstance(candidate, torch.nn.Module):
                candidate.to(device)


@dataclass
class TimedEntry:
    """One thing timed per prompt: the baseline (drafter None) or a drafter under a decoder."""

    drafter: str | None
    label: str
    decoder: Any

    @property
    def name(self) -> str:
        return "ar" if self.drafter is None else f"{self.drafter}/{self.label}"
