"""Drafting over a reduced vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856; EAGLE-3's ``d2t``
map, Li et al. 2025, arXiv 2503.01840), exactly.

A drafter's output head costs ``hidden x vocabulary`` per token: for a 256-wide drafter of a verifier
with 49,152 tokens it is most of the drafter's step (docs/draft_vocab.md has the measurements). Such a
drafter stays a plain causal LM with the verifier's full vocabulary (it loads with ``from_pretrained``
and serves as Hugging Face ``assistant_model``); its config carries ``draft_vocab``, the sorted ids it
drafts over (e.g. the tokens most frequent in the verifier's answers, :func:`frequent_tokens`).
:class:`DraftVocabModel` computes the head's rows for those ids only and returns full-vocabulary logits
with ``-inf`` elsewhere.

Why decoding stays exact: every verification rule reads the drafter's distribution ``q`` and the
verifier's ``p``, and is exact for *any* ``q``. Outside the draft vocabulary ``q = 0``: such a token is
never drafted, and after a rejection the residual ``max(p - q, 0)`` there is ``p`` itself, so the
verifier's mass outside the draft vocabulary reaches the output through corrections and bonus tokens;
the verifier is never cut. Only acceptance can suffer (that mass is never accepted), by at most the
verifier's probability outside the draft vocabulary.

Training over the reduced vocabulary (:func:`draft_divergence`) compares the verifier and the drafter on
the draft ids only, the verifier renormalised over them, as FR-Spec / EAGLE-3 train their heads; the
acceptance a decoder will see is :func:`draft_acceptance` (the verifier's whole distribution, ``q = 0``
outside the draft ids).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from train.losses import acceptance_from_logits, divergence
from train.models.introspect import cache_keyword, model_device
from train.renames import renamed_keywords

__all__ = [
    "DraftVocabModel",
    "argmax_agreement",
    "draft_acceptance",
    "draft_divergence",
    "draft_head_logits",
    "draft_rows_of",
    "draft_support",
    "draft_vocab_of",
    "frequent_tokens",
    "restrict_logits",
    "scatter_draft_logits",
    "set_draft_vocab",
    "with_draft_vocab",
]

#: The name ``CausalLMOutputWithPast`` gives the cache: ``cache`` from transformers 5.24, before that
#: ``past_key_values`` (the old name still works on 5.24 but logs a deprecation warning).
_OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def draft_vocab_of(model: Any) -> list[int] | None:
    """The model's draft vocabulary (``config.draft_vocab``); None when it drafts over every token."""
    ids = getattr(getattr(model, "config", None), "draft_vocab", None)
    return [int(i) for i in ids] if ids else None


def set_draft_vocab(model: Any, ids: Sequence[int]) -> list[int]:
    """Write ``ids`` into ``model.config.draft_vocab`` (sorted; saved with the config) and return them.

    The ids must be unique ints in ``[0, config.vocab_size)``. Including the EOS ids is not needed for
    exactness (an EOS the drafter cannot propose still ends generation when the verifier emits it), but
    a drafter that cannot draft EOS never has an EOS accepted, so :func:`frequent_tokens` takes them as
    ``always``."""
    vocab = int(model.config.vocab_size)
    clean = sorted({int(i) for i in ids})
    if len(clean) != len(ids) or not clean or clean[0] < 0 or clean[-1] >= vocab:
        raise ValueError(f"draft_vocab must hold unique ids in [0, {vocab}), got {len(ids)} ids")
    model.config.draft_vocab = clean
    return clean


