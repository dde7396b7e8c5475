"""The body of ``scripts/leaderboard.py`` (conf/leaderboard.yaml, docs/leaderboard.md).

1. **Artifacts**: for each experiment of ``experiments`` (``auto``: distillspec, steering, medusa, medusa2,
   eagle3, dflash, dspark, or their ``_tiny`` recipes on ``model=tiny``), the
   newest finished run of it for this verifier (:func:`train.rundir.newest_artifact`); when there is
   none, or with ``retrain=true``, it is trained first, ``python train.py experiment=<name>`` with this
   command's model/data/paths overrides and ``train_overrides``, in that order (steering picks up the
   DistillSpec drafter trained before it).
2. **Evaluation**, on one prompt set: the pretrained, DistillSpec and steered drafters and the Medusa-1
   heads against the verifier in one paired run (each decoder of ``eval.decoders`` for each drafter
   kind it takes), then the Medusa-2 heads against their own fine-tuned verifier.
3. **Leaderboard**: ``leaderboard.md`` / ``leaderboard.json`` (:mod:`train.evaluation.leaderboard`:
   measured columns and the labelled projection), ``speedup_vs_block_efficiency.png`` and each
   evaluation's own outputs (results, per-position acceptance plot) under ``eval_<label>/``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from train.config import instantiate_group, require
from train.evaluation import build_eval_config, build_prompts, evaluate_drafters, to_jsonable
from train.evaluation.eval_config import DECODING_CONF_DIR, known_decoder_configs
from train.evaluation.leaderboard import leaderboard_markdown, leaderboard_rows
from train.models.dflash_drafter import DFlashDrafter
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.models.loading import (
    eos_token_ids,
    load_drafter,
    load_model,
    load_pair,
    place_pair,
    resolve_devices,
)
from train.models.steering_module import SteeredDrafter, SteeringModule
from train.pairs.built import ensure_built_pair
from train.paths import PROJECT_ROOT
from train.rundir import newest_artifact

__all__ = ["ARTIFACTS", "main", "validate"]

log = logging.getLogger(__name__)

ARTIFACTS: dict[str, str] = {
    "distillspec": "drafter",
    "distillspec_tiny": "drafter",
    "steering": "steering",
    "steering_tiny": "steering",
    "medusa": "heads",
    "medusa_tiny": "heads",
    "medusa2": "heads",
    "medusa2_tiny": "heads",
    "eagle3": "eagle3",
    "eagle3_tiny": "eagle3",
    "dflash": "dflash",
    "dspark": "dflash",
    "dflash_tiny": "dflash",
}
"""The folder each experiment's run exports and the leaderboard loads."""

REAL_PAIR_EXPERIMENTS = ("distillspec", "steering", "medusa", "medusa2", "eagle3", "dflash", "dspark")
TINY_PAIR_EXPERIMENTS = (
    "distillspec_tiny",
    "steering_tiny",
    "medusa_tiny",
    "medusa2_tiny",
    "eagle3_tiny",
    "dflash_tiny",
)
"""``experiments: auto``: the recipes for the model's pair (steering after DistillSpec, whose drafter it
steers too; Medusa-2 after Medusa-1, whose heads it starts from)."""


def experiment_names(cfg: DictConfig, model_cfg: Any) -> list[str]:
    """``experiments`` as a list: ``auto`` is the tiny pair's recipes on ``model=tiny``, else the real
    pair's (any other pair gets the same recipes with its model overrides)."""
    if cfg.experiments == "auto":
        return list(TINY_PAIR_EXPERIMENTS if model_cfg.tiny is not None else REAL_PAIR_EXPERIMENTS)
    return [str(name) for name in cfg.experiments]


FORWARDED = ("model", "data", "paths", "seed")
"""Overrides of this command that every training run it starts gets too."""


