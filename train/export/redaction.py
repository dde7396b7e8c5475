"""What an export may say about a run: secrets redacted, local paths made portable.

A config copied into a model card or ``results.json`` passes through :func:`portable` (paths under the
project, the checkpoints or the home folder written relative to them) and the secret filter
(:func:`is_secret`: keys that name credentials, values that look like tokens; hashes are kept).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from train.paths import project_root

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")

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


def is_hub_id(source: str | None) -> bool:
    return bool(source) and bool(REPO_ID.match(str(source))) and not os.path.exists(str(source))


def is_secret(key: str, value: Any) -> bool:
    """A credential by its key name (exactly, or containing a credential word) or by its value."""
    if str(key).lower() in SECRET_KEYS or _SECRET_WORD.search(str(key)):
        return True
    if not isinstance(value, str) or not value:
        return False
    if any(value == os.environ.get(var) for var in _CREDENTIAL_ENV):
        return True
    return bool(_SECRET_VALUE.match(value)) and not _HASH_KEY.search(str(key))


def scrub(value: Any, key: str = "") -> Any:
    """Credentials replaced by ``<redacted>`` at any depth (cards and logs never carry secrets)."""
    if isinstance(value, Mapping):
        return {str(k): REDACTED if is_secret(str(k), v) else scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [REDACTED if is_secret(key, v) else scrub(v, key) for v in value]
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
    if is_hub_id(source):
        return f"`{source}` (Hugging Face Hub)"
    full = os.path.abspath(os.path.expanduser(source))
    where = f"local folder `{portable_path(full, roots)}` (not on the Hub"
    if tiny_dir and full.startswith(os.path.abspath(tiny_dir) + os.sep):
        where += "; draftsmith's embedded tiny pair, rebuilt by `python train.py experiment=tiny_pair`"
    return where + ")"
