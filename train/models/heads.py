"""Medusa / blockwise prediction heads on a verifier's last hidden state (ALGORITHMS.md section 3).

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

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

__all__ = ["MedusaBlock", "MedusaHeads", "medusa_loss", "shifted_targets"]


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
    """K prediction heads: ``forward(hidden) -> (K, *hidden.shape[:-1], vocab_size)`` logits."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1) -> None:
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
        self.blocks = nn.ModuleList(MedusaBlock(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads, strict=True)]
        )

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


def medusa_loss(
    head_logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    decay: float = 0.8,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sum over heads of ``decay**k`` x the cross-entropy of head k against labels shifted by k + 2.

    head_logits: (K, B, T, V) from :class:`MedusaHeads` on the verifier's last hidden states;
    input_ids: (B, T); mask: (B, T), 1 where a token is real (a target must be real too).
    Returns (the weighted loss, each head's mean cross-entropy)."""
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
        ce = F.cross_entropy(head_logits[k][keep].float(), targets[keep])
        per_head.append(ce.detach())
        total = total + (decay**k) * ce
    return total, per_head
