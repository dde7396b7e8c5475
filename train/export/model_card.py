"""The model card (``README.md``) of an exported drafter: Hub front matter, the evaluation table, the
training config (redacted, portable) and how to use the export: ``generate``'s ``assistant_model`` for a
transformers drafter, draftsmith's loader and evaluator for EAGLE-3 drafters, heads and steering modules,
``vllm serve`` for the vLLM layouts (``eagle3_speculators/``, ``heads_vllm/``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.evaluation import METRIC_LEGEND, results_table, to_jsonable
from train.export.kinds import export_kind
from train.export.redaction import describe_source, is_hub_id, path_roots, portable, scrub
from train.export.speculators import VLLM_AUX_LAYERS
from train.tables import format_metric, markdown_table

CARD_TAGS: tuple[str, ...] = ("speculative-decoding", "draftsmith", "drafter")
_CARD_COLUMNS: tuple[tuple[str, int], ...] = (
    ("acceptance_rate", 3),
    ("expected_acceptance", 3),
    ("block_efficiency", 2),
    ("mbsu", 2),
    ("tokens_per_second", 0),
    ("speedup", 2),
)


def _yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _per_temperature_table(evaluation: Mapping[str, Any]) -> str:
    """Markdown for ``{label: {temperature: {metric: {"mean", "std", "n"}}}}`` (e.g. before / after)."""
    rows = [
        [label, t, *(format_metric(metrics.get(key), digits) for key, digits in _CARD_COLUMNS)]
        for label, per_t in evaluation.items()
        for t, metrics in per_t.items()
    ]
    header = ["drafter", "T", *(key for key, _ in _CARD_COLUMNS)]
    return markdown_table(header, rows, align="ll" + "r" * len(_CARD_COLUMNS))


def _results_markdown(results: Mapping[str, Any] | str | None) -> str | None:
    if not results:
        return None
    if isinstance(results, str):
        return results.strip() + "\n"
    if "runs" in results:
        return results_table(results)
    if all(isinstance(v, Mapping) for v in results.values()):
        return _per_temperature_table(results)
    raise TypeError(
        "results must be evaluate_drafters' dictionary, {label: {temperature: metrics}} or Markdown text"
    )


KIND_NOUNS: dict[str, str] = {
    "drafter": "drafter",
    "dflash": "DFlash drafter",
    "dflash_speculators": "DFlash drafter (vLLM speculators format)",
    "eagle3": "EAGLE-3 drafter",
    "eagle3_speculators": "EAGLE-3 drafter (vLLM speculators format)",
    "heads": "prediction heads",
    "heads_vllm": "prediction heads (vLLM Medusa format)",
    "steering": "steering module",
}
"""What the card calls each export kind (:func:`train.export.kinds.export_kind`), in its title."""

COMPANION_SUFFIXES: dict[str, str] = {"dflash": "_speculators", "eagle3": "_speculators", "heads": "_vllm"}
"""The folder each kind's export writes beside it in a serving layout (``eagle3_speculators/``,
``heads_vllm/``): its card is rewritten with the main folder's."""

THIS_EXPORT = "PATH_OR_REPO_OF_THIS_DRAFTER"


def _what_it_is(kind: str, target: str) -> str:
    """The card's first paragraph: what the export is and what it does for the verifier."""
    if kind in ("eagle3", "eagle3_speculators"):
        what = (
            "An EAGLE-3 drafter trained with draftsmith: one decoder layer that reads the hidden states of "
            f"three layers of {target} and proposes tokens for it to check in one forward pass."
        )
    elif kind in ("dflash", "dflash_speculators"):
        what = (
            "A DFlash drafter trained with draftsmith: a few decoder layers that read the hidden states of "
            f"layers of {target} and propose a whole block of tokens in one forward pass, which the verifier "
            "checks in one forward pass."
        )
    elif kind in ("heads", "heads_vllm"):
        what = (
            "Prediction heads (Medusa) trained with draftsmith: they read the last hidden state of "
            f"{target} and propose its next tokens, which it checks in one forward pass."
        )
    elif kind == "steering":
        what = (
            "An SD^2 steering module trained with draftsmith: it biases a small drafter with the states of "
            f"{target}, which checks the drafter's tokens in one forward pass."
        )
    else:
        what = (
            "A drafter for speculative decoding trained with draftsmith: a small model that "
            f"proposes tokens for {target} to check in one forward pass."
        )
    return what + (
        " Lossless speculative decoding returns exactly the verifier's output distribution; the drafter "
        "only changes the speed."
    )


