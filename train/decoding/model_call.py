"""One timed forward pass of a causal LM over new tokens, on top of its KV cache.

:class:`TimedModel` wraps a Hugging Face causal LM (or anything with the same call signature) for the
decoders: it knows the model's device, its output vocabulary and how many ids it can embed, and runs
``model(input_ids, cache, ...)`` with optional explicit ``position_ids``, an optional 4-D
attention mask (tree attention), ``logits_to_keep`` and the capture of chosen layers' hidden states.
The clock stops after the work this thread queued on the model's device has finished (its current CUDA
stream, ``torch.cuda.current_stream(device).synchronize()``), so two models on two GPUs are each timed on
the GPU that ran them, and two threads on one GPU on their own streams (the asynchronous schedule gives
the drafter's thread a stream of its own) are each timed on their own work, not on each other's.

On a CPU the model's linear layers may take the streamed product for 1-16 rows in float32
(:func:`~train.models.streamed_linear.stream_small_linears`, each row count where the cost probe measured
it faster): a check of k drafted tokens then costs about what a one-token step does instead of 1.7-1.9x,
and where the library's one-row kernel is the slow one, plain steps gain too (docs/decoding.md, "What a
check costs").

Which name the installed transformers gives the cache argument, the model's device and vocabulary
sizes come from :mod:`train.models.introspect`.

A first call (no cache yet) starts the decoders' own cache (:func:`~train.decoding.cache.decoding_cache`):
the model's ``DynamicCache`` with layers that append in place and roll back by a length. Sliding-window
models (Mistral, Qwen2/3 with ``use_sliding_window``, Gemma 2/3) thereby get layers that keep all their
positions: the window is applied by the attention mask, the model's own for a causal forward and
:func:`~train.decoding.tree_attention.sliding_window_mask` on a tree mask, so rollbacks and tree
compaction work and every logit is the model's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from train.decoding.cache import SlidingLayout, decoding_cache, sliding_layout
from train.decoding.tree_attention import sliding_window_mask
from train.models.draft_vocab import draft_support
from train.models.introspect import (
    cache_keyword,
    input_vocab_size,
    model_device,
    output_vocab_size,
    returned_cache,
    supports_logits_to_keep,
)
from train.models.streamed_linear import stream_small_linears

__all__ = ["CallResult", "TimedModel"]


@dataclass
class CallResult:
    """What one forward returned.

    logits: (n, V) for the last ``n`` positions (``logits_to_keep``; all positions when None), on the
        model's device, in the model's dtype. cache: the updated cache. seconds: wall time of the call,
        device work included. hidden: {layer index: (T, d) hidden states entering that layer}, for the
        layers asked for (``hidden_states[i]`` in Hugging Face's convention), else None.
    """

    logits: torch.Tensor
    cache: Any
    seconds: float
    hidden: dict[int, torch.Tensor] | None = None


class TimedModel:
    """A causal LM as the decoders call it: ``timed(tokens, cache) -> CallResult``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = model_device(model)
        if self.device.type == "cpu":  # forwards of 1-16 tokens at the memory limit in float32
            stream_small_linears(model)
        self.vocab_size = output_vocab_size(model)
        self.embed_size = input_vocab_size(model)
        self.supports_logits_to_keep = supports_logits_to_keep(model)
        dtype = getattr(model, "dtype", None)
        #: The dtype of additive attention masks for this model (its floating dtype; float32 for fakes).
        self.mask_dtype = (
            dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        )
        self._sync = self.device.type == "cuda"
        self._cache_kw = cache_keyword(model)
        #: Sliding-window layers, which get full-length cache layers and windowed tree masks (None: none).
        self._sliding: SlidingLayout | None = sliding_layout(model)
        self._has_support = draft_support(model) is not None
        self._support_kw = {"full_logits": False}

    @property
    def support(self) -> torch.Tensor | None:
        """A drafter over a reduced vocabulary: the ascending ids it drafts over (on its device), whose
        logits alone a call with ``support_only=True`` returns, (n, N); None for any other model
        (train/models/draft_vocab.py)."""
        return draft_support(self.model)

    def synchronize(self) -> None:
        """Wait for the work this thread queued on this model's device (its current stream: not another
        GPU's, nor another thread's stream on this one)."""
        if self._sync:
            torch.cuda.current_stream(self.device).synchronize()

    def __call__(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: Any = None,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | None = 1,
        hidden_layers: Sequence[int] | None = None,
        support_only: bool = False,
    ) -> CallResult:
        """Forward ``tokens`` (T new ids, or a (1, T) tensor) after what ``cache`` holds.

        position_ids: (1, T), default the positions following the cache. attention_mask: a 4-D
        (1, 1, T, cache + T) mask for tree attention (True / 0.0 = attend), default causal.
        logits_to_keep: logits of the last n positions only (None: all T). hidden_layers: indices into
        Hugging Face's ``hidden_states`` tuple (0 = embeddings, i = input of layer i) to capture.
        support_only: logits over :attr:`support` only, where the model has one (a drafter's sampling
        over 8,192 draft ids instead of 49,152 costs a sixth: docs/decoding.md).
        """
        if isinstance(tokens, torch.Tensor):
            ids = tokens.reshape(1, -1).to(self.device)
        else:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        keep = logits_to_keep is not None and self.supports_logits_to_keep
        if cache is None:
            cache = decoding_cache(self.model)
        extra = self._support_kw if support_only and self._has_support else {}
        if position_ids is None and attention_mask is None and not hidden_layers:  # the hot path
            start = time.perf_counter()
            if keep:
                out = self.model(
                    input_ids=ids,
                    **{self._cache_kw: cache},
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **extra,
                )
            else:
                out = self.model(input_ids=ids, **{self._cache_kw: cache}, use_cache=True, **extra)
        else:
            kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True, **extra}
            if position_ids is not None:
                kwargs["position_ids"] = position_ids.to(self.device)
            if attention_mask is not None:
                kwargs["attention_mask"] = self._layer_masks(attention_mask.to(self.device), position_ids)
            if keep:
                kwargs["logits_to_keep"] = logits_to_keep
            if hidden_layers:
                kwargs["output_hidden_states"] = True
            start = time.perf_counter()
            out = self.model(input_ids=ids, **kwargs)
        if self._sync:
            torch.cuda.current_stream(self.device).synchronize()
        seconds = time.perf_counter() - start
        logits = out.logits[0]
        if logits_to_keep is not None and not keep:
            logits = logits[-logits_to_keep:]
        hidden = None
        if hidden_layers:
            states = out.hidden_states
            hidden = {int(i): states[i][0] for i in hidden_layers}
        return CallResult(logits=logits, cache=returned_cache(out), seconds=seconds, hidden=hidden)

    def _layer_masks(
        self, mask: torch.Tensor, position_ids: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """A 4-D mask (1, 1, T, cached + T) as the model's layers need it: unchanged without sliding-window
        layers; else narrowed to the window for those layers (keys at positions 0..cached - 1, then the
        fed tokens at ``position_ids``), one mask per layer type where full and sliding layers mix."""
        layout = self._sliding
        if layout is None or mask.dim() != 4:
            return mask
        if layout.window is None:
            raise ValueError(
                f"{type(self.model).__name__} has chunked-attention layers: tree masks for them are not built"
            )
        rows, width = mask.shape[-2], mask.shape[-1]
        cached = width - rows
        if position_ids is None:
            queries = torch.arange(cached, width, device=mask.device)
        else:
            queries = position_ids.reshape(-1).to(mask.device)
        keys = torch.cat([torch.arange(cached, device=mask.device), queries])
        windowed = sliding_window_mask(mask, queries, keys, layout.window)
        if not layout.mixed:
            return windowed
        return {"full_attention": mask, "sliding_attention": windowed}
