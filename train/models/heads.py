"""Medusa / blockwise prediction heads on a verifier's last hidden state (docs/medusa.md).

Head k (k = 0..K-1) reads the verifier's final hidden state h_t and predicts token t + k + 2 (the
verifier's own ``lm_head`` predicts t + 1). A head is ``num_layers`` *distinct* residual blocks
``x + SiLU(W x + b)`` (W and b zero-initialised, so a fresh block is the identity; the authors' code
repeats one block object, sharing its weights, which is a known bug, not a design), then a vocabulary
projection initialised from the verifier's ``lm_head`` (:meth:`MedusaHeads.from_verifier`), so a fresh
head predicts what the verifier's next-token head predicts. Blockwise parallel decoding (Stern et al.
2018) uses the same module as a top-1 chain.

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

__all__ = ["MedusaBlock", "MedusaHeads", "medusa_loss", "shifted_targets", "shifted_teacher"]


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
        self.blocks = nn.ModuleList(MedusaBlock(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads (all by default): a depth-d tree needs only d."""
        pairs = list(zip(self.blocks, self.lm_heads, strict=True))[:num_heads]
        return torch.stack([head(block(hidden)) for block, head in pairs])

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
        )
        weight = next(self.parameters())
        out.to(device=weight.device, dtype=weight.dtype)
        out.load_state_dict(self.state_dict())
        return out

    @classmethod
    def from_verifier(cls, verifier: nn.Module, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
        """Heads for ``verifier`` (a Hugging Face causal LM): its hidden size, its output vocabulary, and
        each projection a copy of its ``lm_head`` (tied embeddings included); its dtype and device."""
        lm_head = verifier.get_output_embeddings()  # type: ignore[operator]
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"{type(verifier).__name__} has no output embedding weight to copy into the heads"
            )
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the verifier's lm_head has a bias; Medusa heads (and vLLM's loader) have none")
        vocab, hidden = weight.shape
        heads = cls(int(hidden), int(vocab), num_heads=num_heads, num_layers=num_layers)
        heads.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for head in heads.lm_heads:
                head.get_parameter("weight").copy_(weight)
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


def shifted_teacher(teacher_logits: torch.Tensor, head: int) -> torch.Tensor:
    """The verifier's logits for head ``head``'s target at every position t: its row t + head + 1
    (which predicts token t + head + 2). teacher_logits: (B, T, V); rows past the end wrap around and
    are invalid exactly where :func:`shifted_targets` says so."""
    return torch.roll(teacher_logits, -(head + 1), dims=-2)


def medusa_loss(
    head_logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    decay: float = 0.8,
    teacher_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sum over heads of ``decay**k`` x head k's loss against the token k + 2 ahead.

    Hard labels (``teacher_logits`` None): cross-entropy against ``input_ids`` shifted by k + 2.
    Self-distillation (``teacher_logits`` (B, T, V), the verifier's logits on the same ids): forward
    KL(p_verifier || q_head) against the verifier's distribution at the shifted position (soft targets).
    head_logits: (K, B, T, V) from :class:`MedusaHeads` on the verifier's last hidden states;
    input_ids: (B, T); mask: (B, T), 1 where a token is real (a target must be real too).
    Returns (the weighted loss, each head's mean loss)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    total = head_logits.new_zeros((), dtype=torch.float32)
    per_head = []
    for k in range(head_logits.shape[0]):
        targets, valid = shifted_targets(input_ids, k)
        target_real, _ = shifted_targets(real.long(), k)
        keep = valid & real & target_real.bool()
        if not bool(keep.any()):
            per_head.append(total.new_zeros(()))
            continue
        log_q = head_logits[k][keep].float().log_softmax(dim=-1)
        if teacher_logits is None:
            loss = F.nll_loss(log_q, targets[keep])
        else:
            log_p = shifted_teacher(teacher_logits, k)[keep].float().log_softmax(dim=-1)
            loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        per_head.append(loss.detach())
        total = total + (decay**k) * loss
    return total, per_head