def forwarded_overrides() -> list[str]:
    """This command's model/data/paths overrides (``model=qwen3``, ``model.verifier=...``)."""
    if not HydraConfig.initialized():
        return []
    task = list(HydraConfig.get().overrides.task)
    return [o for o in task if o.lstrip("+~").split("=")[0].split(".")[0] in FORWARDED]


def ensure_artifacts(
    cfg: DictConfig, names: Sequence[str], checkpoints_dir: str, verifier: str
) -> dict[str, str]:
    """{experiment: artifact folder} for ``names``, training each experiment whose artifact is missing
    (or all, with ``retrain``)."""
    found: dict[str, str] = {}
    for name in names:
        path = None if cfg.retrain else newest_artifact(checkpoints_dir, name, verifier, ARTIFACTS[name])
        if path is None:
            train(name, [*forwarded_overrides(), *(str(o) for o in cfg.train_overrides)])
            path = newest_artifact(checkpoints_dir, name, verifier, ARTIFACTS[name])
            if path is None:
                raise RuntimeError(
                    f"experiment={name} finished but exported no {ARTIFACTS[name]}/ for {verifier}"
                )
        log.info("%s: %s", name, path)
        found[name] = path
    return found


def train(experiment: str, overrides: Sequence[str]) -> None:
    """``python train.py experiment=<experiment> <overrides>``, its output passed through."""
    cmd = [sys.executable, str(PROJECT_ROOT / "train.py"), f"experiment={experiment}", *overrides]
    print(f"Training what the leaderboard needs: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"training experiment={experiment} failed (exit {proc.returncode}); its run log says why"
        )


def _decoder_nodes(cfg: DictConfig, names: Sequence[str], heads: str | None) -> list[Any]:
    """The named decoder configs, read here so ``${heads}`` resolves to the trained heads."""
    known = known_decoder_configs()
    nodes = []
    for name in names:
        require(name in known, "eval.decoders", f"names of conf/decoding/ configs ({sorted(known)})", name)
        node = OmegaConf.load(DECODING_CONF_DIR / f"{name}.yaml")
        node.name = name
        nodes.append(node)
    holder: Any = OmegaConf.to_container(OmegaConf.create({"heads": heads, "decoders": nodes}), resolve=True)
    return list(holder["decoders"])


def _eval_node(cfg: DictConfig) -> dict[Any, Any]:
    """The ``eval`` node, resolved, as a plain dict."""
    node = OmegaConf.to_container(cfg.eval, resolve=True)
    assert isinstance(node, dict)
    return node


