"""EAGLE-3's training-time test: K drafting steps unrolled over every position at once (docs/eagle3.md).

For a sequence t_0 .. t_{T-1} with fused verifier features f_p (the verifier's state at p, which has
read t_0 .. t_p):

- step 0 at position p reads f_p and token t_{p+1} and predicts the verifier's distribution at p + 1
  (its logits row p + 1, which predicts t_{p+2});
- step k reads step k-1's ``hidden`` at the same position and token t_{p+1+k}; its target is the
  verifier's distribution at p + 1 + k;
- step k's query at p attends step 0's keys at 0 .. p (causal) and, for each step j in 1 .. k, step j's
  key at p only (the same-position diagonal): exactly what a real draft of depth k from position p has
  in its cache;
- step k's RoPE position is p + k (queries and keys).

The steps run one after another, each over all T positions, with the keys of all steps so far
concatenated in one cache and an explicit boolean mask (:func:`ttt_mask`). Positions whose target lies
past the sequence read a padding token; their keys are seen only by themselves (the diagonal) or by
later, equally invalid, positions (causal), so they never reach a kept position.

Loss of step k: forward KL from the verifier's softmax over the draft vocabulary (its logits at the
draft ids, renormalised) to the drafter's, averaged over kept positions: inside the loss mask, inside
the sequence, and whose verifier argmax (over the full vocabulary) is in the draft vocabulary. Total:
``sum_k decay**k * loss_k`` (decay 0.8). Accuracy of step k: the drafter's argmax, mapped to target
ids, equals the verifier's argmax, over the same kept positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from train.models.eagle3_drafter import Eagle3Drafter

__all__ = [
    "TTTResult",
    "VerifierTargets",
    "argmax_hits",
    "chain_counts",
    "head_logits",
    "head_matches",
    "head_targets",
    "last_argmax",
    "step_hits",
    "step_inputs",
    "step_loss",
    "step_positions",
    "targets_loss",
    "ttt_loss",
    "ttt_mask",
    "ttt_unroll",
    "verifier_targets",
]


def step_positions(position_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Step ``step``'s RoPE positions: the base positions (B, T) plus ``step``."""
    return position_ids + step


def step_inputs(input_ids: torch.Tensor, step: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens at every position p: t_{p+1+step} (B, T), ``pad_id`` past the end; and
    ``inside`` (B, T) bool, True where p + 1 + step < T (the token and the target exist)."""
    shift = step + 1
    tokens = torch.full_like(input_ids, pad_id)
    inside = torch.zeros_like(input_ids, dtype=torch.bool)
    length = input_ids.shape[-1]
    if shift < length:
        tokens[:, : length - shift] = input_ids[:, shift:]
        inside[:, : length - shift] = True
    return tokens, inside


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """(1, 1, T, (step + 1) T) bool: step ``step``'s queries over the keys of steps 0 .. step, in that
    order. Step 0's block is causal; each later step's block is the identity (the same position)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=-1)[None, None]


