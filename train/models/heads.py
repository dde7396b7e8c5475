"""Medusa / blockwise prediction heads on a verifier's last hidden state (docs/medusa.md).

Head k (k = 0..K-1) reads the verifier's final hidden state h_t and predicts token t + k + 2 (the
verifier's own ``lm_head`` predicts t + 1). A head is ``num_layers`` *distinct* residual blocks
``x + SiLU(W x + b)`` (W and b zero-initialised, so a fresh block is the identity; the authors' code
repeats one block object, sharing its weights, which is a known bug, not a design), then a vocabulary
projection initialised from the verifier's ``lm_head`` (:meth:`MedusaHeads.from_verifier`), so a fresh
head predicts what the verifier's next-token head predicts. Blockwise parallel decoding (Stern et al.
2018) uses the same module as a top-1 chain.

A reduced output vocabulary (``draft_vocab``, FR-Spec's idea, as the pair's drafter and EAGLE-3 use
it): each head projects onto those ids only (``lm_heads.{h}.weight`` is ``(len(draft_vocab), hidden)``,
initialised from the verifier's rows for them) and :meth:`MedusaHeads.forward` scatters the result into
full-vocabulary logits, ``-inf`` elsewhere, so every decoder reads them unchanged. On a 49,152-token
verifier a full projection per head is 28M parameters, as many bytes per step as a fifth of the
verifier; 8,192 rows cut that six-fold. Decoding stays exact: the heads only propose candidates, the
verifier decides (docs/medusa.md). vLLM reads such heads with full-vocabulary rows
(train/export/medusa_layout.py).

Parameter names are the ones vLLM's Medusa loader reads: ``blocks.{h}.layers.{l}.weight`` / ``.bias``
and ``lm_heads.{h}.weight``. ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` come from
``huggingface_hub.PyTorchModelHubMixin`` (safetensors plus a ``config.json`` of the constructor's
arguments).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from train.models.draft_vocab import draft_rows_of, restrict_logits, scatter_draft_logits
from train.renames import renamed_keywords

__all__ = ["MedusaBlock", "MedusaHeads", "medusa_loss", "shifted_targets", "shifted_verifier"]


class MedusaBlock(nn.Module):
    """One head's residual stack: ``num_layers`` distinct ``x + SiLU(W x + b)`` layers, zero-initialised."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        linears = [nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)]
        for linear in linears:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
        self.layers = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="draftsmith",
    tags=["speculative-decoding", "medusa", "draftsmith"],
):
    """K prediction heads: ``forward(hidden) -> (K, *hidden.shape[:-1], vocab_size)`` logits.

    ``tree``: the sparse tree (paths of ranks, Medusa's "choices") these heads were measured to suit,
    saved in ``config.json``; :class:`train.decoding.HeadsDecoder` uses it when given no tree.
    ``rank_accuracy[k][r]``: how often head k's rank-r guess was the verifier's token on validation data
    (saved too), from which ``HeadsDecoder(tree_nodes=N)`` builds a tree of another size.
    """

    draft_ids: torch.Tensor
    """``draft_vocab`` as a long tensor on the heads' device (empty without one; not in the state dict)."""
    drafter_kind: ClassVar[str] = "heads"
    """What decoders take this drafter (:class:`train.decoding.HeadsDecoder`), not a second model."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        tree: list[list[int]] | None = None,
        rank_accuracy: list[list[float]] | None = None,
        draft_vocab: list[int] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("vocab_size", vocab_size),
            ("num_heads", num_heads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.tree = None if tree is None else [[int(r) for r in path] for path in tree]
        if self.tree is not None and any(not p or len(p) > num_heads for p in self.tree):
            raise ValueError(f"tree paths must have 1..num_heads ({num_heads}) ranks, got {tree!r}")
        self.rank_accuracy = None if rank_accuracy is None else [[float(a) for a in r] for r in rank_accuracy]
        self.draft_vocab = None if draft_vocab is None else [int(i) for i in draft_vocab]
        if self.draft_vocab is not None and (
            not self.draft_vocab
            or self.draft_vocab != sorted(set(self.draft_vocab))
            or self.draft_vocab[0] < 0
            or self.draft_vocab[-1] >= vocab_size
        ):
            raise ValueError(
                f"draft_vocab must be sorted unique ids in [0, {vocab_size}), "
                f"got {len(draft_vocab or [])} ids"
            )
        outputs = vocab_size if self.draft_vocab is None else len(self.draft_vocab)
        self.num_outputs = outputs
        """Rows of each head's projection: the draft vocabulary's size, or the whole vocabulary's."""
        self.blocks = nn.ModuleList(MedusaBlock(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, outputs, bias=False) for _ in range(num_heads))
        ids = torch.tensor(self.draft_vocab if self.draft_vocab is not None else [], dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)  # config.json holds the list

    def draft_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``(K, *hidden.shape[:-1], N)``: the first ``num_heads`` heads' logits over their own outputs
        (``draft_vocab``'s ids in order, or the whole vocabulary): what training reads."""
        pairs = list(zip(self.blocks, self.lm_heads, strict=True))[:num_heads]
        return torch.stack([head(block(hidden)) for block, head in pairs])

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Full-vocabulary logits of the first ``num_heads`` heads (all by default; a depth-d tree needs
        only d): ``-inf`` outside ``draft_vocab``."""
        logits = self.draft_logits(hidden, num_heads)
        if self.draft_vocab is None:
            return logits
        return scatter_draft_logits(logits, self.draft_ids, self.vocab_size)

    def with_tree(
        self, tree: list[list[int]] | None, rank_accuracy: list[list[float]] | None = None
    ) -> MedusaHeads:
        """A copy of these heads (same weights, device and dtype) that records ``tree`` and the measured
        ``rank_accuracy`` in its config."""
        out = type(self)(
            self.hidden_size,
            self.vocab_size,
            self.num_heads,
            self.num_layers,
            tree=tree,
            rank_accuracy=rank_accuracy if rank_accuracy is not None else self.rank_accuracy,
            draft_vocab=self.draft_vocab,
        )
        weight = next(self.parameters())
        out.to(device=weight.device, dtype=weight.dtype)
        out.load_state_dict(self.state_dict())
        return out

    @classmethod
    def from_verifier(
        cls,
        verifier: nn.Module,
        num_heads: int = 4,
        num_layers: int = 1,
        draft_vocab: list[int] | None = None,
    ) -> MedusaHeads:
        """Heads for ``verifier`` (a Hugging Face causal LM): its hidden size, its output vocabulary, and
        each projection a copy of its ``lm_head`` (tied embeddings included; with ``draft_vocab``, of
        those ids' rows); its dtype and device."""
        lm_head = verifier.get_output_embeddings()  # type: ignore[operator]
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"{type(verifier).__name__} has no output embedding weight to copy into the heads"
            )
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the verifier's lm_head has a bias; Medusa heads (and vLLM's loader) have none")
        vocab, hidden = weight.shape
        heads = cls(
            int(hidden), int(vocab), num_heads=num_heads, num_layers=num_layers, draft_vocab=draft_vocab
        )
        heads.to(device=weight.device, dtype=weight.dtype)
        rows = weight if draft_vocab is None else weight[heads.draft_ids.to(weight.device)]
        with torch.no_grad():
            for head in heads.lm_heads:
                head.get_parameter("weight").copy_(rows)
        return heads


