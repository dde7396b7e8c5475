"""Export a trained drafter as a Hugging Face folder, with a model card.

:func:`export_drafter` writes ``save_pretrained`` weights (safetensors), the tokenizer and a
``README.md`` model card: YAML front matter for the Hub, the evaluation table, the training config
and how to use the drafter as ``assistant_model`` in ``generate``. :func:`push_to_hub` uploads such
a folder with ``huggingface_hub`` (:mod:`train.export.hub`); the card is :mod:`train.export.model_card`.

Drafters that are not ``PreTrainedModel``s (Medusa heads, steering projections) are exported by
their own modules through ``huggingface_hub.PyTorchModelHubMixin`` (``save_pretrained`` /
``push_to_hub`` on an ``nn.Module`` that mixes it in); :func:`push_to_hub` uploads those folders too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.config import ConfigError
from train.export.model_card import write_model_card
from train.models.loading import CorruptModelError, check_weight_files
from train.models.lora import merge_lora

log = logging.getLogger(__name__)

__all__ = ["drafter_folder", "export_drafter", "verify_export"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


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


# ----------------------------------------------------------------------------- the Hub


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
            f"{folder} does not load as a model "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "re-export it from the run (its checkpoints/last.ckpt) before pushing"
        ) from err


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
