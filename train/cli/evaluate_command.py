"""The body of ``scripts/evaluate.py`` (conf/eval.yaml): validate, load the pair, evaluate, write the run.

Top-level shortcuts of conf/eval.yaml: ``drafter=PATH`` replaces ``model.drafter``; ``heads=PATH``
(a folder or Hub id of :class:`~train.models.heads.MedusaHeads`) adds prediction heads, which the
decoders that take heads (``decoding=medusa``) run while the others run the drafter;
``eagle3=PATH`` (an :class:`~train.models.eagle3_drafter.Eagle3Drafter`) adds an EAGLE-3 drafter for
``decoding=eagle3``, ``dflash=PATH`` (a :class:`~train.models.dflash_drafter.DFlashDrafter`) a DFlash drafter
for ``decoding=dflash``; ``decoding=<name>`` picks the decoder config that ``eval.decoders`` holds by default
(labelled by that name); ``gamma=N`` sets that config's draft length; ``gammas=[...]`` is ``eval.gammas``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from train.config import ConfigError, check_model_source, instantiate_group, require
from train.evaluation.decoder_build import decoder_kinds
from train.evaluation.eval_config import (
    DECODING_CONF_DIR,
    EvalConfig,
    build_eval_config,
    known_decoder_configs,
)
from train.evaluation.prompts import build_prompts
from train.evaluation.results_table import results_table
from train.evaluation.runner import evaluate_drafters
from train.models.dflash_drafter import DFlashDrafter
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_pair, place_pair, resolve_devices
from train.pairs.built import ensure_built_pair
from train.tables import format_value
from train.training.trainer import build_loggers

__all__ = ["EvalRun", "main", "validate"]

_DECODING_REF = "${decoding}"


FEATURE_DRAFTERS: dict[str, tuple[Any, str]] = {
    "eagle3": (Eagle3Drafter, "an EAGLE-3 drafter"),
    "dflash": (DFlashDrafter, "a DFlash drafter"),
}
"""The drafters on the verifier's hidden states a command-line key loads (``eagle3=PATH``,
``dflash=PATH``), each for the decoders that take its kind."""


def _decoding_choice(cfg: DictConfig) -> str | None:
    """The name picked with ``decoding=<name>`` (Hydra's runtime choices), when known."""
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get("decoding")
    choice = OmegaConf.select(cfg, "hydra.runtime.choices.decoding", default=None)
    return str(choice) if choice is not None else None


def apply_shortcuts(cfg: DictConfig) -> None:
    """Apply ``gamma`` and ``drafter``, and label the ``${decoding}`` entry of ``eval.decoders`` with the
    name chosen by ``decoding=<name>``, in place."""
    entries = OmegaConf.to_container(cfg.eval.decoders, resolve=False) if cfg.get("eval") else []
    uses_decoding = isinstance(entries, list) and _DECODING_REF in entries
    gamma = cfg.get("gamma")
    if gamma is not None:
        require(
            isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1,
            "gamma",
            "an integer >= 1",
            gamma,
        )
        if not uses_decoding or cfg.get("decoding") is None or "gamma" not in cfg.decoding:
            raise ConfigError(
                "gamma: sets the draft length of the `decoding` config, which eval.decoders does not use "
                "(or which has no gamma); sweep named configs with eval.gammas=[...]"
            )
        cfg.decoding.gamma = gamma
    drafter = cfg.get("drafter")
    if drafter is not None:
        check_model_source("drafter", str(drafter))
        cfg.model.drafter = str(drafter)
    if isinstance(entries, list):  # named configs are read here, so their interpolations (${heads},
        known = known_decoder_configs()  # ${model.drafter}) resolve against this run's config
        for i, entry in enumerate(entries):
            if isinstance(entry, str) and entry in known:
                node = OmegaConf.load(DECODING_CONF_DIR / f"{entry}.yaml")
                node.name = entry
                cfg.eval.decoders[i] = node
    label = _decoding_choice(cfg)
    if uses_decoding and label is not None:
        assert isinstance(entries, list)
        for i, entry in enumerate(entries):
            if entry == _DECODING_REF:
                node = OmegaConf.create(OmegaConf.to_container(cfg.decoding, resolve=True))
                node.name = label
                cfg.eval.decoders[i] = node


def _drafter_label(source: str) -> str:
    """A short table name for a drafter source: ``org/name``, or a run's ``<run>/drafter``."""
    path = os.path.normpath(source)
    base = os.path.basename(path)
    if base == "drafter" and os.path.dirname(path):
        return f"{os.path.basename(os.path.dirname(path))}/drafter"
    return base if os.path.isdir(os.path.expanduser(source)) else source


@dataclass
class EvalRun:
    """The validated configuration of one ``scripts/evaluate.py`` run (nothing loaded yet)."""

    cfg: DictConfig
    eval: EvalConfig
    paths: Any
    model: Any
    data: Any
    logger: Any
    kinds: set[str]
    """The drafter kinds the decoders take (``model``, ``heads``, ...)."""
    devices: tuple[Any, Any] = (None, None)
    """(verifier device, drafter device or None for the verifier's): ``device`` / ``drafter_device``."""


def validate(cfg: DictConfig) -> EvalRun:
    """Apply the shortcuts and check every setting (errors name the key) before anything is written or
    loaded; model sources are checked for existence, not loaded."""
    apply_shortcuts(cfg)
    if "hydra" in cfg:  # composed with return_hydra_config (tests): Hydra's own node is not ours to resolve
        with open_dict(cfg):
            del cfg["hydra"]
    OmegaConf.resolve(cfg)
    eval_cfg: EvalConfig = build_eval_config(cfg.eval)
    run = EvalRun(
        cfg=cfg,
        eval=eval_cfg,
        paths=instantiate_group(cfg, "paths"),
        model=instantiate_group(cfg, "model"),
        data=instantiate_group(cfg, "data"),
        logger=instantiate_group(cfg, "logger"),
        kinds={k for taken in decoder_kinds(eval_cfg).values() for k in taken},
        devices=resolve_devices(cfg.get("device"), cfg.get("drafter_device")),
    )
    steered = [label for label, settings in eval_cfg.decoder_configs.items() if settings.get("steering")]
    if steered and cfg.get("steering") is None:
        raise ConfigError(f"steering: the decoders {steered} steer the drafter; pass steering=PATH")
    if cfg.get("steering") is not None:
        check_model_source("steering", str(cfg.steering))
    kinds = run.kinds
    heads_source = cfg.get("heads")
    if "heads" in kinds and heads_source is None:
        raise ConfigError(
            "heads: the decoders include one that takes prediction heads (medusa); pass heads=PATH"
        )
    if heads_source is not None and "heads" not in kinds:
        raise ConfigError(
            "heads: given, but no decoder in eval.decoders takes heads; add decoding=medusa "
            "(or eval.decoders=[sd,medusa])"
        )
    if heads_source is not None:
        check_model_source("heads", str(heads_source))
    for key, (_, noun) in FEATURE_DRAFTERS.items():
        source = cfg.get(key)
        if key in kinds and source is None:
            raise ConfigError(f"{key}: the decoders include one that takes {noun}; pass {key}=PATH")
        if source is not None and key not in kinds:
            raise ConfigError(f"{key}: given, but no decoder in eval.decoders takes it; add decoding={key}")
        if source is not None:
            check_model_source(key, str(source))
    return run


def main(cfg: DictConfig) -> dict[str, Any]:
    """``scripts/evaluate.py``: validate the whole config, load the pair, evaluate,
    write the run directory."""
    run = validate(cfg)
    eval_cfg, model_cfg, logger_cfg = run.eval, run.model, run.logger
    run_dir = run.paths.run_dir
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
    ensure_built_pair(model_cfg)
    kinds, heads_source = run.kinds, cfg.get("heads")
    pair = place_pair(load_pair(model_cfg, freeze_drafter=True), *run.devices)
    drafter_source = cfg.get("drafter")
    name = _drafter_label(str(drafter_source)) if drafter_source is not None else "drafter"
    drafters: dict[str, Any] = {}
    if "model" in kinds:
        drafters[name] = pair.drafter
    if heads_source is not None:
        heads = MedusaHeads.from_pretrained(str(heads_source)).eval()
        heads.to(next(pair.verifier.parameters()).device)
        drafters[_drafter_label(str(heads_source))] = heads
    verifier_weight = next(pair.verifier.parameters())
    for key, (cls, _) in FEATURE_DRAFTERS.items():
        source = cfg.get(key)
        if source is not None:
            drafter = cls.from_pretrained(str(source)).eval()
            drafters[_drafter_label(str(source))] = drafter.to(verifier_weight.device, verifier_weight.dtype)
    prompts = build_prompts(
        pair.tokenizer, run.data, eval_cfg.num_prompts, eval_cfg.prompt_len, seed=int(cfg.get("seed", 0))
    )
    loggers: list[Any] = []
    if logger_cfg is not None:
        config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        loggers = build_loggers(logger_cfg, run_dir, str(cfg.get("name", "eval")), config=config)
    results = evaluate_drafters(
        pair.verifier,
        drafters,
        prompts,
        eval_cfg,
        eos_token_id=eos_token_ids(pair.tokenizer, pair.verifier, pair.drafter),
        out_dir=run_dir,
        loggers=loggers,
        step=0,
    )
    for logger in loggers:
        logger.finalize("success")
    print(results_table(results))
    print(f"Evaluation written to {run_dir} ({format_value(results['elapsed_seconds'], 1)} s)")
    return results
