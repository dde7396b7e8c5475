"""DFlash's drafter: a whole block of draft tokens in one non-causal forward (docs/dflash.md).

DFlash (block-diffusion drafting conditioned on the verifier, arXiv 2602.06036): the verifier's residual
stream entering a few of its layers (Hugging Face ``hidden_states`` indices ``aux_layers``) at every
committed position is fused into one context row per position,

    c_p = hidden_norm(fc(cat(h_p^(l1), h_p^(l2), ...)))                          (h wide)

and a block of ``block_size`` positions, the last committed token (the anchor) then ``block_size - 1``
mask tokens, runs through ``num_layers`` Qwen3-shaped layers. In every layer the block's queries attend
the context rows (keys ``k_norm(k_proj(c_p))`` with RoPE at p, values ``v_proj(c_p)``: the context is
never updated by the layers) and the block's own keys, all of them (non-causal within the block)::

    x = embed([anchor, mask, ..., mask])                          positions a .. a + B - 1
    x = x + o_proj(attention(q_norm(q_proj(ln(x))), [K_ctx ; k_norm(k_proj(ln(x)))], [V_ctx ; v_proj(ln(x))]))
    x = x + mlp(post_attention_layernorm(x))                      (each of num_layers layers)
    logits = lm_head(norm(x))                                     slot k >= 1 predicts the token at a + k

The anchor's own verifier state is not in the context (the verifier has not read it yet): a block at
anchor a sees the context rows of positions 0 .. a - 1. One forward drafts ``block_size - 1`` tokens.
With ``markov_rank`` r > 0 the drafter is DSpark's: a Markov head (:mod:`train.models.markov_head`) adds
to slot k's logits a bias from the token slot k - 1 chose, drafted left to right after the forward.

The draft vocabulary uses the same ``d2t`` / ``t2d`` maps as EAGLE-3 (docs/draft_vocab.md). Parameter
and buffer names are speculators' / vLLM's (``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``,
``embed_tokens``), so the export (:mod:`train.export.dflash_speculators`) writes the state dict as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from train.models.eagle3_drafter import DraftVocabAndStates, default_aux_layers, draft_vocab_maps
from train.models.markov_head import MarkovHead

__all__ = ["ContextKV", "DFlashDrafter", "block_inputs", "default_mask_token_id"]

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ContextKV:
    """The context's keys and values in every layer: ``layers[i] = (k, v)``, each (B, kv_heads, C, d),
    keys normed and rotated at their positions. Grown by :meth:`append`, cut back by :meth:`crop`."""

    layers: list[KV]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[-2]) if self.layers else 0

    def append(self, other: ContextKV) -> ContextKV:
        """This context followed by ``other`` (new positions), as a new object."""
        if not self.layers:
            return other
        return ContextKV(
            [
                (torch.cat([k, k2], dim=-2), torch.cat([v, v2], dim=-2))
                for (k, v), (k2, v2) in zip(self.layers, other.layers, strict=True)
            ]
        )

    def crop(self, length: int) -> ContextKV:
        """The first ``length`` positions."""
        return ContextKV([(k[..., :length, :], v[..., :length, :]) for k, v in self.layers])


def default_mask_token_id(vocab_size: int, special_ids: Sequence[int] = ()) -> int:
    """The token the block's draft slots carry: the last id of the vocabulary that is not one of
    ``special_ids`` (eos, bos, pad). Any id works (its embedding is the verifier's, frozen, and the
    drafter learns what it means in a slot); vLLM reads it as ``mask_token_id``."""
    taken = {int(i) for i in special_ids}
    for token in range(vocab_size - 1, -1, -1):
        if token not in taken:
            return token
    raise ValueError("no token id is free to serve as the mask token")


def block_inputs(anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """(..., block_size) ids: each anchor token followed by ``block_size - 1`` mask tokens."""
    masks = torch.full(
        (*anchors.shape, block_size - 1), mask_token_id, dtype=anchors.dtype, device=anchors.device
    )
    return torch.cat([anchors[..., None], masks], dim=-1)


class DFlashAttention(nn.Module):
    """Qwen3-shaped attention (per-head ``q_norm`` / ``k_norm`` before RoPE) whose keys and values are the
    context's followed by the block's own."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = int(config.hidden_size), int(config.head_dim)  # type: ignore[arg-type]
        self.num_heads: int = int(config.num_attention_heads)  # type: ignore[arg-type]
        self.num_kv_heads: int = int(config.num_key_value_heads)  # type: ignore[arg-type]
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> KV:
        """x: (B, T, h) -> keys (normed, rotated) and values, each (B, kv_heads, T, d)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: KV,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: (B, Q, h), the block's normed states; context: this layer's (k, v), (B, kv_heads, C, d);
        attention_mask: None (every query sees every key) or (B or 1, 1, Q, C + Q) bool (True: attend)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, *cos_sin)
        k, v = self.keys_values(x, cos_sin)
        k = torch.cat([context[0].to(k.dtype), k], dim=-2)
        v = torch.cat([context[1].to(v.dtype), v], dim=-2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    """One pre-norm decoder layer of the drafter (see the module docstring)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: KV,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, context, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(
    DraftVocabAndStates,
    nn.Module,
    PyTorchModelHubMixin,
    library_name="draftsmith",
    tags=["speculative-decoding", "dflash", "draftsmith"],
):
    """DFlash's drafter (see the module docstring). Build one with :meth:`from_verifier`.

    ``vocab_size`` is the verifier's (V), ``draft_vocab_size`` the head's rows (N <= V); ``aux_layers``
    the verifier's ``hidden_states`` indices fused by ``fc``; ``block_size`` the anchor plus the draft
    slots; ``mask_token_id`` the id the draft slots carry; ``rope_parameters`` the verifier's."""

    drafter_kind: ClassVar[str] = "dflash"
    """What decoders take this drafter (:class:`train.decoding.DFlashDecoder`)."""

    def __init__(  # more than 8 parameters: PyTorchModelHubMixin saves them as the config.json it reloads
        self,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        vocab_size: int,
        draft_vocab_size: int,
        aux_layers: list[int],
        block_size: int,
        mask_token_id: int,
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 4096,
        hidden_act: str = "silu",
        verifier_name: str | None = None,
        markov_rank: int = 0,
    ) -> None:
        super().__init__()
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size = {vocab_size}], got {draft_vocab_size}"
            )
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and one draft slot), got {block_size}")
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {vocab_size}), got {mask_token_id}")
        if not aux_layers:
            raise ValueError("aux_layers must name at least one verifier layer")
        if markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0: no Markov head), got {markov_rank}")
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.num_layers, self.block_size, self.mask_token_id = num_layers, block_size, mask_token_id
        self.aux_layers = [int(i) for i in aux_layers]
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.verifier_name = verifier_name
        self.layer_config = LlamaConfig(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            num_hidden_layers=num_layers,
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
        self.hidden_norm = LlamaRMSNorm(hidden_size, eps=rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(self.layer_config) for _ in range(num_layers)])
        self.norm = LlamaRMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.layer_config)
        self.markov_rank = int(markov_rank)
        #: DSpark's bias from the previous slot's token (:mod:`train.models.markov_head`); None: plain DFlash.
        self.markov_head = MarkovHead(vocab_size, draft_vocab_size, markov_rank) if markov_rank else None
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
        num_layers: int = 1,
        block_size: int = 8,
        mask_token_id: int | None = None,
        aux_layers: Sequence[int] | None = None,
        draft_ids: Sequence[int] | torch.Tensor | None = None,
        special_ids: Sequence[int] = (),
        markov_rank: int = 0,
    ) -> DFlashDrafter:
        """A fresh drafter for ``verifier`` (a Hugging Face Llama / Qwen-style causal LM): its sizes, heads
        and RoPE, its frozen embeddings, ``lm_head`` rows of the draft ids copied from its output
        embedding; on its device and dtype. ``draft_ids``: sorted target ids (None: every id);
        ``aux_layers``: None gives EAGLE-3's ``[2, L//2, L-3]``; ``mask_token_id`` None:
        :func:`default_mask_token_id` avoiding ``special_ids``; ``markov_rank`` r > 0: DSpark's Markov head
        of rank r (a fresh one adds nothing)."""
        cfg = getattr(verifier, "config", None)
        if cfg is None:
            raise TypeError(f"{type(verifier).__name__} has no config: pass a Hugging Face causal LM")
        vocab = int(cfg.vocab_size)
        ids = torch.as_tensor(draft_ids if draft_ids is not None else torch.arange(vocab), dtype=torch.long)
        hidden, heads, layers = int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.num_hidden_layers)
        aux = list(aux_layers) if aux_layers is not None else default_aux_layers(layers)
        if not aux or max(aux) >= layers or min(aux) < 0:
            raise ValueError(
                f"aux_layers {aux} out of range for {layers} layers: each must be in [0, {layers})"
            )
        rope = getattr(cfg, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": float(getattr(cfg, "rope_theta", 10000.0)),
        }
        drafter = cls(
            hidden_size=hidden,
            intermediate_size=int(cfg.intermediate_size),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(ids.numel()),
            aux_layers=aux,
            block_size=block_size,
            mask_token_id=default_mask_token_id(vocab, special_ids)
            if mask_token_id is None
            else mask_token_id,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_parameters=dict(rope),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            hidden_act=str(getattr(cfg, "hidden_act", "silu")),
            verifier_name=getattr(cfg, "_name_or_path", None) or None,
            markov_rank=markov_rank,
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
        """The context rows ``hidden_norm(fc(cat(aux)))``: a list of (B, T, h) or one (B, T, n h)
        -> (B, T, h)."""
        x = aux_states if isinstance(aux_states, torch.Tensor) else torch.cat(list(aux_states), dim=-1)
        return self.hidden_norm(self.fc(x.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's keys and values of the context rows (B, C, h) at RoPE ``positions`` (B, C)."""
        cos_sin = self.rotary_emb(context, positions)
        layers: list[DFlashLayer] = list(self.layers)  # type: ignore[arg-type]
        return ContextKV([layer.self_attn.keys_values(context, cos_sin) for layer in layers])

    def forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ContextKV,
        attention_mask: torch.Tensor | None = None,
        slots: slice | None = None,
    ) -> torch.Tensor:
        """The drafter's logits (B, Q, N) over the draft vocabulary for the block tokens ``block_ids``
        (B, Q) at RoPE ``positions`` (B, Q), reading ``context`` (:meth:`context_kv`). attention_mask:
        None (every query sees the whole context and every block token: one block) or (B or 1, 1, Q,
        C + Q) bool, True where a query attends (several blocks at once, in training). ``slots``: the
        block positions whose logits are wanted (drafting reads the draft slots a chain can use only);
        None: all."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos_sin = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, context.layers, strict=True):
            x = layer(x, cos_sin, kv, attention_mask)
        return self.lm_head(self.norm(x if slots is None else x[:, slots]))

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor | None:
        """DSpark's bias (..., N) on a slot's logits from the target ids ``previous`` (...) drafted (or, in
        training, written) just before it; None without a Markov head."""
        if self.markov_head is None:
            return None
        return self.markov_head(previous)