def _assistant_usage(verifier_ref: str) -> list[str]:
    return [
        "## Use it as an assistant model",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{verifier_ref}")',
        f'verifier = AutoModelForCausalLM.from_pretrained("{verifier_ref}")',
        f'drafter = AutoModelForCausalLM.from_pretrained("{THIS_EXPORT}")',
        'inputs = tokenizer("def fibonacci(n):", return_tensors="pt")',
        "out = verifier.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)",
        "print(tokenizer.decode(out[0]))",
        "```",
        "",
        "Or measure it with draftsmith's evaluator "
        "(speedup against autoregressive decoding on your machine):",
        "",
        "```bash",
        f"python scripts/evaluate.py drafter={THIS_EXPORT} decoding=sd gamma=4",
        "```",
    ]


def _draftsmith_usage(module: str, cls: str, evaluate: str, serving_note: str) -> list[str]:
    """A kind only draftsmith loads: its loader and the evaluator's command (and where vLLM's copy is)."""
    return [
        "## Use it with draftsmith",
        "",
        f"It is not a transformers model: load it with draftsmith's `{module}.{cls}`,",
        "",
        "```python",
        f"from {module} import {cls}",
        "",
        f'drafter = {cls}.from_pretrained("{THIS_EXPORT}")',
        "```",
        "",
        "or measure it with draftsmith's evaluator (speedup against autoregressive decoding on your "
        "machine):",
        "",
        "```bash",
        f"python scripts/evaluate.py {evaluate}",
        "```",
        "",
        serving_note,
    ]


def _vllm_usage(
    serve: list[str], verifier: str, speculative_config: Mapping[str, Any], note: str
) -> list[str]:
    """``vllm serve``: the folder's own command (``serve``, when vLLM reads the verifier from it), then the
    long form that names the verifier and the draft length."""
    long_form = f"vllm serve {verifier} --speculative-config '{json.dumps(dict(speculative_config))}'"
    if serve:
        serve = [*serve, "# or, naming the verifier (a Hub id or your copy of it) and the draft length:"]
    return ["## Serve it with vLLM", "", "```bash", *serve, long_form, "```", "", note]


