"""Task metrics of generated continuations: how far a (lossy) decoder's output is from the verifier's.

Two small measures, used by ``scripts/lenience.py`` (DistillSpec's lossy trade-off, docs/distillspec.md):

* :func:`token_nll` / :func:`continuation_nll`: the negative log-likelihood (nats) of each generated
  token under a model's softmax at a temperature. Under the verifier at T = 1, its mean over the
  tokens of lossless samples is the verifier's own per-token entropy; a lenient acceptance rule that
  lets through tokens the verifier finds unlikely raises it.
* :func:`lcs_length` / :func:`rouge_l`: ROUGE-L (longest common subsequence) between two token-id
  sequences, e.g. a generated continuation against the corpus's true one. Token ids, not words: the
  score needs no detokenisation and is exact for any tokenizer.

Shapes: ``V`` is the vocabulary (the model's output size), ``T`` the number of scored tokens, ``*``
any leading dimensions. Nothing here samples or decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RougeL", "continuation_nll", "lcs_length", "rouge_l", "token_nll"]


def token_nll(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-log softmax(logits / temperature)[target] per position.

    logits: (*, T, V) float, the logits that *predict* each target (already shifted: row t scores
    ``targets[..., t]``). targets: (*, T) long, each in [0, V). temperature: > 0. Returns (*, T) float32.
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 (the NLL of a greedy argmax is undefined), got {temperature}"
        )
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} plus a vocabulary dimension"
        )
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


@torch.inference_mode()
def continuation_nll(
    model: torch.nn.Module,
    prompt: torch.Tensor | Sequence[int],
    continuation: torch.Tensor | Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token NLL of ``continuation`` after ``prompt`` under a causal LM (one forward pass).

    prompt: (P,) or (1, P) token ids, P >= 1. continuation: (T,) or (1, T) token ids. Returns (T,)
    float32 on CPU: entry t is -log p(continuation[t] | prompt, continuation[:t]) at ``temperature``;
    empty when T = 0 (the model is not run).
    """
    p = torch.as_tensor(prompt, dtype=torch.long).reshape(-1).cpu()
    c = torch.as_tensor(continuation, dtype=torch.long).reshape(-1).cpu()
    if p.numel() == 0:
        raise ValueError(
            "prompt must hold at least one token (the first continuation token is scored after it)"
        )
    if c.numel() == 0:
        return torch.zeros(0)
    device = next(model.parameters()).device
    ids = torch.cat([p, c]).unsqueeze(0).to(device)
    logits = model(input_ids=ids).logits[0]  # (P + T, V): row i predicts token i + 1
    predicting = logits[p.numel() - 1 : p.numel() - 1 + c.numel()]  # (T, V)
    return token_nll(predicting, c.to(device), temperature).cpu()


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of two sequences
    (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, start=1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class RougeL:
    """ROUGE-L of a candidate against a reference: LCS / len(candidate), LCS / len(reference), and
    their harmonic mean (F1, beta = 1). All 0 when either sequence is empty."""

    precision: float
    recall: float
    f1: float


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> RougeL:
    """ROUGE-L between two token-id sequences (Lin 2004, sentence level, beta = 1)."""
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return RougeL(0.0, 0.0, 0.0)
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return RougeL(precision, recall, 2 * precision * recall / (precision + recall))