def validate(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Every setting checked (errors name the key) before anything trains: the paths, model and data
    groups, the projection's settings, the experiments and the whole ``eval`` node with its decoders."""
    paths = instantiate_group(cfg, "paths")
    model_cfg = instantiate_group(cfg, "model")
    data_cfg = instantiate_group(cfg, "data")
    require(
        len(cfg.costs) >= 1 and all(c >= 0 for c in cfg.costs), "costs", "a list of ratios >= 0", cfg.costs
    )
    require(cfg.kappa >= 0, "kappa", ">= 0", cfg.kappa)
    require(
        cfg.experiments == "auto" or not isinstance(cfg.experiments, str),
        "experiments",
        "auto or a list of experiments",
        cfg.experiments,
    )
    for name in experiment_names(cfg, model_cfg):
        require(name in ARTIFACTS, "experiments", f"auto or a list drawn from {sorted(ARTIFACTS)}", name)
    build_eval_config({**_eval_node(cfg), "decoders": _decoder_nodes(cfg, list(cfg.eval.decoders), "HEADS")})
    resolve_devices(cfg.get("device"), cfg.get("drafter_device"))
    return paths, model_cfg, data_cfg


def main(cfg: DictConfig) -> dict[str, Any]:
    """``scripts/leaderboard.py``: artifacts, evaluations, the table."""
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    started = time.perf_counter()
    paths, model_cfg, data_cfg = validate(cfg)
    ensure_built_pair(model_cfg)
    artifacts = ensure_artifacts(
        cfg, experiment_names(cfg, model_cfg), paths.checkpoints_dir, model_cfg.verifier
    )
    run_dir = paths.run_dir
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))

    device, drafter_device = resolve_devices(cfg.get("device"), cfg.get("drafter_device"))
    pair = place_pair(load_pair(model_cfg, freeze_drafter=True), device, drafter_device)
    heads_dir = _artifact(artifacts, "medusa")
    names = list(cfg.eval.decoders)
    eval_node = _eval_node(cfg)
    eval_cfg = build_eval_config({**eval_node, "decoders": _decoder_nodes(cfg, names, heads_dir)})
    prompts = build_prompts(
        pair.tokenizer, data_cfg, eval_cfg.num_prompts, eval_cfg.prompt_len, seed=int(cfg.seed)
    )
    drafters = _load_drafters(model_cfg, pair, artifacts)
    _place_drafters(drafters, device, drafter_device)
    eos = eos_token_ids(pair.tokenizer, pair.verifier, pair.drafter)
    evaluations: dict[str, dict[str, Any]] = {}
    print(f"Evaluating {list(drafters)} under {names} ({len(prompts)} prompts)", flush=True)
    evaluations[str(model_cfg.name)] = evaluate_drafters(
        pair.verifier,
        drafters,
        prompts,
        eval_cfg,
        eos_token_id=eos,
        out_dir=os.path.join(run_dir, "eval_main"),
    )
    medusa2 = _artifact(artifacts, "medusa2")
    if medusa2:
        verifier2, heads2 = _load_medusa2(model_cfg, medusa2, device)
        cfg2 = build_eval_config({**eval_node, "decoders": _decoder_nodes(cfg, ["medusa"], medusa2)})
        print("Evaluating medusa-2 against its fine-tuned verifier", flush=True)
        evaluations[f"{model_cfg.name} + Medusa-2 LoRA"] = evaluate_drafters(
            verifier2,
            {"medusa-2": heads2},
            prompts,
            cfg2,
            eos_token_id=eos,
            out_dir=os.path.join(run_dir, "eval_medusa2"),
        )
    return _write_leaderboard(cfg, str(model_cfg.name), artifacts, evaluations, run_dir, started)


def _artifact(artifacts: Mapping[str, str], experiment: str) -> str | None:
    """The artifact of ``experiment`` (the real pair's recipe) or of its tiny-pair twin: one row either
    way."""
    return artifacts.get(experiment) or artifacts.get(f"{experiment}_tiny")


def _load_drafters(model_cfg: Any, pair: Any, artifacts: Mapping[str, str]) -> dict[str, Any]:
    """{row name: drafter} evaluated against the pair's verifier: the pair's own drafter, then each
    trained one whose artifact was found (the heads as they are, EAGLE-3 and DFlash in the verifier's
    dtype)."""
    drafters: dict[str, Any] = {"pretrained": pair.drafter}
    distilled = _artifact(artifacts, "distillspec")
    if distilled:
        drafters["distillspec"] = load_drafter(model_cfg, distilled, pair.tokenizer, pair.verifier)
    steer_dir = _artifact(artifacts, "steering")
    if steer_dir:
        steered = load_drafter(
            model_cfg, os.path.join(os.path.dirname(steer_dir), "drafter"), pair.tokenizer, pair.verifier
        )
        drafters["steered"] = SteeredDrafter(steered, SteeringModule.from_pretrained(steer_dir))
    heads_dir = _artifact(artifacts, "medusa")
    if heads_dir is not None:
        drafters["medusa-1"] = MedusaHeads.from_pretrained(heads_dir).eval()
    eagle3_dir = _artifact(artifacts, "eagle3")
    if eagle3_dir:
        weight = next(pair.verifier.parameters())
        drafters["eagle3"] = Eagle3Drafter.from_pretrained(eagle3_dir).eval().to(dtype=weight.dtype)
    for name in ("dflash", "dspark"):  # after EAGLE-3: their recipes read EAGLE-3's cached features;
        # dspark (DFlash with a Markov head) takes the same decoders under its own row
        folder = _artifact(artifacts, name)
        if folder:
            weight = next(pair.verifier.parameters())
            drafters[name] = DFlashDrafter.from_pretrained(folder).eval().to(dtype=weight.dtype)
    return drafters


