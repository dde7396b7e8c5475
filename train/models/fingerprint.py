"""What a model computes, in a few strings: its configuration (load path aside), dtype and a checksum of
every parameter's first values. Cheap for a large model, yet different for another checkpoint, another
seed or one changed weight; what caches of a model's outputs are keyed by (EAGLE-3's verifier features,
the verifier's answers)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["model_fingerprint", "verifier_fingerprint"]

CHECKSUM_VALUES = 4096
"""How many leading values of each parameter the checksum reads."""


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """``config`` (JSON of the model's configuration, without its load path and transformers version),
    ``dtype`` and ``weights`` (a digest of every parameter's name, shape and first values' sums)."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            head = param.detach().reshape(-1)[:CHECKSUM_VALUES].double()
            digest.update(
                f"{name}:{tuple(param.shape)}:{float(head.sum())!r}:{float(head.abs().sum())!r}".encode()
            )
    config = getattr(model, "config", None)
    settings: dict[str, Any] = config.to_dict() if config is not None else {"class": type(model).__name__}
    for where in ("_name_or_path", "transformers_version"):  # not what the model computes
        settings.pop(where, None)
    return {
        "config": json.dumps(settings, sort_keys=True, default=str),
        "dtype": str(next(model.parameters()).dtype),
        "weights": digest.hexdigest(),
    }


def verifier_fingerprint(model: torch.nn.Module) -> str:
    """:func:`model_fingerprint` as one short digest."""
    text = json.dumps(model_fingerprint(model), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
