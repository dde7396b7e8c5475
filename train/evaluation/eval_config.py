"""What one evaluation measures: :class:`EvalConfig` (``eval.*``) and the decoder configs it names.

A decoder is chosen by Hydra's ``_target_``: each ``conf/decoding/<name>.yaml`` is a partial
(``_partial_: true``) of a decoder class with its own settings (gamma, lenience, eps, ...), called
``factory(verifier, drafter)``. ``eval.decoders`` lists such configs by name (read from
``conf/decoding/``) or inline as mappings with a ``_target_``; results are keyed by the decoder's
*label*: its config name, or ``<name>@g<gamma>`` for the expansions of the ``eval.gammas`` sweep.

:func:`build_eval_config` turns the ``eval`` node of a composed config (conf/eval/default.yaml, used
by both ``scripts/evaluate.py`` and ``python train.py``) into a validated :class:`EvalConfig`; every
error names its key, before any model loads.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from train.config import ConfigError, renamed_targets, require
from train.decoding import SamplingParams
from train.decoding.sampling import LENIENCES

__all__ = [
    "DECODING_CONF_DIR",
    "EvalConfig",
    "build_eval_config",
    "known_decoder_configs",
    "load_decoder_config",
]

#: Where named decoder configs live (``eval.decoders=[sd,sd_g2]`` reads ``sd.yaml`` and ``sd_g2.yaml``).
DECODING_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "decoding"

#: Keys of a decoder config that are not constructor arguments.
_RESERVED = ("name", "_target_", "_partial_")


def known_decoder_configs(conf_dir: Path = DECODING_CONF_DIR) -> list[str]:
    """Names of the decoder configs under ``conf/decoding/``."""
    return sorted(p.stem for p in conf_dir.glob("*.yaml"))


def load_decoder_config(name: str, conf_dir: Path = DECODING_CONF_DIR) -> dict[str, Any]:
    """The decoder config ``conf/decoding/<name>.yaml`` as a plain dict, labelled ``name``."""
    known = known_decoder_configs(conf_dir)
    if name not in known:
        raise ConfigError(f"eval.decoders: unknown decoder config {name!r}; known: {known}")
    node = OmegaConf.to_container(OmegaConf.load(conf_dir / f"{name}.yaml"), resolve=True)
    require(isinstance(node, dict), f"eval.decoders[{name}]", "a mapping with a _target_", node)
    assert isinstance(node, dict)
    require(
        isinstance(node.get("_target_"), str), f"eval.decoders[{name}]._target_", "set", node.get("_target_")
    )
    return {**node, "name": name}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain Python (interpolations resolved)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _as_list(value: Any, key: str) -> list[Any]:
    value = _plain(value)
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        return [value]
    require(
        isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0,
        key,
        "a non-empty list",
        value,
    )
    return list(value)


def _distinct(values: list[Any], key: str) -> None:
    require(len(set(values)) == len(values), key, "distinct", values)


def _label_of(entry: Mapping[str, Any]) -> str:
    if entry.get("name") is not None:
        return str(entry["name"])
    # An inline config without a name is labelled by its class: SpeculativeDecoder -> speculativedecoder.
    return str(entry["_target_"]).rsplit(".", 1)[-1].lower()


def _normalise_decoder(entry: Any, index: int) -> dict[str, Any]:
    """A decoder entry (a name or an inline mapping) as a dict with ``name``, ``_target_``, settings; old
    target names and settings (``top_k`` of EAGLE-3's tree, now ``branching``) renamed, each with a
    deprecation line (:func:`~train.config.renamed_targets`)."""
    entry = _plain(entry)
    if isinstance(entry, str):
        return renamed_targets(load_decoder_config(entry), f"eval.decoders[{entry}]")
    key = f"eval.decoders[{index}]"
    require(isinstance(entry, Mapping), key, "a decoder config name or a mapping with a _target_", entry)
    out = dict(entry)
    require(isinstance(out.get("_target_"), str) and bool(out["_target_"]), f"{key}._target_", "set", out)
    require(out.get("_partial_", True) is True, f"{key}._partial_", "true (absent means true)", out)
    out["name"] = _label_of(out)
    return renamed_targets(out, f"eval.decoders[{out['name']}]")


def _check_decoder(label: str, entry: Mapping[str, Any]) -> None:
    """Fail on a decoder config that cannot be built, before any model loads."""
    key = f"eval.decoders[{label}]"
    require(bool(label) and "/" not in label, f"{key}.name", "a non-empty label without '/'", label)
    try:
        target = get_object(entry["_target_"])
    except Exception as err:
        raise ConfigError(f"{key}._target_: cannot import {entry['_target_']!r} ({err})") from None
    require(callable(target), f"{key}._target_", "a callable (a decoder class)", entry["_target_"])
    settings = decoder_settings(entry)
    try:
        inspect.signature(target).bind(object(), object(), **settings)
    except TypeError as err:
        raise ConfigError(
            f"{key}: {entry['_target_']}(verifier, drafter, **{settings}) does not bind: {err}"
        ) from None
    except ValueError:  # no introspectable signature (a builtin); the constructor will tell
        pass
    if "gamma" in settings:
        g = settings["gamma"]
        require(_is_int(g) and g >= 1, f"{key}.gamma", "an integer >= 1", g)
    if "lenience" in settings:
        lenience = settings["lenience"]
        require(
            lenience is None or lenience in LENIENCES,
            f"{key}.lenience",
            f"null or one of {sorted(LENIENCES)}",
            lenience,
        )
    if "eps" in settings:
        eps = settings["eps"]
        require(
            isinstance(eps, int | float) and not isinstance(eps, bool) and 0 < eps <= 1,
            f"{key}.eps",
            "in (0, 1] (1 = lossless)",
            eps,
        )


def decoder_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor keyword arguments of a decoder config (everything but name/_target_/_partial_)."""
    return {k: v for k, v in entry.items() if k not in _RESERVED}


@dataclass
class EvalConfig:
    """What one evaluation measures (``eval.*``, conf/eval/default.yaml). Validated on construction.

    The defaults fit the main DistillSpec job's budget on the embedded tiny pair (two drafters,
    T in {0, 1}, the ``sd`` decoder at gamma 4, two seeds; docs/evaluation.md).
    """

    #: Sampling temperatures; 0 is greedy and checks every output against the verifier's greedy one.
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    #: Seeds of the sampling generators; figures are mean / std over them.
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    #: Decoders run for every drafter: names of conf/decoding/*.yaml or inline mappings with a
    #: ``_target_`` (label: their ``name``). Normalised on construction to mappings with a ``name``.
    decoders: list[Any] = field(default_factory=lambda: ["sd"])
    #: Optional gamma sweep: every decoder config with a ``gamma`` key runs once per value, labelled
    #: ``<name>@g<gamma>``; configs without one run once. null: each config's own gamma.
    gammas: list[int] | None = None
    #: Prompts cut from the data config's test split (used by :func:`build_prompts`).
    num_prompts: int = 8
    #: Prompt length in tokens, BOS included.
    prompt_len: int = 64
    #: New tokens per prompt (generation also stops at any EOS id).
    max_new_tokens: int = 64
    #: Warping applied identically to verifier and drafter; 0 / 1.0 disable top-k / top-p.
    top_k: int = 0
    top_p: float = 1.0
    #: Raise on a temperature-0 output that differs from greedy decoding other than by a
    #: low-precision tie (false: record it and warn).
    strict_greedy: bool = True
    #: A greedy difference is a tie when both tokens' float32 logits are within this many units in
    #: the last place of the verifier's dtype, at the logits' magnitude, of the top logit.
    tie_ulps: float = 4.0
    #: One short untimed generation per decoder first, so lazy initialisation is not timed.
    warmup: bool = True
    #: torch intra-op threads during the evaluation, restored afterwards (null: leave torch's setting).
    #: 1 suits small latency-bound models on CPU: with more, OpenMP spin-waiting on a busy machine
    #: slowed the tiny pair's evaluation tenfold (docs/evaluation.md). Set null for large models, or
    #: ``idle``: the cores no other process is using when the evaluation starts (at least 1).
    num_threads: int | str | None = 1
    #: Progress bar over the generations; plots written next to results.json.
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        self.temperatures = [
            float(t) if isinstance(t, int | float) and not isinstance(t, bool) else t
            for t in _as_list(self.temperatures, "eval.temperatures")
        ]
        for t in self.temperatures:
            require(
                isinstance(t, float) and math.isfinite(t) and t >= 0,
                "eval.temperatures",
                "finite numbers >= 0 (0 = greedy)",
                self.temperatures,
            )
        _distinct(self.temperatures, "eval.temperatures")
        self.seeds = _as_list(self.seeds, "eval.seeds")
        for s in self.seeds:
            require(_is_int(s) and s >= 0, "eval.seeds", "integers >= 0", self.seeds)
        _distinct(self.seeds, "eval.seeds")
        if self.gammas is not None:
            self.gammas = _as_list(self.gammas, "eval.gammas")
            for g in self.gammas:
                require(_is_int(g) and g >= 1, "eval.gammas", "null or integers >= 1", self.gammas)
            _distinct(self.gammas, "eval.gammas")
        self.decoders = [
            _normalise_decoder(d, i) for i, d in enumerate(_as_list(self.decoders, "eval.decoders"))
        ]
        self._resolved = self._expand()
        for key, minimum, what in (
            ("num_prompts", 1, "an integer >= 1"),
            ("prompt_len", 2, "an integer >= 2 (BOS + one token)"),
            ("max_new_tokens", 1, "an integer >= 1"),
            ("top_k", 0, "an integer >= 0 (0 = off)"),
        ):
            value = getattr(self, key)
            require(_is_int(value) and value >= minimum, f"eval.{key}", what, value)
        require(
            isinstance(self.top_p, int | float) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1,
            "eval.top_p",
            "in (0, 1] (1 = off)",
            self.top_p,
        )
        require(
            isinstance(self.tie_ulps, int | float)
            and not isinstance(self.tie_ulps, bool)
            and self.tie_ulps >= 0,
            "eval.tie_ulps",
            "a number >= 0 (0: only exact ties)",
            self.tie_ulps,
        )
        require(
            self.num_threads in (None, "idle") or (_is_int(self.num_threads) and int(self.num_threads) >= 1),
            "eval.num_threads",
            "null, idle or an integer >= 1",
            self.num_threads,
        )
        for key in ("strict_greedy", "warmup", "progress", "plots"):
            require(isinstance(getattr(self, key), bool), f"eval.{key}", "true or false", getattr(self, key))

    def _expand(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        swept = False
        for entry in self.decoders:
            variants = [(entry["name"], entry)]
            if self.gammas is not None and "gamma" in entry:
                swept = True
                variants = [(f"{entry['name']}@g{g}", {**entry, "gamma": g}) for g in self.gammas]
            for label, variant in variants:
                require(
                    label not in out,
                    "eval.decoders",
                    "configs with distinct labels (give inline entries a distinct 'name'); "
                    f"{label!r} repeats",
                    [d["name"] for d in self.decoders],
                )
                _check_decoder(label, variant)
                out[label] = {"_target_": variant["_target_"], **decoder_settings(variant)}
        if self.gammas is not None and not swept:
            raise ConfigError(
                f"eval.gammas: none of eval.decoders {[d['name'] for d in self.decoders]} "
                "has a gamma to sweep"
            )
        return out

    @property
    def decoder_configs(self) -> dict[str, dict[str, Any]]:
        """{label: {"_target_", **settings}} of every decoder to run, the gamma sweep expanded."""
        return {label: dict(cfg) for label, cfg in self._resolved.items()}

    def sampling_params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=float(self.top_p))


_HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_")


def build_eval_config(node: Any = None) -> EvalConfig:
    """A validated :class:`EvalConfig` from the ``eval`` node of a composed config (or a plain mapping).

    Names in ``decoders`` are read from ``conf/decoding/``; ``_target_`` and other Hydra keys of the
    node itself are ignored. Raises :class:`~train.config.ConfigError` naming the key on any bad value.
    """
    if node is None:
        return EvalConfig()
    if isinstance(node, EvalConfig):
        return node
    data: Any
    if isinstance(node, DictConfig):
        try:
            data = OmegaConf.to_container(node, resolve=True)
        except Exception as err:  # interpolation or missing-value errors
            raise ConfigError(f"eval: {err}") from None
    else:
        require(isinstance(node, Mapping), "eval", "a mapping of EvalConfig fields", node)
        data = dict(node)
    assert isinstance(data, dict)
    for key in _HYDRA_KEYS:
        data.pop(key, None)
    known = [f.name for f in fields(EvalConfig)]
    for key in data:
        if key not in known:
            hint = (
                (
                    " (decoder settings such as gamma, lenience and eps live in the decoder configs, "
                    "conf/decoding/)"
                )
                if key in ("gamma", "lenience", "eps")
                else ""
            )
            raise ConfigError(f"eval.{key}: unknown key; known: {known}{hint}")
    return EvalConfig(**data)