def ttt_unroll(
    drafter: Eagle3Drafter,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int = 7,
    position_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The drafter's logits (B, T, N) at each of ``steps`` steps (see the module docstring).

    features: (B, T, h) fused verifier features (:meth:`Eagle3Drafter.fuse`); input_ids: (B, T);
    position_ids: (B, T) base positions (default ``arange(T)``). Entry k at position p is the drafter's
    prediction of t_{p+2+k}."""
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
    cache = DynamicCache()
    hidden, out = features, []
    for k in range(steps):
        tokens, _ = step_inputs(input_ids, k)
        result = drafter(
            tokens,
            hidden,
            step_positions(position_ids, k),
            attention_mask=ttt_mask(length, k, input_ids.device),
            past_key_values=cache,
        )
        out.append(result.logits)
        hidden = result.hidden
    return out


@dataclass
class VerifierTargets:
    """What the losses need of the verifier's logits (B, T, V), computed once per batch rather than once
    per step: ``logprobs`` (B, T, N) float32, its log-softmax over the draft ids (renormalised there);
    ``argmax`` (B, T), its argmax over the full vocabulary; ``in_vocab`` (B, T) bool, that argmax is a
    draft id."""

    logprobs: torch.Tensor
    argmax: torch.Tensor
    in_vocab: torch.Tensor


def verifier_targets(
    verifier_logits: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor
) -> VerifierTargets:
    argmax = last_argmax(verifier_logits)
    return VerifierTargets(
        logprobs=verifier_logits.index_select(-1, draft_ids.to(verifier_logits.device))
        .float()
        .log_softmax(-1),
        argmax=argmax,
        in_vocab=t2d.to(argmax.device)[argmax],
    )


def head_logits(hidden: torch.Tensor, head: torch.nn.Module, draft_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, N): the rows of ``head`` (a linear output layer, bias optional) for ``draft_ids`` applied to
    ``hidden`` (B, T, h), the verifier's last hidden state after its final norm."""
    ids = draft_ids.to(hidden.device)
    full_weight: torch.Tensor = head.weight  # type: ignore[assignment]
    weight = full_weight.index_select(0, ids)
    bias = getattr(head, "bias", None)
    return F.linear(hidden.to(weight.dtype), weight, None if bias is None else bias.index_select(0, ids))


def head_targets(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    argmax: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
) -> VerifierTargets:
    """:func:`verifier_targets` from the verifier's last hidden state instead of its logits
    (:func:`head_logits`; ``argmax`` (B, T), its argmax over the full vocabulary, kept from the pass that
    had the logits). The same targets as :func:`verifier_targets` of that pass for a plain linear head
    (no logit scale or soft cap; :func:`head_matches` checks)."""
    return VerifierTargets(
        logprobs=head_logits(hidden, head, draft_ids).float().log_softmax(-1),
        argmax=argmax,
        in_vocab=t2d.to(argmax.device)[argmax],
    )


def head_matches(
    hidden: torch.Tensor, head: torch.nn.Module, logits: torch.Tensor, draft_ids: torch.Tensor, atol: float
) -> bool:
    """Whether :func:`head_logits` gives the verifier's ``logits`` (B, T, V) at the draft ids within
    ``atol``: the condition for :func:`head_targets` to stand in for them."""
    recomputed = head_logits(hidden, head, draft_ids).float()
    return bool(
        torch.allclose(
            recomputed, logits.index_select(-1, draft_ids.to(logits.device)).float(), atol=atol, rtol=0
        )
    )


def shifted(x: torch.Tensor, shift: int, fill: float | bool = 0) -> torch.Tensor:
    """(B, T, ...) -> row p holds ``x[:, p + shift]`` (``fill`` past the end)."""
    out = torch.full_like(x, fill)
    length = x.shape[1]
    if shift < length:
        out[:, : length - shift] = x[:, shift:]
    return out


def targets_loss(
    logits: torch.Tensor, targets: VerifierTargets, keep: torch.Tensor, draft_ids: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`step_loss` from :func:`verifier_targets` (the same figures, without re-reading the (B, T, V)
    logits each step). Computed over every row and masked (the drafter's row p against the verifier's
    row p + 1 + step, as aligned slices): gathering the kept rows instead costs a scatter of the whole
    logits tensor in the backward pass. No host sync: with no kept position the sums are 0 and the
    count is clamped to 1, so the loss and the accuracy are 0 (and the gradient too) without asking the
    device whether any position is kept."""
    shift = step + 1
    kept = keep & shifted(targets.in_vocab, shift, False)
    length = logits.shape[1]
    if shift >= length:
        zero = logits.new_zeros((), dtype=torch.float32)
        return zero + 0.0 * logits.sum(), zero.detach(), kept
    rows = kept[:, : length - shift]
    log_p = targets.logprobs[:, shift:]
    log_q = logits[:, : length - shift].float().log_softmax(-1)
    row_kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    count = rows.sum().clamp(min=1)
    loss = torch.where(rows, row_kl, 0.0).sum() / count
    predicted = draft_ids.to(logits.device)[last_argmax(log_q.detach())]
    accuracy = ((predicted == targets.argmax[:, shift:]) & rows).sum() / count
    return loss, accuracy.float().detach(), kept


def last_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first maximal index, as argmax), through ``max``: on a CPU argmax over
    bfloat16 runs about 6x slower than max."""
    return x.max(dim=-1).indices


def step_loss(
    logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    keep: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s loss and accuracy against the verifier.

    logits: (B, T, N) the drafter's at this step; verifier_logits: (B, T, V); keep: (B, T) bool, the
    positions allowed by the loss mask and the sequence end (:func:`step_inputs`); draft_ids: (N,) target
    ids; t2d: (V,) bool. Position p's target is the verifier's row p + 1 + step. Returns (loss: mean
    forward KL over kept positions, 0 if none; accuracy over kept positions, 0 if none; kept: (B, T)
    the positions counted: ``keep`` and the verifier's argmax in the draft vocabulary)."""
    return targets_loss(logits, verifier_targets(verifier_logits, draft_ids, t2d), keep, draft_ids, step)


def argmax_hits(
    logits: torch.Tensor, verifier_argmax: torch.Tensor, draft_ids: torch.Tensor, step: int
) -> torch.Tensor:
    """:func:`step_hits` from the verifier's argmax (B, T)."""
    length, shift = logits.shape[1], step + 1
    hits = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
    if shift < length:
        predicted = draft_ids.to(logits.device)[last_argmax(logits[:, : length - shift])]
        hits[:, : length - shift] = predicted == verifier_argmax[:, shift:].to(logits.device)
    return hits


def step_hits(
    logits: torch.Tensor, verifier_logits: torch.Tensor, draft_ids: torch.Tensor, step: int
) -> torch.Tensor:
    """(B, T) bool: at position p, step ``step``'s argmax (mapped to a target id) is the verifier's argmax
    of row p + 1 + step (False where that row lies past the sequence)."""
    return argmax_hits(logits, last_argmax(verifier_logits), draft_ids, step)


def chain_counts(hits: list[torch.Tensor], eligible: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Teacher-forced chain statistics from the per-step ``hits`` and ``eligible`` masks ((B, T) bool
    each; eligible: the target row is inside the loss mask and the sequence, whatever the vocabulary).

    From every position eligible at step 0, the chain accepts steps 0, 1, ... while each is eligible and
    a hit (a target outside the draft vocabulary is a miss). Under greedy decoding of greedy answers this
    is the chain the decoder would accept, cut at the answer's end. Returns ``run`` (sum of accepted
    lengths), ``starts`` (positions counted) and, per step k, ``cond_hit_k`` / ``cond_n_k``: hits at step k
    among the chains that reached step k."""
    alive = eligible[0].clone()
    starts = alive.sum()
    run = torch.zeros_like(alive, dtype=torch.long)
    out: dict[str, torch.Tensor] = {"starts": starts}
    for k, (hit, keep) in enumerate(zip(hits, eligible, strict=True)):
        reached = alive & keep
        alive = reached & hit
        out[f"cond_n_{k}"] = reached.sum()
        out[f"cond_hit_{k}"] = alive.sum()
        run += alive.long()
    out["run"] = run.sum()
    return out


@dataclass
class TTTResult:
    """``loss``: ``sum_k decay**k * losses[k]``; ``losses`` / ``accuracies``: per step (scalars; the
    losses carry gradients); ``counts``: kept positions per step (0-dim int64 tensors on the logits'
    device: reading them is the caller's one host sync, not one per step); per step, (B, T) bool:
    ``eligible``, the positions whose target row is inside the loss mask and the sequence, and ``hits``,
    the kept ones (eligible, the verifier's argmax in the draft vocabulary) where the drafter's argmax is
    the verifier's."""

    loss: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)
    accuracies: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)
    eligible: list[torch.Tensor] = field(default_factory=list)
    hits: list[torch.Tensor] = field(default_factory=list)


# more than 8 parameters: the training-time test's inputs and the authors' settings
def ttt_loss(
    drafter: Eagle3Drafter,
    aux_states: torch.Tensor,
    input_ids: torch.Tensor,
    verifier_logits: torch.Tensor | VerifierTargets,
    loss_mask: torch.Tensor | None = None,
    steps: int = 7,
    decay: float = 0.8,
    position_ids: torch.Tensor | None = None,
    chain_stats: bool = True,
) -> TTTResult:
    """The training-time test's losses and accuracies (see the module docstring).

    aux_states: (B, T, 3h), the verifier's concatenated auxiliary states (fused here with ``fc``);
    input_ids: (B, T); verifier_logits: (B, T, V), or what the losses read of them (:func:`verifier_targets`,
    :func:`head_targets`); loss_mask: (B, T), position j counts as a target
    (the verifier's row j) where it is true (None: everywhere); steps: K; position_ids: (B, T) base RoPE
    positions (default ``arange(T)``; step k adds k); chain_stats: also fill ``eligible`` / ``hits`` (what
    :func:`chain_counts` reads; validation needs them, a training step does not)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    all_logits = ttt_unroll(drafter, drafter.fuse(aux_states), input_ids, steps, position_ids)
    draft_ids = drafter.draft_ids
    if isinstance(verifier_logits, VerifierTargets):
        targets = verifier_logits
    else:
        targets = verifier_targets(verifier_logits.detach(), draft_ids, drafter.t2d)
    result = TTTResult(loss=all_logits[0].new_zeros((), dtype=torch.float32))
    for k, logits in enumerate(all_logits):
        _, inside = step_inputs(input_ids, k)
        target_mask, _ = step_inputs(mask.long(), k)  # the mask at p + 1 + k
        keep = inside & target_mask.bool()
        loss, accuracy, kept = targets_loss(logits, targets, keep, draft_ids, k)
        result.losses.append(loss)
        result.accuracies.append(accuracy)
        result.counts.append(kept.sum())
        if chain_stats:
            result.eligible.append(keep)
            result.hits.append(argmax_hits(logits.detach(), targets.argmax, draft_ids, k) & kept)
        result.loss = result.loss + (decay**k) * loss
    return result