def _dflash_vllm_usage(verifier_ref: str, folder: str, layout: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` for a speculators DFlash folder, or DSpark's (``speculators_model_type: dspark``)."""
    speculators = layout.get("speculators_config") or {}
    verifier = (speculators.get("verifier") or {}).get("name_or_path") or verifier_ref
    tokens = int((speculators.get("proposal_methods") or [{}])[0].get("speculative_tokens", 7))
    method = str(layout.get("speculators_model_type", "dflash"))
    markov = (
        f" Its Markov head (rank {layout.get('markov_rank')}) then biases each drafted token by the one "
        "before it, left to right."
        if method == "dspark"
        else ""
    )
    return _vllm_usage(
        [],
        verifier,
        {"model": f"./{folder}", "method": method, "num_speculative_tokens": tokens},
        f"vLLM's `{method}` method drafts a block of `num_speculative_tokens` tokens in one forward.{markov} "
        "The auxiliary layer ids are the verifier's `hidden_states` indices, and "
        "`sliding_window_non_causal: true` keeps the block non-causal, as it was trained.",
    )


def usage_section(kind: str, verifier_ref: str, folder: str, layout: Mapping[str, Any]) -> list[str]:
    """How to use an export of ``kind`` (:func:`train.export.kinds.export_kind`): the ``generate``
    snippet for a transformers drafter only; draftsmith's loader and evaluator for ``eagle3`` / ``heads`` /
    ``steering``; ``vllm serve`` for the vLLM layouts. folder: the export folder's name (vLLM's
    ``./<folder>``); layout: its ``config.json`` (the verifier a speculators folder names, the draft
    length, the number of heads)."""
    if kind == "eagle3":
        fused = len(layout.get("aux_layers") or [])
        serving = (
            f"vLLM serves its copy in the speculators format, "
            f"`{folder}{COMPANION_SUFFIXES[kind]}/` beside it."
            if fused == VLLM_AUX_LAYERS
            else f"vLLM's EAGLE-3 fuses exactly {VLLM_AUX_LAYERS} verifier layers and this drafter {fused}: "
            "it has no copy in the speculators format."
        )
        return _draftsmith_usage(
            "train.models.eagle3_drafter", "Eagle3Drafter", f"decoding=eagle3 eagle3={THIS_EXPORT}", serving
        )
    if kind == "dflash":
        return _draftsmith_usage(
            "train.models.dflash_drafter",
            "DFlashDrafter",
            f"decoding=dflash dflash={THIS_EXPORT}",
            f"vLLM serves its copy in the speculators format, "
            f"`{folder}{COMPANION_SUFFIXES[kind]}/` beside it.",
        )
    if kind == "dflash_speculators":
        return _dflash_vllm_usage(verifier_ref, folder, layout)
    if kind == "heads":
        return _draftsmith_usage(
            "train.models.heads",
            "MedusaHeads",
            f"decoding=medusa heads={THIS_EXPORT}",
            f"vLLM serves its copy in vLLM's Medusa layout, `{folder}{COMPANION_SUFFIXES[kind]}/` beside it.",
        )
    if kind == "steering":
        return _draftsmith_usage(
            "train.models.steering_module",
            "SteeringModule",
            f"decoding=steered drafter=PATH_OF_ITS_DRAFTER steering={THIS_EXPORT}",
            "Its drafter is the `drafter/` folder exported beside it.",
        )
    if kind == "eagle3_speculators":
        speculators = layout.get("speculators_config") or {}
        verifier = (speculators.get("verifier") or {}).get("name_or_path") or verifier_ref
        methods = speculators.get("proposal_methods") or [{}]
        tokens = int(methods[0].get("speculative_tokens", 3))
        return _vllm_usage(
            [f"vllm serve ./{folder}"],
            verifier,
            {"model": f"./{folder}", "method": "eagle3", "num_speculative_tokens": tokens},
            "vLLM reads `speculators_config` from `config.json` and loads the verifier named there. The "
            "auxiliary layer ids are the verifier's `hidden_states` indices (the stream entering each "
            "layer), vLLM's and speculators' convention. The draft vocabulary is `d2t` / `t2d`: draft "
            "index i is target id i + d2t[i].",
        )
    if kind == "heads_vllm":
        heads = int(layout.get("num_heads", 1))
        return _vllm_usage(
            [],
            verifier_ref,
            {"model": f"./{folder}", "method": "medusa", "num_speculative_tokens": heads},
            "vLLM drafts a top-1 chain from the heads (one token per head). Heads over a draft "
            "vocabulary are written with full-vocabulary rows (the others their mean, so vLLM's argmax "
            "stays in the draft vocabulary); `draft_vocab` in `config.json` names the trained rows.",
        )
    return _assistant_usage(verifier_ref)


# more than 8 parameters: the card's optional fields, each passed by name
def model_card(
    name: str,
    config: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | str | None = None,
    base_model: str | None = None,
    verifier: str | None = None,
    license: str | None = None,
    roots: Mapping[str, str] | None = None,
    kind: str = "drafter",
    folder: str = "drafter",
    layout: Mapping[str, Any] | None = None,
) -> str:
    """The README.md of an exported drafter (see :func:`export_drafter` for the arguments).

    kind: the export's kind (:func:`train.export.kinds.export_kind`), which decides the usage section
    (:func:`usage_section`) and whether the front matter names transformers as its library; folder and
    layout: the export folder's name and ``config.json``. Models are named by Hub id when they came
    from the Hub, else plainly as local folders; no absolute local path appears (``roots``: see
    :func:`path_roots`); credentials are redacted.
    """
    if kind not in KIND_NOUNS:
        raise ValueError(f"unknown export kind {kind!r}; one of {sorted(KIND_NOUNS)}")
    roots = roots if roots is not None else path_roots(config)
    front: dict[str, Any] = {"library_name": "transformers"} if kind == "drafter" else {}
    front.update(
        {
            "license": license or card_license(config),
            "pipeline_tag": "text-generation",
            "tags": list(CARD_TAGS),
        }
    )
    # The Hub validates base_model as a repo id; local folders are named in the text instead.
    if is_hub_id(base_model):
        front["base_model"] = base_model
    verifier_ref = verifier if verifier and is_hub_id(verifier) else "PATH_TO_THE_VERIFIER"
    paths = (config or {}).get("paths") if isinstance(config, Mapping) else None
    tiny_dir = paths.get("tiny_dir") if isinstance(paths, Mapping) else None
    target = f"the verifier `{verifier}`" if is_hub_id(verifier) else "its verifier (below)"
    lines = [
        "---",
        _yaml(front).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        _what_it_is(kind, target),
        "",
        f"- verifier (target): {describe_source(verifier, roots, tiny_dir)}",
        f"- initialised from: {describe_source(base_model, roots, tiny_dir)}",
        "",
        *usage_section(kind, verifier_ref, folder, layout or {}),
        "",
        "## Evaluation",
        "",
    ]
    table = _results_markdown(portable(results, roots) if isinstance(results, Mapping) else results)
    if table is None:
        lines += ["No evaluation was attached to this export.", ""]
    else:
        lines += [table.rstrip(), ""]
        if METRIC_LEGEND not in table:  # results_table carries it already
            lines += [METRIC_LEGEND, ""]
    lines += ["## Training configuration", ""]
    if config:
        lines += ["```yaml", _yaml(portable(scrub(config), roots)).rstrip(), "```", ""]
    else:
        lines += ["Not recorded.", ""]
    return "\n".join(lines)


DEFAULT_LICENSE = "apache-2.0"


def card_license(config: Mapping[str, Any] | None) -> str:
    """The card's ``license``: the run config's top-level ``license`` (conf/train.yaml), else Apache-2.0."""
    value = (config or {}).get("license") if isinstance(config, Mapping) else None
    return str(value) if value else DEFAULT_LICENSE


def write_model_card(
    folder: str | os.PathLike[str],
    config: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | str | None = None,
    base_model: str | None = None,
    verifier: str | None = None,
    name: str | None = None,
) -> Path:
    """(Re)write an export folder's ``README.md`` (and, with a results dictionary, ``eval_results.json``).

    The weights are not touched: the finish step writes the card once right after export and again
    with the evaluation table once the evaluation is done. The card fits the folder's kind
    (:func:`train.export.kinds.export_kind`; a folder without ``config.json`` is a drafter), and the
    serving copy exported beside an ``eagle3/`` or ``heads/`` folder (``eagle3_speculators/``,
    ``heads_vllm/``) gets its card from the same arguments. Arguments as in :func:`export_drafter`.
    """
    out = Path(folder)
    layout = _read_layout(out)
    kind = export_kind(out) if layout else "drafter"
    model_section = (config or {}).get("model") if isinstance(config, Mapping) else None
    if isinstance(model_section, Mapping):
        base_model = base_model or model_section.get("drafter")
        verifier = verifier or model_section.get("verifier")
    if name is None:
        run_name = (config or {}).get("name") if isinstance(config, Mapping) else None
        name = f"{run_name} {KIND_NOUNS[kind]}" if run_name else out.name
    roots = path_roots(config, out)
    if isinstance(results, Mapping) and results:
        payload = portable(to_jsonable(dict(results)), roots)
        (out / "eval_results.json").write_text(json.dumps(payload, indent=2) + "\n")
    card = model_card(
        name,
        config=config,
        results=results,
        base_model=base_model,
        verifier=verifier,
        roots=roots,
        kind=kind,
        folder=out.name,
        layout=layout,
    )
    path = out / "README.md"
    path.write_text(card, encoding="utf-8")
    companion = out.parent / f"{out.name}{COMPANION_SUFFIXES.get(kind, '')}"
    if companion != out and (companion / "config.json").is_file():
        write_model_card(companion, config=config, results=results, base_model=base_model, verifier=verifier)
    return path


def _read_layout(folder: Path) -> dict[str, Any]:
    """An export folder's ``config.json`` ({} when it has none)."""
    config_file = folder / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}
