"""The model card (``README.md``) of an exported drafter: Hub front matter, the evaluation table, the
training config (redacted, portable) and how to use the drafter with ``generate``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.evaluation import METRIC_LEGEND, results_table, to_jsonable
from train.export.redaction import describe_source, is_hub_id, path_roots, portable, scrub
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


def model_card(
    name: str,
    config: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | str | None = None,
    base_model: str | None = None,
    verifier: str | None = None,
    license: str | None = None,
    roots: Mapping[str, str] | None = None,
) -> str:
    """The README.md of an exported drafter (see :func:`export_drafter` for the arguments).

    Models are named by Hub id when they came from the Hub, else plainly as local folders; no
    absolute local path appears (``roots``: see :func:`path_roots`); credentials are redacted.
    """
    roots = roots if roots is not None else path_roots(config)
    front: dict[str, Any] = {
        "library_name": "transformers",
        "license": license or card_license(config),
        "pipeline_tag": "text-generation",
        "tags": list(CARD_TAGS),
    }
    # The Hub validates base_model as a repo id; local folders are named in the text instead.
    if is_hub_id(base_model):
        front["base_model"] = base_model
    verifier_ref = verifier if is_hub_id(verifier) else "PATH_TO_THE_VERIFIER"
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
        "A drafter for speculative decoding trained with draftsmith: a small model that "
        f"proposes tokens for {target} to check in one forward pass. Lossless speculative "
        "decoding returns exactly the verifier's output distribution; the drafter only changes the speed.",
        "",
        f"- verifier (target): {describe_source(verifier, roots, tiny_dir)}",
        f"- initialised from: {describe_source(base_model, roots, tiny_dir)}",
        "",
        "## Use it as an assistant model",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{verifier_ref}")',
        f'verifier = AutoModelForCausalLM.from_pretrained("{verifier_ref}")',
        'drafter = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO_OF_THIS_DRAFTER")',
        'inputs = tokenizer("def fibonacci(n):", return_tensors="pt")',
        "out = verifier.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)",
        "print(tokenizer.decode(out[0]))",
        "```",
        "",
        "Or measure it with draftsmith's evaluator (speedup against autoregressive decoding on your machine):",
        "",
        "```bash",
        "python scripts/evaluate.py drafter=PATH_OR_REPO_OF_THIS_DRAFTER decoding=sd gamma=4",
        "```",
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
    with the evaluation table once the evaluation is done. Arguments as in :func:`export_drafter`.
    """
    out = Path(folder)
    model_section = (config or {}).get("model") if isinstance(config, Mapping) else None
    if isinstance(model_section, Mapping):
        base_model = base_model or model_section.get("drafter")
        verifier = verifier or model_section.get("verifier")
    if name is None:
        run_name = (config or {}).get("name") if isinstance(config, Mapping) else None
        name = f"{run_name} drafter" if run_name else out.name
    roots = path_roots(config, out)
    if isinstance(results, Mapping) and results:
        payload = portable(to_jsonable(dict(results)), roots)
        (out / "eval_results.json").write_text(json.dumps(payload, indent=2) + "\n")
    card = model_card(
        name, config=config, results=results, base_model=base_model, verifier=verifier, roots=roots
    )
    path = out / "README.md"
    path.write_text(card, encoding="utf-8")
    return path
