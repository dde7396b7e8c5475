"""A KV-cache layer that writes in place into a preallocated buffer, so a rollback costs no tensor work.

Hugging Face's ``DynamicLayer`` appends by ``torch.cat`` (every forward copies the whole layer) and crops
by slicing (a new view per layer and per tensor). A speculative decoder does both in every block: it
appends the context and the draft, then crops the rejected draft away; what that cost on the real pair is
in docs/decoding.md, "A KV cache that rolls back by a length".

:class:`BufferedLayer` keeps each layer's keys and values in one buffer of shape (batch, heads,
capacity, head_dim) and a length: ``update`` writes the new positions after the length and returns views
of the first ``length`` positions (the same values ``torch.cat`` would have built, in the same layout
along the last two dimensions, so attention computes the same logits bit for bit); ``crop`` lowers the
length; ``keep`` compacts chosen positions to the front (a tree's accepted path). The buffer grows by half
its size plus 256 positions when full, so a decode reallocates a handful of times at most. The layer is
a ``DynamicLayer`` in every other respect (the model builds its causal mask from ``get_seq_length``).

Only the decoders use it, always under ``torch.inference_mode``: a view returned by ``update`` is only
valid until the next ``update`` after a ``crop``, which may overwrite the positions it shows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["BufferedLayer"]

#: Positions added beyond what an update needs when the buffer is (re)allocated.
HEADROOM = 256


class BufferedLayer(DynamicLayer):
    """A full-attention cache layer backed by a growing buffer; see the module docstring."""

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        super().__init__()

    # ``keys`` / ``values`` read as DynamicLayer's do (the held positions); assigning a tensor replaces
    # the buffer by it (transformers' own code and offloading assign them).
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._key_buffer is None else self._key_buffer[..., : self._length, :]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._key_buffer = tensor
        self._length = 0 if tensor is None else int(tensor.shape[-2])

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._value_buffer is None else self._value_buffer[..., : self._length, :]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._value_buffer = tensor
        self._length = 0 if tensor is None else int(tensor.shape[-2])

    @property
    def capacity(self) -> int:
        """Positions the buffer can hold before it must grow."""
        return 0 if self._key_buffer is None else int(self._key_buffer.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the held ones; return (keys, values) of every held position."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._length
        end = start + int(key_states.shape[-2])
        if end > self.capacity:
            self._grow(key_states, value_states, end)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self._length = end
        return self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = max(needed + HEADROOM, self.capacity + self.capacity // 2)
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        held = self._length
        if held:
            assert self._key_buffer is not None and self._value_buffer is not None
            keys[..., :held, :] = self._key_buffer[..., :held, :]
            values[..., :held, :] = self._value_buffer[..., :held, :]
        self._key_buffer, self._value_buffer = keys, values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers 5's negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self._length = max(0, self._length + tokens_to_remove)

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the held positions ``index`` (ascending), moved to the front in order."""
        if self._key_buffer is None or self._value_buffer is None:
            return
        n = int(index.numel())
        idx = index.to(self._key_buffer.device)
        self._key_buffer[..., :n, :] = self._key_buffer.index_select(-2, idx)
        self._value_buffer[..., :n, :] = self._value_buffer.index_select(-2, idx)
        self._length = n
