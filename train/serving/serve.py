"""Serve a run's exports in vLLM and set vLLM's figures beside this project's evaluator's on the same
drafter and prompts (``python scripts/serve_vllm.py RUN_DIR``, docs/serving.md).

For the run's verifier (its ``config.yaml``: model path and dtype) and its held-out prompts (the prompts
its own evaluation decoded: the data config's test split, the run's seed), at T = 0:

1. vLLM alone: each prompt decoded by itself (batch 1), then all in one batch;
2. per export vLLM serves (:mod:`train.serving.exports`): vLLM with the export as its speculator, the
   same passes, and its ``spec_decode`` counters over the batch-1 pass;
3. this project's evaluator on the same export folder (read back with this project's loader for that
   layout) under the chain vLLM drafts, paired with its own plain decoding.

A row per export and engine: acceptance per position, block efficiency, tokens/s alone and with
speculation, and whether the greedy output with speculation equals the engine's own without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from train.config import instantiate_group
from train.evaluation import build_prompts, evaluate_drafters, find_run
from train.evaluation.greedy import classify_difference
from train.evaluation.runner import Generation
from train.export.hub import LOADERS
from train.models.loading import eos_token_ids, load_model, load_tokenizer
from train.serving.exports import ServedExport, served_export, served_exports
from train.serving.figures import ours_figures, serving_table, tokens_per_second, vllm_figures
from train.vllm.run import VllmRunError, run_vllm_job

log = logging.getLogger(__name__)

__all__ = ["RunPrompts", "run_prompts", "serve_run"]


class RunPrompts:
    """A run's verifier, dtype, tokenizer and held-out prompts (what its evaluation decoded)."""

    def __init__(self, run_dir: Path, num_prompts: int | None, prompt_len: int | None) -> None:
        config_file = run_dir / "config.yaml"
        if not config_file.is_file():
            raise FileNotFoundError(f"{run_dir}: no config.yaml, not a training run directory")
        cfg = OmegaConf.load(config_file)
        assert isinstance(cfg, DictConfig)
        self.verifier = str(cfg.model.verifier)
        self.dtype = str(cfg.model.get("dtype") or "float32")
        self.tokenizer = load_tokenizer(
            str(cfg.model.get("tokenizer") or self.verifier), role="model.verifier"
        )
        eval_cfg = cfg.get("eval") or {}
        count = num_prompts or int(eval_cfg.get("num_prompts", 8))
        length = prompt_len or int(eval_cfg.get("prompt_len", 256))
        data = instantiate_group(cfg, "data")
        self.prompts = build_prompts(self.tokenizer, data, count, length, seed=int(cfg.get("seed", 0)))
        #: Greedy differences within this many ulps of the top logit are ties (the run's eval.tie_ulps).
        self.tie_ulps = float(eval_cfg.get("tie_ulps", 4.0))


def run_prompts(
    run_dir: str | os.PathLike[str], num_prompts: int | None = None, prompt_len: int | None = None
) -> RunPrompts:
    return RunPrompts(Path(run_dir), num_prompts, prompt_len)


def _vllm_job(
    run: RunPrompts, eos: list[int], max_new_tokens: int, served: ServedExport | None
) -> dict[str, Any]:
    longest = max(int(p.numel()) for p in run.prompts)
    return {
        "mode": "decode",
        "model": run.verifier,
        "dtype": run.dtype,
        "max_model_len": longest + max_new_tokens + 16,
        "seed": 0,
        "speculative_config": None if served is None else served.speculative_config(),
        "prompts": [p.reshape(-1).tolist() for p in run.prompts],
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": eos,
    }


def _load_export(served: ServedExport, dtype: str) -> torch.nn.Module:
    if served.kind == "drafter":
        return load_model(str(served.folder), dtype=dtype, role="drafter")
    module: torch.nn.Module = LOADERS[served.kind](str(served.folder))
    return module.to(getattr(torch, dtype))


