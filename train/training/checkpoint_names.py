"""Checkpoints saved under names a module no longer uses, read under the new ones (issue 53, one word per
idea: docs/architecture.md's glossary).

A method's ``on_load_checkpoint`` (which Lightning calls before it loads ``checkpoint["state_dict"]``)
passes its old names: :func:`renamed_checkpoint` moves the weights under an old attribute's prefix and
the old top-level entries to their new names, so a run saved before a renaming resumes, strictly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def renamed_checkpoint(
    checkpoint: dict[str, Any],
    prefixes: Mapping[str, str] | None = None,
    entries: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``checkpoint`` (a Lightning checkpoint, changed in place) with its ``state_dict`` keys under an old
    prefix of ``prefixes`` (old -> new, e.g. ``{"student.": "drafter."}``) and its entries named in
    ``entries`` (old -> new) renamed; a checkpoint already under the new names is left as it is (an
    old entry beside its new one is dropped: the new one wins)."""
    state: Any = checkpoint.get("state_dict")
    for old, new in (prefixes or {}).items():
        moved = [k for k in state if k.startswith(old)] if isinstance(state, dict) else []
        for key in moved:
            state[new + key[len(old) :]] = state.pop(key)
        if moved:
            log.info("checkpoint weights %s* read as %s* (the names before issue 53)", old, new)
    for old, new in (entries or {}).items():
        if old in checkpoint:
            value = checkpoint.pop(old)
            if new not in checkpoint:
                checkpoint[new] = value
                log.info("checkpoint entry %r read as %r (the names before issue 53)", old, new)
    return checkpoint
