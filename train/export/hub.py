"""Pushing an export folder to the Hugging Face Hub: :class:`HubConfig` (conf/export.yaml's ``hub``) and
:func:`push_to_hub`. The token comes from the ``HF_TOKEN`` environment variable only and is never written."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, require
from train.export.drafter import WEIGHT_FILES, verify_export
from train.export.redaction import REPO_ID

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
    verify_export(folder, transformers_folder=has_hf_weights)
    return files