def shifted_targets(input_ids: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head ``head``'s targets for positions t of ``input_ids`` (B, T): token t + head + 2.

    Returns (targets (B, T), valid (B, T) bool): positions whose target lies past the sequence are
    invalid (their target is a copy of a real id, never used)."""
    shift = head + 2
    targets = torch.roll(input_ids, -shift, dims=-1)
    valid = torch.zeros_like(input_ids, dtype=torch.bool)
    valid[..., : max(input_ids.shape[-1] - shift, 0)] = True
    return targets, valid


def shifted_verifier(verifier_logits: torch.Tensor, head: int) -> torch.Tensor:
    """The verifier's logits for head ``head``'s target at every position t: its row t + head + 1
    (which predicts token t + head + 2). verifier_logits: (B, T, V); rows past the end wrap around and
    are invalid exactly where :func:`shifted_targets` says so."""
    return torch.roll(verifier_logits, -(head + 1), dims=-2)


@renamed_keywords(teacher_logits="verifier_logits")
def medusa_loss(
    head_logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    decay: float = 0.8,
    verifier_logits: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    target_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sum over heads of ``decay**k`` x head k's loss against the token k + 2 ahead.

    Hard labels (``verifier_logits`` None): cross-entropy against ``input_ids`` shifted by k + 2.
    Self-distillation (``verifier_logits`` (B, T, V), the verifier's logits on the same ids): forward
    KL(p_verifier || q_head) against the verifier's distribution at the shifted position (soft targets).
    head_logits: (K, B, T, N) from :meth:`MedusaHeads.draft_logits` on the verifier's last hidden states,
    N = V, or N = len(``draft_ids``) for heads over a draft vocabulary: then the targets are the draft
    rows (a hard target outside the draft vocabulary is skipped: no head can guess it) and the verifier is
    renormalised over the draft ids (FR-Spec / EAGLE-3 training).
    input_ids: (B, T); mask: (B, T), 1 where a token is real (a target must be real too);
    target_mask: (B, T), True on the tokens that may be targets (e.g. the answer's, not the prompt's).
    Returns (the weighted loss, each head's mean loss)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    targetable = real if target_mask is None else real & target_mask.bool()
    # hard targets as the heads' output rows (-1 outside the draft vocabulary), mapped once for all heads
    target_ids = input_ids if draft_ids is None else draft_rows_of(input_ids, draft_ids)
    total = head_logits.new_zeros((), dtype=torch.float32)
    per_head = []
    for k in range(head_logits.shape[0]):
        targets, valid = shifted_targets(target_ids, k)
        target_ok, _ = shifted_targets(targetable.long(), k)
        keep = valid & real & target_ok.bool()
        if draft_ids is not None and verifier_logits is None:
            keep = keep & (targets >= 0)
        if not bool(keep.any()):
            per_head.append(total.new_zeros(()))
            continue
        log_q = head_logits[k][keep].float().log_softmax(dim=-1)
        if verifier_logits is None:
            loss = F.nll_loss(log_q, targets[keep])
        else:
            rows = shifted_verifier(verifier_logits, k)[keep]
            if draft_ids is not None:
                rows = restrict_logits(rows, draft_ids)
            log_p = rows.float().log_softmax(dim=-1)
            loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        per_head.append(loss.detach())
        total = total + (decay**k) * loss
    return total, per_head