def _place_drafters(drafters: Mapping[str, Any], device: Any, drafter_device: Any) -> None:
    """Heads, EAGLE-3 and DFlash read the verifier's states: on its device; the other drafters on the
    drafter's device (the verifier's when none is set). Frozen."""
    on_verifier = MedusaHeads | Eagle3Drafter | DFlashDrafter
    for model in drafters.values():
        placed = device if isinstance(model, on_verifier) else (drafter_device or device)
        model.to(placed).requires_grad_(False)


def _load_medusa2(model_cfg: Any, heads_dir: str, device: Any) -> tuple[Any, MedusaHeads]:
    """Medusa-2's fine-tuned verifier (saved beside its heads) and its heads, on ``device``."""
    verifier: Any = load_model(
        os.path.join(os.path.dirname(heads_dir), "verifier"), model_cfg.verifier_dtype or model_cfg.dtype
    )
    verifier.to(device)
    return verifier, MedusaHeads.from_pretrained(heads_dir).eval().to(device)


def _write_leaderboard(
    cfg: DictConfig,
    model_name: str,
    artifacts: Mapping[str, str],
    evaluations: Mapping[str, dict[str, Any]],
    run_dir: str,
    started: float,
) -> dict[str, Any]:
    """The leaderboard's rows from the evaluations, written as ``leaderboard.json``, ``leaderboard.md``
    and the speedup plot under ``run_dir`` and printed; returns leaderboard.json's payload."""
    rows = leaderboard_rows(
        evaluations, costs=list(cfg.costs), kappa=float(cfg.kappa), heads_drafters=("medusa-1", "medusa-2")
    )
    table = leaderboard_markdown(rows, kappa=float(cfg.kappa))
    elapsed = time.perf_counter() - started
    payload = {
        "schema": "draftsmith.leaderboard/1",
        "artifacts": artifacts,
        "costs": list(cfg.costs),
        "kappa": float(cfg.kappa),
        "rows": rows,
        "elapsed_seconds": elapsed,
    }
    with open(os.path.join(run_dir, "leaderboard.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(payload), f, indent=2, default=str)
    with open(os.path.join(run_dir, "leaderboard.md"), "w", encoding="utf-8") as f:
        f.write(f"# Leaderboard ({model_name})\n\n{_artifact_lines(artifacts)}\n\n{table}")
    plot_speedup_vs_block_efficiency(rows, os.path.join(run_dir, "speedup_vs_block_efficiency.png"))
    print(table)
    print(f"Leaderboard written to {run_dir} ({elapsed:.0f} s)")
    return payload


def _artifact_lines(artifacts: Mapping[str, str]) -> str:
    return "Artifacts: " + ", ".join(f"{name} `{path}`" for name, path in artifacts.items())


def plot_speedup_vs_block_efficiency(rows: Sequence[Mapping[str, Any]], path: str) -> str | None:
    """One panel per temperature: measured speedup against block efficiency, a point per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional (the bench extra)
        return None
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for r in rows:
            if r["temperature"] != t:
                continue
            tau = r["metrics"].get("block_efficiency", {}).get("mean", 1.0 if r["decoder"] == "ar" else None)
            sp = r["metrics"].get("speedup", {}).get("mean")
            if tau is None or sp is None:
                continue
            ax.scatter([tau], [sp])
            ax.annotate(f"{r['drafter']}/{r['decoder']}", (tau, sp), fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("block efficiency (tokens per verifier call)")
        ax.set_ylabel("measured speedup over autoregressive")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