def _ours(
    verifier: torch.nn.Module, run: RunPrompts, served: ServedExport, eos: list[int], max_new_tokens: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """This project's evaluator on the export under vLLM's chain: (figures with the greedy equality of its
    outputs to its own plain decoding's, those plain outputs)."""
    entry = served.decoder_entry()
    outputs: dict[tuple[str, int], list[int]] = {}

    def keep(gen: Generation) -> None:
        outputs[(gen.decoder, gen.prompt_index)] = gen.tokens

    cfg = {
        "temperatures": [0.0],
        "seeds": [0],
        "decoders": [entry],
        "num_prompts": len(run.prompts),
        "max_new_tokens": max_new_tokens,
        "tie_ulps": run.tie_ulps,
        "num_threads": None,
        "progress": False,
        "plots": False,
    }
    drafter = _load_export(served, run.dtype)
    results = evaluate_drafters(
        verifier, {served.kind: drafter}, run.prompts, cfg, eos_token_id=eos, on_output=keep
    )
    metrics = find_run(results, served.kind, 0.0, entry["name"])["metrics"]
    figures = ours_figures(metrics, served.num_speculative_tokens)
    figures["tokens_per_second"] = float(metrics["tokens_per_second"]["mean"])
    figures["tokens_per_second_alone"] = float(results["baseline"][0]["metrics"]["tokens_per_second"]["mean"])
    n = len(run.prompts)
    speculative = [outputs[(entry["name"], i)] for i in range(n)]
    plain = [outputs[("ar", i)] for i in range(n)]
    figures["equality"] = greedy_equality(verifier, run.prompts, plain, speculative, run.tie_ulps)
    figures["greedy_equal"] = equality_cell(figures["equality"])
    return figures, plain


def greedy_equality(
    verifier: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    reference: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    tie_ulps: float,
) -> dict[str, Any]:
    """How many ``outputs`` equal their ``reference`` greedy output, and each difference classified as the
    evaluator classifies them (:func:`~train.evaluation.greedy.classify_difference`: the verifier's float32
    logits at the first differing position; a tie when both tokens lie within ``tie_ulps`` ulps of the top
    logit in the verifier's dtype)."""
    records = [
        classify_difference(verifier, p, list(r), list(o), tie_ulps)
        for p, r, o in zip(prompts, reference, outputs, strict=True)
    ]
    differences = [{"prompt": i, **r} for i, r in enumerate(records) if r is not None]
    return {
        "n": len(records),
        "equal": sum(r is None for r in records),
        "ties": sum(bool(d["tie"]) for d in differences),
        "tie_ulps": tie_ulps,
        "differences": differences,
    }


def equality_cell(equality: dict[str, Any]) -> str:
    """``yes``; else ``6/8, 2 ties (<= 16 ulp)``, a difference no tie adding ``1 NOT A TIE (40 ulp)``."""
    n, equal, ties = equality["n"], equality["equal"], equality["ties"]
    if equal == n:
        return "yes"
    cell = f"{equal}/{n}"
    if ties:
        cell += f", {ties} tie{'' if ties == 1 else 's'} (<= {equality['tie_ulps']:g} ulp)"
    real = [d for d in equality["differences"] if not d["tie"]]
    if real:
        worst = max((d["margin_ulps"] for d in real if d["margin_ulps"] is not None), default=None)
        margin = f" ({worst:.0f} ulp)" if worst is not None else " (one output ended early)"
        cell += f", {len(real)} NOT A TIE{margin}"
    return cell


def serve_run(
    run_dir: str | os.PathLike[str],
    folders: Sequence[str | os.PathLike[str]] = (),
    num_speculative_tokens: int = 4,
    num_prompts: int | None = None,
    prompt_len: int | None = None,
    max_new_tokens: int = 64,
    python: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Serve ``folders`` (default: every export in ``run_dir`` vLLM serves) and write ``serving.json`` and
    ``serving.md`` to ``out_dir`` (default ``<run_dir>/vllm``); return what ``serving.json`` holds."""
    run_path = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_path / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    exports = _exports(run_path, folders, num_speculative_tokens)
    run = run_prompts(run_path, num_prompts, prompt_len)
    verifier = load_model(run.verifier, dtype=run.dtype, role="model.verifier").eval()
    eos = eos_token_ids(run.tokenizer, verifier)
    log_file = out / "vllm.log"
    plain = run_vllm_job(_vllm_job(run, eos, max_new_tokens, None), python, log_file=log_file)
    plain_tps = tokens_per_second(plain["outputs"], plain["seconds"])
    rows = []
    for served in exports:
        print(
            f"serving {served.folder} in vLLM ({served.method}, {served.num_speculative_tokens} tokens)",
            flush=True,
        )
        try:
            spec = run_vllm_job(_vllm_job(run, eos, max_new_tokens, served), python, log_file=log_file)
        except VllmRunError as err:  # this export refused (a method this build cannot run): say why, go on
            print(f"vLLM did not serve {served.folder.name} ({served.method}): {err.reason}", flush=True)
            ours, _ = _ours(verifier, run, served, eos, max_new_tokens)
            rows.append(_refused_row(served, plain["vllm_version"], err.reason, ours))
            continue
        vllm = _vllm_side(verifier, run, plain, spec)
        ours, our_plain = _ours(verifier, run, served, eos, max_new_tokens)
        # vLLM's plain greedy tokens against this project's verifier's (float32 kernels differ)
        plain_equality = greedy_equality(verifier, run.prompts, our_plain, plain["outputs"], run.tie_ulps)
        rows.append(_row(served, spec, vllm, ours, equality_cell(plain_equality)))
    report = {
        "run_dir": str(run_path),
        "verifier": run.verifier,
        "dtype": run.dtype,
        "prompts": len(run.prompts),
        "max_new_tokens": max_new_tokens,
        "vllm_plain": {"tokens_per_second": plain_tps, "startup_seconds": plain["startup_seconds"]},
        "rows": rows,
    }
    _write_report(report, out)
    return report


def _exports(
    run_path: Path, folders: Sequence[str | os.PathLike[str]], num_speculative_tokens: int
) -> list[ServedExport]:
    """The exports named by ``folders``, else every one in the run vLLM serves; at least one."""
    exports = (
        [served_export(f, num_speculative_tokens) for f in folders]
        if folders
        else served_exports(run_path, num_speculative_tokens)
    )
    if not exports:
        raise FileNotFoundError(
            f"{run_path}: no export vLLM serves "
            "(drafter/, heads_vllm/, eagle3_speculators/, dflash_speculators/)"
        )
    return exports


def _vllm_side(
    verifier: torch.nn.Module, run: RunPrompts, plain: dict[str, Any], spec: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's figures for one export from its speculative job and its plain one: acceptance, tokens/s
    alone and speculative (batch 1 and the whole batch), the greedy equality of the two jobs' outputs."""
    vllm = vllm_figures(spec["spec"])
    vllm["tokens_per_second"] = tokens_per_second(spec["outputs"], spec["seconds"])
    vllm["tokens_per_second_alone"] = tokens_per_second(plain["outputs"], plain["seconds"])
    vllm["batch_tokens_per_second"] = spec["batch_tokens"] / spec["batch_seconds"]
    vllm["batch_tokens_per_second_alone"] = plain["batch_tokens"] / plain["batch_seconds"]
    vllm["equality"] = greedy_equality(verifier, run.prompts, plain["outputs"], spec["outputs"], run.tie_ulps)
    vllm["greedy_equal"] = equality_cell(vllm["equality"])
    return vllm


def _row(
    served: ServedExport,
    spec: dict[str, Any],
    vllm: dict[str, Any],
    ours: dict[str, Any],
    vllm_plain_equals_ours: str,
) -> dict[str, Any]:
    """``serving.json``'s row for one export: both engines' figures side by side."""
    return {
        "export": served.folder.name,
        "folder": str(served.folder),
        "method": served.method,
        "num_speculative_tokens": served.num_speculative_tokens,
        "vllm_version": spec["vllm_version"],
        "startup_seconds": spec["startup_seconds"],
        "vllm": vllm,
        "ours": ours,
        "vllm_plain_equals_ours": vllm_plain_equals_ours,
        "vllm_outputs": spec["outputs"],
    }


def _refused_row(served: ServedExport, version: str, reason: str, ours: dict[str, Any]) -> dict[str, Any]:
    """``serving.json``'s row for an export vLLM refused: its reason where vLLM's figures would be, this
    project's figures beside it."""
    return {
        "export": served.folder.name,
        "folder": str(served.folder),
        "method": served.method,
        "num_speculative_tokens": served.num_speculative_tokens,
        "vllm_version": version,
        "refused": reason,
        "vllm": None,
        "ours": ours,
    }


def _write_report(report: dict[str, Any], out: Path) -> None:
    table = serving_table(report["rows"])
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    (out / "serving.md").write_text(table + "\n")
    print(table, flush=True)
    print(f"written to {out}", flush=True)
