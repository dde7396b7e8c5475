"""Pushing an export folder to the Hugging Face Hub: :class:`HubConfig` (conf/export.yaml's ``hub``) and
:func:`push_to_hub`. The token comes from the ``HF_TOKEN`` environment variable only and is never written."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, require
from train.export.dflash_speculators import load_dflash_speculators
from train.export.drafter import WEIGHT_FILES, verify_export
from train.export.kinds import export_kind
from train.export.medusa_layout import load_vllm_medusa
from train.export.redaction import REPO_ID
from train.export.speculators import load_speculators
from train.models.dflash_drafter import DFlashDrafter
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.models.loading import CorruptModelError
from train.models.steering_module import SteeringModule

log = logging.getLogger(__name__)

HF_TOKEN_ENV = "HF_TOKEN"


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
            isinstance(self.repo_id, str) and bool(REPO_ID.match(self.repo_id)),
            "hub.repo_id",
            "a Hub repository id like 'me/my-drafter'",
            self.repo_id,
        )
        require(isinstance(self.private, bool), "hub.private", "true or false", self.private)
        require(isinstance(self.dry_run, bool), "hub.dry_run", "true or false", self.dry_run)
        require(bool(self.commit_message), "hub.commit_message", "a non-empty string", self.commit_message)


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
    files = check_folder(path)
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
    existed = api.repo_exists(repo_id, repo_type="model")
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    report["warnings"] = []
    if existed and private and not api.repo_info(repo_id, repo_type="model").private:
        report["warnings"].append(public_repo_warning(repo_id))
        log.warning(report["warnings"][-1])
    if revision is not None:  # upload_folder refuses a branch that does not exist yet
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        folder_path=str(path),
        repo_id=repo_id,
        repo_type="model",
        commit_message=commit_message,
        revision=revision,
    )
    report["url"] = str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")
    return report


def public_repo_warning(repo_id: str) -> str:
    """What a push with ``hub.private=true`` says of a repository that already exists and is public:
    ``create_repo(exist_ok=True)`` leaves its visibility as it is."""
    return (
        f"{repo_id} already exists and is PUBLIC: hub.private=true does not change an existing repository, "
        f"so this push is public. Make it private in its settings on the Hub "
        f"(or HfApi().update_repo_settings({repo_id!r}, private=True))"
    )


LOADERS: dict[str, Callable[[str], Any]] = {
    "dflash": functools.partial(DFlashDrafter.from_pretrained, strict=True),
    "dflash_speculators": load_dflash_speculators,
    "eagle3": functools.partial(Eagle3Drafter.from_pretrained, strict=True),
    "eagle3_speculators": load_speculators,
    "heads": functools.partial(MedusaHeads.from_pretrained, strict=True),
    "heads_vllm": load_vllm_medusa,
    "steering": functools.partial(SteeringModule.from_pretrained, strict=True),
}
"""The project's own loader of each export kind but ``drafter`` (``AutoModelForCausalLM``,
:func:`train.export.drafter.verify_export`)."""


def verify_kind(folder: Path, kind: str) -> None:
    """``folder`` loads with its kind's loader; raises :class:`CorruptModelError` naming the folder."""
    if kind == "drafter":
        verify_export(folder, transformers_folder=True)
        return
    verify_export(folder, transformers_folder=False)  # every safetensors file parses to its end
    try:
        LOADERS[kind](str(folder))
    except Exception as err:
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise CorruptModelError(
            f"{folder} does not load as an export of kind {kind} ({type(err).__name__}: {first_line}); "
            "re-export it from the run before pushing"
        ) from err


def check_folder(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise FileNotFoundError(f"no export folder at {folder}")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    has_hf_weights = "config.json" in files and any(f in files for f in WEIGHT_FILES)
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
    verify_kind(folder, export_kind(folder) if has_hf_weights else "steering")
    return files
