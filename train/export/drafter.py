"""Export a trained drafter as a Hugging Face folder, with a model card, and push it to the Hub.

:func:`export_drafter` writes ``save_pretrained`` weights (safetensors), the tokenizer and a
``README.md`` model card: YAML front matter for the Hub, the evaluation table, the training config
and how to use the drafter as ``assistant_model`` in ``generate``. :func:`push_to_hub` uploads such
a folder with ``huggingface_hub``; the token comes from the ``HF_TOKEN`` environment variable only
and is never written anywhere. ``main(cfg)`` is the body of ``scripts/export.py`` (conf/export.yaml).

Drafters that are not ``PreTrainedModel``s (Medusa heads, steering projections) are exported by
their own modules through ``huggingface_hub.PyTorchModelHubMixin`` (``save_pretrained`` /
``push_to_hub`` on an ``nn.Module`` that mixes it in); :func:`push_to_hub` uploads those folders too.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, instantiate_group, require
from train.evaluation import METRIC_LEGEND, results_table, to_jsonable
from train.models.loading import CorruptModelError, check_weight_files
from train.models.lora import merge_lora
from train.paths import project_root
from train.tables import format_metric, markdown_table

log = logging.getLogger(__name__)

__all__ = [
    "CARD_TAGS",
    "SECRET_KEYS",
    "is_secret",
    "portable",
    "portable_path",
    "HubConfig",
    "drafter_folder",
    "export_drafter",
    "main",
    "model_card",
    "push_to_hub",
    "write_model_card",
]

CARD_TAGS: tuple[str, ...] = ("speculative-decoding", "draftsmith", "drafter")
HF_TOKEN_ENV = "HF_TOKEN"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
#: Keys whose value is a credential, compared exactly (lower case): ``max_new_tokens`` or
#: ``pad_token_id`` are settings, not secrets.
SECRET_KEYS = frozenset(
    {"token", "hf_token", "hub_token", "access_token", "auth_token", "api_token", "wandb_token", "bearer"}
)
#: Words that mark a key as a credential wherever they appear in it (``wandb_api_key``, ``db_password``).
_SECRET_WORD = re.compile(r"api_?key|password|passwd|secret|credential", re.IGNORECASE)
#: Values that are credentials whatever their key: Hugging Face tokens, W&B keys (40 hex), OpenAI-style keys.
_SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|[0-9a-f]{40}|sk-[A-Za-z0-9_-]{20,})$")
_HASH_KEY = re.compile(r"revision|commit|sha|hash|fingerprint", re.IGNORECASE)
_CREDENTIAL_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
REDACTED = "<redacted>"


def _is_hub_id(source: str | None) -> bool:
    return bool(source) and bool(_REPO_ID.match(str(source))) and not os.path.exists(str(source))


def is_secret(key: str, value: Any) -> bool:
    """A credential by its key name (exactly, or containing a credential word) or by its value."""
    if str(key).lower() in SECRET_KEYS or _SECRET_WORD.search(str(key)):
        return True
    if not isinstance(value, str) or not value:
        return False
    if any(value == os.environ.get(var) for var in _CREDENTIAL_ENV):
        return True
    return bool(_SECRET_VALUE.match(value)) and not _HASH_KEY.search(str(key))


def _scrub(value: Any, key: str = "") -> Any:
    """Credentials replaced by ``<redacted>`` at any depth (cards and logs never carry secrets)."""
    if isinstance(value, Mapping):
        return {str(k): REDACTED if is_secret(str(k), v) else _scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [REDACTED if is_secret(key, v) else _scrub(v, key) for v in value]
    return value


def portable_path(path: str, roots: Mapping[str, str]) -> str:
    """An absolute local path as something that means the same on another machine: relative to the
    first of ``roots`` (label -> absolute folder) that holds it, ``<label>/rest``; otherwise
    ``<local>/<last two parts>``. Anything else is returned as it is."""
    if not isinstance(path, str) or not os.path.isabs(os.path.expanduser(path)):
        return path
    full = os.path.normpath(os.path.expanduser(path))
    for label, root in roots.items():
        root = os.path.normpath(root)
        if full == root or full.startswith(root + os.sep):
            rest = os.path.relpath(full, root)
            return label if rest == "." else f"{label}/{rest}" if label else rest
    parts = full.strip(os.sep).split(os.sep)
    return "<local>/" + "/".join(parts[-2:])


def portable(value: Any, roots: Mapping[str, str]) -> Any:
    """:func:`portable_path` on every string of a nested structure (a config, an evaluation)."""
    if isinstance(value, Mapping):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v, roots) for v in value]
    return portable_path(value, roots) if isinstance(value, str) else value


def path_roots(
    config: Mapping[str, Any] | None, out_dir: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """Where a card's paths are made relative to: the run directory (``.``), then the project root
    (paths relative to the checkout, e.g. ``checkpoints/tiny/verifier``)."""
    roots: dict[str, str] = {}
    paths = (config or {}).get("paths") if isinstance(config, Mapping) else None
    run_dir = paths.get("run_dir") if isinstance(paths, Mapping) else None
    if not run_dir and out_dir is not None:
        run_dir = os.path.dirname(os.path.abspath(out_dir))
    if run_dir:
        roots["."] = os.path.abspath(str(run_dir))
    root = paths.get("root_dir") if isinstance(paths, Mapping) else None
    roots[""] = os.path.abspath(str(root)) if root else project_root()
    return roots


def describe_source(source: str | None, roots: Mapping[str, str], tiny_dir: str | None = None) -> str:
    """How the card names a model: its Hub id, or plainly a local folder that is not on the Hub (the
    embedded tiny pair says how to rebuild it)."""
    if not source:
        return "unknown"
    if _is_hub_id(source):
        return f"`{source}` (Hugging Face Hub)"
    full = os.path.abspath(os.path.expanduser(source))
    where = f"local folder `{portable_path(full, roots)}` (not on the Hub"
    if tiny_dir and full.startswith(os.path.abspath(tiny_dir) + os.sep):
        where += "; draftsmith's embedded tiny pair, rebuilt by `python train.py experiment=tiny_pair`"
    return where + ")"


def _yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True)


_CARD_COLUMNS: tuple[tuple[str, int], ...] = (
    ("acceptance_rate", 3),
    ("expected_acceptance", 3),
    ("block_efficiency", 2),
    ("mbsu", 2),
    ("tokens_per_second", 0),
    ("speedup", 2),
)


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
    if _is_hub_id(base_model):
        front["base_model"] = base_model
    verifier_ref = verifier if _is_hub_id(verifier) else "PATH_TO_THE_VERIFIER"
    paths = (config or {}).get("paths") if isinstance(config, Mapping) else None
    tiny_dir = paths.get("tiny_dir") if isinstance(paths, Mapping) else None
    target = f"the verifier `{verifier}`" if _is_hub_id(verifier) else "its verifier (below)"
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
        lines += ["```yaml", _yaml(portable(_scrub(config), roots)).rstrip(), "```", ""]
    else:
        lines += ["Not recorded.", ""]
    return "\n".join(lines)


DEFAULT_LICENSE = "apache-2.0"


def card_license(config: Mapping[str, Any] | None) -> str:
    """The card's ``license``: the run config's top-level ``license`` (conf/train.yaml), else Apache-2.0."""
    value = (config or {}).get("license") if isinstance(config, Mapping) else None
    return str(value) if value else DEFAULT_LICENSE


def export_drafter(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    config: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | str | None = None,
    base_model: str | None = None,
    verifier: str | None = None,
    name: str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face folder at ``out_dir``; return the folder.

    model: a ``transformers.PreTrainedModel`` (a peft/LoRA model is merged into a copy first; the
    trained module is left as it is). tokenizer: saved next to it (None: not saved).
    config: the run's resolved config, rendered as YAML in the card (credential-like keys dropped).
    results: the evaluation, in one of three shapes: what :func:`train.evaluation.evaluate_drafters`
    returned, ``{label: {temperature: {metric: {"mean", "std", "n"}}}}`` (a report's before / after,
    :func:`train.evaluation.by_temperature`), or ready Markdown text; dictionaries are also written as
    ``eval_results.json``.
    base_model: where the drafter started (a Hub id goes into the card's front matter; default: the
    config's ``model.drafter``). verifier: the verifier's Hub id or path for the card's usage snippet
    (default: the config's ``model.verifier``). name: the card's title (default: ``<config name> drafter``).
    Files: ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer files,
    ``README.md`` and, with a results dictionary, ``eval_results.json``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = merge_lora(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"export_drafter needs a transformers PreTrainedModel, got {type(model).__name__}")
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    write_model_card(out, config=config, results=results, base_model=base_model, verifier=verifier, name=name)
    log.info("Exported the drafter to %s", out)
    return out


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


# ----------------------------------------------------------------------------- the Hub


@dataclass
class HubConfig:
    """Where ``scripts/export.py`` pushes (``hub.*`` in conf/export.yaml). The token is ``$HF_TOKEN``."""

    repo_id: str
    private: bool = True
    dry_run: bool = False
    commit_message: str = "Upload drafter exported by draftsmith"
    revision: str | None = None

    def __post_init__(self) -> None:
        require(
            isinstance(self.repo_id, str) and bool(_REPO_ID.match(self.repo_id)),
            "hub.repo_id",
            "a Hub repository id like 'me/my-drafter'",
            self.repo_id,
        )
        require(isinstance(self.private, bool), "hub.private", "true or false", self.private)
        require(isinstance(self.dry_run, bool), "hub.dry_run", "true or false", self.dry_run)
        require(bool(self.commit_message), "hub.commit_message", "a non-empty string", self.commit_message)


def _check_folder(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise FileNotFoundError(f"no export folder at {folder}")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    has_hf_weights = "config.json" in files and any(f in files for f in _WEIGHT_FILES)
    has_mixin_weights = "model.safetensors" in files  # PyTorchModelHubMixin folders (heads, steering)
    if not (has_hf_weights or has_mixin_weights):
        raise FileNotFoundError(
            f"{folder} holds no safetensors weights (config.json + model.safetensors); "
            "export the drafter first"
        )
    if "README.md" not in files:
        raise FileNotFoundError(
            f"{folder} has no model card (README.md); export it with train.export.drafter.export_drafter"
        )
    verify_export(folder, transformers_folder=has_hf_weights)
    return files


#: Exports up to this size are loaded in full by :func:`verify_export`; larger ones get header checks.
FULL_LOAD_LIMIT_BYTES = 4 << 30


def verify_export(folder: Path, transformers_folder: bool = True) -> None:
    """What a push would upload must load: every safetensors file parses to its declared end
    (:func:`train.models.loading.check_weight_files`), and a transformers folder up to
    :data:`FULL_LOAD_LIMIT_BYTES` loads with ``AutoModelForCausalLM`` (larger: its config loads).
    Raises :class:`~train.models.loading.CorruptModelError` naming the file or folder."""
    check_weight_files(str(folder))
    if not transformers_folder:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    try:
        if size <= FULL_LOAD_LIMIT_BYTES:
            AutoModelForCausalLM.from_pretrained(str(folder))
        else:
            AutoConfig.from_pretrained(str(folder))
    except Exception as err:
        raise CorruptModelError(
            f"{folder} does not load as a model ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "re-export it from the run (its checkpoints/last.ckpt) before pushing"
        ) from err


def push_to_hub(
    folder: str | os.PathLike[str],
    repo_id: str,
    private: bool = True,
    dry_run: bool = False,
    commit_message: str = "Upload drafter exported by draftsmith",
    revision: str | None = None,
) -> dict[str, Any]:
    """Upload an exported folder to the Hub repository ``repo_id`` (created if missing).

    The token is read from ``$HF_TOKEN`` only (never from a config, never written). ``dry_run``
    loads and checks the folder (:func:`verify_export`) and the repo id and lists the files without
    any network access; a real push runs the same checks first.
    Returns ``{"repo_id", "files", "dry_run", "url"}``.
    """
    HubConfig(
        repo_id=repo_id, private=private, dry_run=dry_run, commit_message=commit_message, revision=revision
    )
    path = Path(folder)
    files = _check_folder(path)
    report: dict[str, Any] = {
        "repo_id": repo_id,
        "folder": str(path),
        "files": files,
        "dry_run": dry_run,
        "url": None,
    }
    if dry_run:
        return report
    token = os.environ.get(HF_TOKEN_ENV)
    if not token:
        raise ConfigError(
            f"set the {HF_TOKEN_ENV} environment variable to a Hub write token to push "
            "(tokens are read from the environment only)"
        )
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        folder_path=str(path),
        repo_id=repo_id,
        repo_type="model",
        commit_message=commit_message,
        revision=revision,
    )
    report["url"] = str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")
    return report


def drafter_folder(run: str | os.PathLike[str]) -> Path:
    """The exported drafter of a run directory (``run/drafter``), or ``run`` itself when it is an export."""
    path = Path(os.path.expanduser(str(run)))
    if not path.is_dir():
        raise ConfigError(f"run: no directory at {str(run)!r}")
    if (path / "drafter").is_dir():
        return path / "drafter"
    if (path / "config.json").is_file() or (path / "model.safetensors").is_file():
        return path
    raise ConfigError(
        f"run: {str(run)!r} has no drafter/ folder (was the run finished and exported?) "
        "and is not an exported drafter folder itself"
    )


def main(cfg: Any) -> dict[str, Any]:
    """``scripts/export.py``: push a run's exported ``drafter/`` (or any export folder) to the Hub."""
    from omegaconf import OmegaConf

    run = OmegaConf.select(cfg, "run", throw_on_missing=False)
    require(
        isinstance(run, str) and bool(run), "run", "a run directory (with drafter/) or an export folder", run
    )
    hub: HubConfig = instantiate_group(cfg, "hub")
    folder = drafter_folder(run)
    report = push_to_hub(
        folder,
        hub.repo_id,
        private=hub.private,
        dry_run=hub.dry_run,
        commit_message=hub.commit_message,
        revision=hub.revision,
    )
    verb = "Would upload" if hub.dry_run else "Uploaded"
    print(f"{verb} {len(report['files'])} files from {folder} to {hub.repo_id}:")
    for f in report["files"]:
        print(f"  {f}")
    if report["url"]:
        print(report["url"])
    return report
