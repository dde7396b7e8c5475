"""The frozen verifier's scores of training continuations, without recomputing what it computed before.

A distillation loss needs the verifier's logits at every continuation position. Scoring a batch with one
forward over prompt and continuation spends most of its time on the prompt (up to 256 tokens against 32
new ones), and a training prompt comes back every epoch. :class:`PrefixScorer` keeps each prompt's
key/value cache (and the logits at its last position, which predict the first continuation token) the
first time it scores it; later batches on that prompt run the verifier over the continuation only, on
top of the kept cache. The scores equal a full forward's up to float rounding (the attention over the
prompt reads the same keys and values; tests/training/test_verifier_scores.py).

What is kept is bounded by a :class:`ByteBudget` shared with whatever else keeps the verifier's outputs (the
answers' own scores, :class:`~train.training.answer_cache.AnswerCache`); past it a prompt is
scored the same way but not kept; a budget of zero scores every batch with one full forward. A model whose
cache is not plain per-layer keys and values (sliding windows, recurrent state, a stand-in without a config)
is scored with one full forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from train.decoding.cache import library_cache
from train.models.introspect import cache_keyword, returned_cache
from train.training.answer_cache import continuation_logits, prompt_keys
from train.training.byte_budget import ByteBudget
from train.training.rollout import Rollout, position_ids_from_mask

__all__ = ["PrefixScorer"]


@dataclass
class _Prefix:
    """One prompt's kept state: per layer (heads, L, head_dim) keys and values, and the (V,) logits at its
    last position."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_logits: torch.Tensor


def _plain_cache_layers(model: Any) -> bool:
    """Whether ``model``'s own cache is one plain key/value layer per attention layer."""
    cache = library_cache(model)
    return (
        cache is not None
        and bool(cache.layers)
        and all(type(layer) is DynamicLayer for layer in cache.layers)
    )


class PrefixScorer:
    """``scorer(rollouts)`` -> (B, N, V) logits of ``model`` predicting each continuation position of
    ``rollouts`` (:func:`~train.training.answer_cache.continuation_logits`'s result), reusing each prompt's
    cache across calls within ``budget``."""

    def __init__(self, model: torch.nn.Module, budget: ByteBudget) -> None:
        self.model: Any = model
        self.budget = budget
        self.prefixes: dict[bytes, _Prefix] = {}
        self.reuses_prompts = budget.left > 0 and _plain_cache_layers(model)

    def __len__(self) -> int:
        return len(self.prefixes)

    @torch.no_grad()
    def __call__(self, rollouts: Rollout) -> torch.Tensor:
        if not self.reuses_prompts:
            return continuation_logits(self.model, rollouts)
        width = rollouts.prompt_width
        ids, mask = rollouts.sequences, rollouts.attention_mask
        keys = prompt_keys(ids[:, :width], mask[:, :width])
        prefixes = self._prefixes(ids[:, :width], mask[:, :width], keys)
        n = ids.shape[1] - width
        first = torch.stack([p.last_logits for p in prefixes]).unsqueeze(1)
        if n <= 1:
            return first[:, :n]
        cache = DynamicCache(config=self.model.config)
        for layer in range(len(prefixes[0].keys)):
            cache.update(
                _left_padded([p.keys[layer] for p in prefixes], width),
                _left_padded([p.values[layer] for p in prefixes], width),
                layer,
            )
        feed_mask = mask[:, : ids.shape[1] - 1]
        out = self.model(
            input_ids=ids[:, width:-1],
            attention_mask=feed_mask,
            position_ids=position_ids_from_mask(feed_mask)[:, width:],
            use_cache=True,
            **{cache_keyword(self.model): cache},
        )
        return torch.cat([first.to(out.logits.dtype), out.logits], dim=1)

    def _prefixes(self, ids: torch.Tensor, mask: torch.Tensor, keys: list[bytes]) -> list[_Prefix]:
        """Every row's prefix: the kept ones, the others computed in one forward (and kept if they fit)."""
        fresh: dict[bytes, _Prefix] = {}
        missing = [keys.index(k) for k in dict.fromkeys(keys) if k not in self.prefixes]
        if missing:
            out = self.model(
                input_ids=ids[missing],
                attention_mask=mask[missing],
                position_ids=position_ids_from_mask(mask[missing]),
                use_cache=True,
                logits_to_keep=1,
            )
            cache = returned_cache(out)
            for row, i in enumerate(missing):
                length = int(mask[i].sum())
                prefix = _Prefix(
                    [layer.keys[row, :, -length:].clone() for layer in cache.layers],
                    [layer.values[row, :, -length:].clone() for layer in cache.layers],
                    out.logits[row, -1].clone(),
                )
                if self.budget.take([*prefix.keys, *prefix.values, prefix.last_logits]):
                    self.prefixes[keys[i]] = prefix
                else:
                    fresh[keys[i]] = prefix
        return [self.prefixes.get(k) or fresh[k] for k in keys]


def _left_padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """(B, heads, width, head_dim) from per-row (heads, L_i, head_dim), each right-aligned (zeros before: the
    attention mask hides them)."""
    heads, _, dim = rows[0].shape
    out = rows[0].new_zeros((len(rows), heads, width, dim))
    for i, row in enumerate(rows):
        out[i, :, width - row.shape[1] :] = row
    return out
