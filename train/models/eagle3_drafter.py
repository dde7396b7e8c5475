"""EAGLE-3's drafter: one decoder layer over the verifier's fused hidden states (docs/eagle3.md).

Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test" (arXiv 2503.01840). The drafter reads the verifier's residual stream *entering* three of its
layers (Hugging Face ``hidden_states`` indices, by default ``(2, L//2, L-3)``), fuses them with ``fc``
(3h -> h), and runs one Llama-shaped layer whose attention reads the concatenation of the normed token
embedding and the normed feature (2h wide)::

    x      = cat(input_layernorm(embed(token)), hidden_norm(f))     (B, T, 2h)
    h1     = f + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))  residual: f before hidden_norm
    h2     = h1 + mlp(post_attention_layernorm(h1))                  (B, T, h), fed back next step
    logits = lm_head(norm(h2))                                       (B, T, N) over the draft vocab

The draft vocabulary uses EAGLE-3's / speculators' maps (docs/draft_vocab.md): ``d2t`` (int64, N),
draft index i is target id ``i + d2t[i]``; ``t2d`` (bool, V), True on target ids in the draft
vocabulary. Parameter and buffer names are speculators' (``fc``, ``layers.0.self_attn.q_proj``,
``layers.0.hidden_norm``, ..., ``norm``, ``lm_head``, ``d2t``, ``t2d``), so the export
(:mod:`train.export.speculators`) writes the state dict as it is. ``save_pretrained`` /
``from_pretrained`` come from ``PyTorchModelHubMixin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from train.models.rotary import keep_rotary_float32

__all__ = [
    "DraftVocabAndStates",
    "Eagle3Drafter",
    "Eagle3Output",
    "default_aux_layers",
    "draft_ids_of",
    "draft_vocab_maps",
]


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three verifier layers for an ``num_layers``-layer verifier: ``[2, L//2, L-3]``, as
    Hugging Face ``hidden_states`` indices (i = the residual stream entering layer i). A verifier of
    fewer than 4 layers (micro test pairs) gets those indices clamped into ``[0, L)``."""
    if num_layers < 1:
        raise ValueError(f"the verifier needs at least one layer, got {num_layers}")
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def draft_vocab_maps(
    draft_ids: Sequence[int] | torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the sorted target ids ``draft_ids`` (N of them) of a ``vocab_size`` vocabulary.

    d2t: int64 (N,), ``draft_ids[i] - i`` (draft index i is target id ``i + d2t[i]``); t2d: bool
    (vocab_size,), True on the ids. Raises ValueError unless the ids are unique, ascending and in range."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise ValueError("the draft vocabulary is empty")
    if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft ids must be unique, ascending and in [0, {vocab_size})")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocabulary, ``arange(N) + d2t`` (int64, on ``d2t``'s device)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.long()


class DraftVocabAndStates:
    """What the drafters on the verifier's hidden states share (EAGLE-3's, DFlash's): the draft vocabulary
    maps (``d2t`` / ``t2d`` buffers, as many ids as ``lm_head``'s rows), the verifier's states they read
    (``aux_layers``), and RoPE kept in float32 through every move."""

    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]
    d2t: torch.Tensor
    t2d: torch.Tensor

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Every move (``.to``, ``.half()``, ``.bfloat16()``, a precision plugin's) goes through here:
        the RoPE frequencies stay exact float32 (:mod:`train.models.rotary`), as vLLM computes them."""
        super()._apply(fn, recurse)  # type: ignore[misc]
        keep_rotary_float32(self)  # type: ignore[arg-type]
        return self

    def set_draft_ids(self, draft_ids: Sequence[int] | torch.Tensor) -> None:
        """Set ``d2t`` / ``t2d`` from the sorted target ids (as many as ``lm_head``'s rows)."""
        d2t, t2d = draft_vocab_maps(draft_ids, self.vocab_size)
        if d2t.numel() != self.draft_vocab_size:
            raise ValueError(f"{d2t.numel()} draft ids for a head of {self.draft_vocab_size} rows")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(N,) int64 target ids of the draft vocabulary (``arange(N) + d2t``)."""
        return draft_ids_of(self.d2t)

    def aux_features(self, hidden_states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The verifier's ``hidden_states`` (``output_hidden_states=True``: L + 1 tensors (B, T, h),
        index i = the stream entering layer i) at ``aux_layers``."""
        return [hidden_states[i] for i in self.aux_layers]


@dataclass
class Eagle3Output:
    """``logits`` (B, T, N) over the draft vocabulary; ``hidden`` (B, T, h), the layer's pre-norm
    output (the next step's feature); ``past_key_values``: the cache (None unless one was passed or
    ``use_cache``)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    past_key_values: Any = None


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read 2h and whose o_proj writes h (speculators' names)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = int(config.hidden_size), int(config.head_dim)  # type: ignore[arg-type]
        self.num_heads: int = int(config.num_attention_heads)  # type: ignore[arg-type]
        self.num_kv_heads: int = int(config.num_key_value_heads)  # type: ignore[arg-type]
        self.head_dim = d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """x: (B, T, 2h); cos/sin: (B, T, head_dim); attention_mask: None (causal over cache + new) or
        (B, 1, T, S) bool (True: attend) or additive float; returns (B, T, h)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        s = k.shape[-2]
        mask = attention_mask
        if mask is None and s != t:  # causal with the cache in front: query i sees keys <= s - t + i
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
        elif mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3Layer(nn.Module):
    """The drafter's one decoder layer (see the module docstring)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        h1 = features + self.self_attn(x, cos_sin, attention_mask, cache)
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class Eagle3Drafter(
    DraftVocabAndStates,
    nn.Module,
    PyTorchModelHubMixin,
    library_name="draftsmith",
    tags=["speculative-decoding", "eagle3", "draftsmith"],
):
    """EAGLE-3's drafter (see the module docstring). Build one with :meth:`from_verifier`.

    ``vocab_size`` is the verifier's (V), ``draft_vocab_size`` the head's rows (N <= V);
    ``aux_layers`` the verifier's ``hidden_states`` indices fused by ``fc``; ``rope_parameters`` the
    verifier's (``rope_theta``, ``rope_type``, scaling)."""

    drafter_kind: ClassVar[str] = "eagle3"
    """What decoders take this drafter (:class:`train.decoding.Eagle3Decoder`)."""

    # more than 8 parameters: PyTorchModelHubMixin saves them as the config.json it reloads
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        vocab_size: int,
        draft_vocab_size: int,
        aux_layers: list[int],
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 4096,
        hidden_act: str = "silu",
        verifier_name: str | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size = {vocab_size}], got {draft_vocab_size}"
            )
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.aux_layers = [int(i) for i in aux_layers]
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.verifier_name = verifier_name
        self.layer_config = LlamaConfig(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            num_hidden_layers=1,
            vocab_size=vocab_size,
            rms_norm_eps=rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=max_position_embeddings,
            hidden_act=hidden_act,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(len(self.aux_layers) * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(self.layer_config)])
        self.norm = LlamaRMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.layer_config)
        d2t, t2d = draft_vocab_maps(torch.arange(draft_vocab_size), vocab_size)
        self.d2t: torch.Tensor
        self.t2d: torch.Tensor
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    # ------------------------------------------------------------ building

    @classmethod
    def from_verifier(
        cls,
        verifier: nn.Module,
        draft_vocab_size: int | None = None,
        aux_layers: Sequence[int] | None = None,
        draft_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> Eagle3Drafter:
        """A fresh drafter for ``verifier`` (a Hugging Face Llama / Qwen-style causal LM): its sizes,
        heads, RoPE, frozen embeddings, and ``lm_head`` rows of the draft ids copied from its output
        embedding; on its device and dtype.

        draft_ids: sorted target ids of the draft vocabulary (e.g.
        :func:`train.models.draft_vocab.frequent_tokens`); None: every id (then ``draft_vocab_size``
        must be None or V). aux_layers: ``hidden_states`` indices; None: :func:`default_aux_layers`."""
        cfg = getattr(verifier, "config", None)
        if cfg is None:
            raise TypeError(f"{type(verifier).__name__} has no config: pass a Hugging Face causal LM")
        vocab = int(cfg.vocab_size)
        if draft_ids is None:
            if draft_vocab_size not in (None, vocab):
                raise ValueError(
                    f"draft_vocab_size={draft_vocab_size} < V={vocab} needs draft_ids "
                    "(e.g. train.models.draft_vocab.frequent_tokens on the verifier's outputs)"
                )
            draft_ids = torch.arange(vocab)
        ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_vocab_size is not None and draft_vocab_size != ids.numel():
            raise ValueError(f"draft_vocab_size={draft_vocab_size} but {ids.numel()} draft ids given")
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": float(getattr(cfg, "rope_theta", 10000.0)),
        }
        drafter = cls(
            hidden_size=hidden,
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(ids.numel()),
            aux_layers=list(aux_layers)
            if aux_layers is not None
            else default_aux_layers(int(cfg.num_hidden_layers)),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_parameters=dict(rope),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            hidden_act=str(getattr(cfg, "hidden_act", "silu")),
            verifier_name=getattr(cfg, "_name_or_path", None) or None,
        )
        if max(drafter.aux_layers) >= int(cfg.num_hidden_layers) or min(drafter.aux_layers) < 0:
            # index L would be the final, normed output (Hugging Face), not the stream entering a layer
            raise ValueError(
                f"aux_layers {drafter.aux_layers} out of range for {cfg.num_hidden_layers} layers: "
                f"each must be in [0, {cfg.num_hidden_layers})"
            )
        drafter.set_draft_ids(ids)
        embed = verifier.get_input_embeddings().weight  # type: ignore[operator]
        head = verifier.get_output_embeddings().weight  # type: ignore[operator]
        drafter.to(device=embed.device, dtype=embed.dtype)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed)
            drafter.lm_head.weight.copy_(head.index_select(0, ids.to(head.device)))
        return drafter

    # ------------------------------------------------------------ forward

    def fuse(self, aux_states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc`` of the concatenated auxiliary states:
        a list of 3 (B, T, h), or one (B, T, 3h) -> (B, T, h)."""
        x = aux_states if isinstance(aux_states, torch.Tensor) else torch.cat(list(aux_states), dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
    ) -> Eagle3Output:
        """One drafting step over T new entries.

        input_ids: (B, T) target ids; features: (B, T, h), fused verifier features (:meth:`fuse`) or a
        previous step's ``hidden``; position_ids: (B, T) RoPE positions; attention_mask: None (causal over
        cache + new) or (B, 1, T, S) over cache + new, S = cached + T (bool, True: attend; or additive
        float); past_key_values: a ``DynamicCache`` (updated in place) or None; use_cache: start one
        when None is passed."""
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        embeds = self.embed_tokens(input_ids).to(features.dtype)
        cos_sin = self.rotary_emb(features, position_ids)
        hidden = self.layers[0](embeds, features, cos_sin, attention_mask, past_key_values)
        logits = self.lm_head(self.norm(hidden))
        return Eagle3Output(logits=logits, hidden=hidden, past_key_values=past_key_values)