def frequent_tokens(
    tokens: Iterable[Iterable[int]] | Mapping[int, int], n: int, always: Iterable[int] = ()
) -> list[int]:
    """The ``n`` most frequent ids, sorted ascending, ``always`` among them (e.g. the EOS ids).

    tokens: token-id sequences (the verifier's outputs), or ``{id: count}``. Ties, and ids never seen
    (count 0) when fewer than ``n`` distinct ids occur, go to the lower id. Raises ValueError when
    ``always`` holds more than ``n`` ids."""
    counts = Counter(tokens) if isinstance(tokens, Mapping) else Counter(t for seq in tokens for t in seq)
    chosen = dict.fromkeys(int(t) for t in always)
    if len(chosen) > n:
        raise ValueError(f"frequent_tokens: {len(chosen)} ids to always include, more than n = {n}")
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= n:
            break
        chosen.setdefault(int(token), None)
    filler = 0
    while len(chosen) < n:
        chosen.setdefault(filler, None)
        filler += 1
    return sorted(chosen)


def vocab_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(vocab_size,)`` map from a verifier id to its row in the draft vocabulary, -1 outside it (on
    ``draft_ids``' device)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    index[draft_ids] = torch.arange(len(draft_ids), device=draft_ids.device)
    return index


def draft_rows_of(ids: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """``ids`` (any shape) mapped to their rows in the sorted ``draft_ids``, -1 outside the draft
    vocabulary: :func:`vocab_index` without knowing the vocabulary's size (a binary search; no host sync)."""
    draft_ids = draft_ids.to(ids.device)
    at = torch.searchsorted(draft_ids, ids.contiguous()).clamp(max=len(draft_ids) - 1)
    return torch.where(draft_ids[at] == ids, at, torch.full_like(at, -1))


def draft_head_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    draft_ids: torch.Tensor,
    drop_last: bool = False,
) -> torch.Tensor:
    """``(B, T, N)`` logits of a causal LM over ``draft_ids`` only (its head's rows for them): the full
    ``(B, T, V)`` logits are never built. ``drop_last``: ``(B, T - 1, N)``, no logits for the last
    position (the head never runs there, and no slice of the logits is copied or back-propagated)."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    if drop_last:
        hidden = hidden[:, :-1]
    weight = model.get_output_embeddings().weight
    return F.linear(hidden, weight.index_select(0, draft_ids.to(weight.device)))


def restrict_logits(logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """``(..., V) -> (..., N)``: the logits of ``draft_ids`` only; a softmax over them is the
    distribution renormalised over the draft vocabulary."""
    return logits.index_select(-1, draft_ids.to(logits.device))


def scatter_draft_logits(draft_logits: torch.Tensor, draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(..., N) -> (..., vocab)``: the draft ids' logits in place, ``-inf`` elsewhere (``q = 0``)."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"))
    return full.index_copy_(-1, draft_ids.to(draft_logits.device), draft_logits)


@renamed_keywords(teacher_logits="verifier_logits")
def draft_divergence(
    name: str,
    draft_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """``D(p~ || q)`` over the draft vocabulary (FR-Spec / EAGLE-3 training of a reduced head).

    draft_logits: ``(B, T, N)`` the drafter's logits over ``draft_ids`` (``N`` ids); verifier_logits:
    ``(B, T, V)``; mask: ``(B, T)``. ``p~`` is the verifier's distribution renormalised over the draft
    ids, ``q`` the drafter's; the rest as :func:`train.losses.divergence` (the same divergences)."""
    restricted = restrict_logits(verifier_logits, draft_ids)
    return divergence(name, draft_logits, restricted, mask, temperature=temperature, beta=beta)


@renamed_keywords(teacher_logits="verifier_logits")
@torch.no_grad()
def draft_acceptance(
    draft_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over selected positions of ``sum_v min(p(v), q(v))``: the acceptance probability decoding
    sees, with ``p`` the verifier's whole distribution and ``q`` the drafter's, zero outside the draft ids.

    Lower than the acceptance over the renormalised verifier (the verifier's mass outside the draft ids is
    never accepted). Shapes as :func:`draft_divergence`; a detached 0-d tensor."""
    full = scatter_draft_logits(draft_logits, draft_ids, verifier_logits.shape[-1])
    return acceptance_from_logits(full, verifier_logits, mask, temperature=temperature)


@renamed_keywords(student_logits="drafter_logits", teacher_logits="verifier_logits")
@torch.no_grad()
def argmax_agreement(
    drafter_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fraction of selected positions where the drafter's most likely token is the verifier's: the
    per-token acceptance of greedy (T = 0) speculative decoding on these contexts.

    ``drafter_logits``: ``(B, T, V_d)``, over the verifier's ids (only the first ``min(V_d, V)`` count), or,
    with ``draft_ids`` ``(N,)``, over those ids (``V_d = N``); ``verifier_logits``: ``(B, T, V)``; ``mask``:
    ``(B, T)``. An empty mask gives 0. A detached 0-d float32 tensor."""
    if drafter_logits.shape[:-1] != verifier_logits.shape[:-1] or (
        mask is not None and mask.shape != drafter_logits.shape[:-1]
    ):
        raise ValueError(
            "drafter logits, verifier logits and mask disagree on the leading (position) shape: "
            f"{tuple(drafter_logits.shape[:-1])}, {tuple(verifier_logits.shape[:-1])}, "
            f"{None if mask is None else tuple(mask.shape)}"
        )
    if draft_ids is None:
        vocab = min(drafter_logits.shape[-1], verifier_logits.shape[-1])
        drafter_top = drafter_logits[..., :vocab].argmax(-1)
        verifier_top = verifier_logits[..., :vocab].argmax(-1)
    else:
        drafter_top = draft_ids.to(drafter_logits.device)[drafter_logits.argmax(-1)]
        verifier_top = verifier_logits.argmax(-1)
    hit = (drafter_top == verifier_top).float()
    if mask is None:
        return hit.mean() if hit.numel() else hit.new_zeros(())
    keep = mask.to(torch.bool)
    return hit[keep].mean() if keep.any() else hit.new_zeros(())


class DraftVocabModel(torch.nn.Module):
    """A causal LM whose logits are computed over ``draft_ids`` only.

    ``model``: a Hugging Face causal LM (``get_decoder()``, ``get_output_embeddings()``), or a peft
    wrapper of one. A call takes the model's keywords (``input_ids``, ``attention_mask``,
    ``position_ids``, the cache as ``past_key_values`` or ``cache``, ``use_cache``, ``cache_position``,
    ``logits_to_keep``, ``output_hidden_states``, a 4-D tree mask...), runs the decoder and only the
    head's rows for the draft ids, and returns a ``CausalLMOutputWithPast`` whose logits are
    ``(..., vocab)`` with ``-inf`` outside the draft ids, or, ``full_logits=False``, ``(..., N)`` over the
    draft ids (training). The head's rows for the draft ids are sliced per call while gradients reach
    the weights, and kept between calls otherwise, for as long as the weight is unchanged (:meth:`_rows`).

    The wrapped model is its only child: ``parameters()``, ``.to()``, ``param_count`` and the device
    are the model's, and :meth:`save_pretrained` saves the plain model (with ``config.draft_vocab``)."""

    def __init__(self, model: Any, draft_ids: Sequence[int] | torch.Tensor, full_logits: bool = True) -> None:
        super().__init__()
        self.model = model
        ids = torch.as_tensor(draft_ids, dtype=torch.long).reshape(-1)
        vocab = int(self.get_output_embeddings().weight.shape[0])
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(
                f"draft ids must lie in [0, {vocab}) (the model's output size), got {ids.numel()}"
            )
        self.draft_ids: torch.Tensor
        self.register_buffer("draft_ids", ids.to(model_device(model)), persistent=False)
        self.vocab_size = vocab
        self.full_logits = full_logits
        self._cache_kw = cache_keyword(model)
        self._rows_key: tuple[Any, ...] | None = None
        self._rows_cache = torch.empty(0)

    # ------------------------------------------------------------ what callers read from a model

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    @property
    def dtype(self) -> torch.dtype:
        return self.get_output_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def get_input_embeddings(self) -> Any:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> Any:
        return self.model.get_output_embeddings()

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """Save the plain model (its config keeps ``draft_vocab``): it reloads with ``from_pretrained``."""
        return self.model.save_pretrained(*args, **kwargs)

    # ------------------------------------------------------------ forward

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., N)`` logits over the draft ids from the decoder's final hidden states ``(..., d)``."""
        head = self.get_output_embeddings()
        if self.draft_ids.device != head.weight.device:  # the model was moved on its own
            self.draft_ids = self.draft_ids.to(head.weight.device)
        ids = self.draft_ids
        if type(head) is not torch.nn.Linear:  # a wrapped head (LoRA on lm_head, ...): run it whole
            logits = head(hidden).index_select(-1, ids)
        else:
            bias = None if head.bias is None else head.bias.index_select(0, ids)
            logits = F.linear(hidden, self._rows(head.weight, ids), bias)
        return _logit_scaling(logits, self.config)

    def _rows(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The head's rows for ``ids``. With gradients to the weight (training): sliced per call. Without
        (decoding), the slice is kept while the weight's storage, version counter (bumped by every
        in-place update: optimizer steps, ``load_state_dict``), dtype and device are unchanged: slicing
        8,192 x 256 float32 rows costs about as much as the matmul itself (docs/draft_vocab.md). Writes
        through ``weight.data`` bypass the version counter: wrap the model again after one."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return weight.index_select(0, ids)
        key = (
            weight.data_ptr(),
            weight._version,
            weight.dtype,
            weight.device,
            ids.data_ptr(),
            torch.is_inference_mode_enabled(),
        )
        if self._rows_key != key:
            self._rows_cache = weight.detach().index_select(0, ids)
            self._rows_key = key
        return self._rows_cache

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        cache_position: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        full_logits: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """The model's forward, logits over the whole vocabulary (``-inf`` outside the draft ids) or,
        ``full_logits=False`` (default: the wrapper's own setting), over the draft ids only."""
        if kwargs.get("labels") is not None:
            raise ValueError("DraftVocabModel computes no loss: train on draft_logits (draft_divergence)")
        kwargs.pop("labels", None)
        other = kwargs.pop("cache", None)  # the cache under transformers >= 5.24's name
        cache = other if past_key_values is None else past_key_values
        if cache is not None:
            kwargs[self._cache_kw] = cache
        if cache_position is not None:
            kwargs["cache_position"] = cache_position
        out = self.model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.draft_logits(hidden[:, keep, :])
        if self.full_logits if full_logits is None else full_logits:
            logits = scatter_draft_logits(logits, self.draft_ids, self.vocab_size)
        # the installed transformers' own name only: reading the other one logs a deprecation
        returned = getattr(out, _OUTPUT_CACHE_FIELD, None)
        return CausalLMOutputWithPast(
            logits=logits,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **{_OUTPUT_CACHE_FIELD: returned},
        )


def _logit_scaling(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """The element-wise transforms some causal LMs apply after their head (Cohere's ``logit_scale``,
    Granite's ``logits_scaling``, Gemma 2/3's ``final_logit_softcapping``): element-wise, so they commute
    with keeping only some ids."""
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, int | float) and scale != 1:
        logits = logits * scale
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, int | float) and divisor != 1:
        logits = logits / divisor
    cap = getattr(config, "final_logit_softcapping", None)
    if isinstance(cap, int | float) and cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def draft_support(model: Any) -> torch.Tensor | None:
    """The ascending ids a :class:`DraftVocabModel` drafts over, when a call with ``full_logits=False``
    can return its logits over them alone; None for any other model."""
    return model.draft_ids if isinstance(model, DraftVocabModel) else None


def with_draft_vocab(model: Any) -> Any:
    """``model`` wrapped in :class:`DraftVocabModel` when its config names a draft vocabulary; a model
    without one, or already wrapped, is returned unchanged."""
    if isinstance(model, DraftVocabModel):
        return model
    ids = draft_vocab_of(model)
    return DraftVocabModel(model, ids) if ids else model
