"""DFlash's training loss: many blocks of one sequence in one forward (docs/dflash.md).

For a sequence t_0 .. t_{T-1} with the verifier's context rows c_0 .. c_{T-1} (:meth:`DFlashDrafter.fuse`)
and its distributions (row r: what the verifier predicts for position r + 1):

- anchors: up to ``num_anchors`` positions a per sequence, drawn at random (without replacement) among
  the positions whose next token is a target (inside the loss mask) and which have context (a >= 1);
- each anchor's block is ``[t_a, mask, ..., mask]`` at positions a .. a + B - 1; its queries see the
  context rows 0 .. a - 1 and the B keys of their own block, nothing else (:func:`block_mask`), so one
  forward trains every block exactly as decoding runs it;
- slot k >= 1 of the block at a is scored against the verifier's distribution at row a + k - 1
  (renormalised over the draft vocabulary): forward KL, kept where position a + k is inside the sequence
  and the loss mask and the verifier's argmax there is a draft id; slot 0 (the anchor) is not scored;
- with DSpark's Markov head (:mod:`train.models.markov_head`), slot k's logits get the bias of the row's
  token at a + k - 1 (teacher forcing: in decoding slot k counts only when slot k - 1's draft was accepted,
  that is when it is the sequence's token at a + k - 1);
- slot k's weight is ``exp(-(k - 1) / slot_decay)`` (the authors' decay: an early slot's miss ends the
  accepted run, a late slot matters only when all before it hit); the loss is the weighted mean over
  kept slots.

The accuracy of slot k is the drafter's argmax (as a target id) against the verifier's argmax; the
simulated block efficiency of the greedy chain is 1 + the mean run of hits from slot 1 over the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from train.models.dflash_drafter import DFlashDrafter, block_inputs
from train.models.eagle3_ttt import VerifierTargets, last_argmax

__all__ = ["BlockResult", "block_mask", "block_loss", "sample_anchors", "slot_weights"]


def slot_weights(block_size: int, slot_decay: float) -> torch.Tensor:
    """(block_size,) float32: 0 for the anchor slot, ``exp(-(k - 1) / slot_decay)`` for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / slot_decay)
    weights[0] = 0.0
    return weights


def sample_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors (B, A) int64 ascending, valid (B, A) bool), A = min(num_anchors, T): positions a >= 1
    inside the sequence whose next position is inside the loss mask, drawn uniformly without
    replacement; rows with fewer such positions pad with invalid anchors (position 0)."""
    batch, length = loss_mask.shape
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    allowed = nxt & attention_mask.bool()
    allowed[:, 0] = False
    count = min(num_anchors, length)
    noise = torch.rand((batch, length), generator=generator, device="cpu").to(loss_mask.device)
    scores = torch.where(allowed, noise, -1.0)
    top = scores.topk(count, dim=1)
    valid = top.values >= 0
    anchors = torch.where(valid, top.indices, 0)
    order = torch.where(valid, anchors, length).argsort(dim=1)  # valid first, ascending
    return anchors.gather(1, order), valid.gather(1, order)


def block_mask(
    anchors: torch.Tensor, valid: torch.Tensor, attention_mask: torch.Tensor, block_size: int
) -> torch.Tensor:
    """(B, 1, A B, T + A B) bool: block i's B queries see the context positions j < anchors[i] (inside the
    sequence) and their own block's B keys. An invalid anchor's queries see their own block only (they
    are never scored; a query must see something)."""
    batch, num = anchors.shape
    length = attention_mask.shape[1]
    positions = torch.arange(length, device=anchors.device)
    context = (positions[None, None, :] < anchors[:, :, None]) & attention_mask.bool()[:, None, :]
    context = context & valid[:, :, None]  # (B, A, T)
    own = torch.eye(num, dtype=torch.bool, device=anchors.device)[None].expand(batch, num, num)
    rows = torch.cat([context, own.repeat_interleave(block_size, dim=2)], dim=2)  # (B, A, T + A B)
    return rows.repeat_interleave(block_size, dim=1)[:, None]


@dataclass
class BlockResult:
    """``loss``: the weighted mean KL (with gradients); per slot k >= 1 (list index k - 1): ``accuracies``
    (scalars), ``counts`` (kept slots, 0-dim int64); ``runs`` / ``blocks``: summed greedy runs of hits from
    slot 1 and the blocks whose slot 1 was eligible (0-dim tensors: one host sync when read)."""

    loss: torch.Tensor
    accuracies: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)
    runs: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


def block_loss(
    drafter: DFlashDrafter,
    aux_states: torch.Tensor,
    batch: dict[str, torch.Tensor],
    targets: VerifierTargets,
    num_anchors: int,
    slot_decay: float,
    generator: torch.Generator | None = None,
) -> BlockResult:
    """The loss of :func:`sample_anchors`' blocks (see the module docstring).

    aux_states: (B, T, n h) the verifier's concatenated auxiliary states; batch: ``input_ids``,
    ``attention_mask`` and ``loss_mask``, each (B, T); targets: the verifier's (B, T) rows
    (:func:`~train.models.eagle3_ttt.verifier_targets`)."""
    input_ids, attention_mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    rows_n, length = input_ids.shape
    size = drafter.block_size
    device = input_ids.device
    anchors, valid = sample_anchors(loss_mask, attention_mask, num_anchors, generator)
    num = anchors.shape[1]
    positions = torch.arange(length, device=device).expand(rows_n, length)
    context = drafter.context_kv(drafter.fuse(aux_states), positions)
    ids = block_inputs(input_ids.gather(1, anchors), size, drafter.mask_token_id)  # (B, A, S)
    offsets = torch.arange(size, device=device)
    slot_positions = anchors[:, :, None] + offsets  # (B, A, S)
    logits = drafter(
        ids.reshape(rows_n, num * size),
        slot_positions.reshape(rows_n, num * size),
        context,
        attention_mask=block_mask(anchors, valid, attention_mask, size),
    ).view(rows_n, num, size, -1)[:, :, 1:]  # slots 1 .. S - 1: (B, A, S - 1, N)
    target_pos = slot_positions[:, :, 1:]  # position a + k each slot predicts
    previous = input_ids.gather(1, (target_pos - 1).clamp(max=length - 1).reshape(rows_n, -1))
    bias = drafter.markov_bias(previous.view(target_pos.shape))  # teacher-forced: the row's token at a+k-1
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    inside = target_pos < length
    rows = (target_pos - 1).clamp(max=length - 1)  # the verifier's row a + k - 1
    flat = rows.reshape(rows_n, -1)
    log_p = targets.logprobs.gather(1, flat[:, :, None].expand(-1, -1, targets.logprobs.shape[-1]))
    log_p = log_p.view(*rows.shape, -1)
    argmax = targets.argmax.gather(1, flat).view(rows.shape)
    in_vocab = targets.in_vocab.gather(1, flat).view(rows.shape)
    target_mask = loss_mask.bool().gather(1, target_pos.clamp(max=length - 1).reshape(rows_n, -1))
    eligible = valid[:, :, None] & inside & target_mask.view(rows.shape)
    kept = eligible & in_vocab
    log_q = logits.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, A, S - 1)
    weights = slot_weights(size, slot_decay).to(device)[1:].expand_as(kl)
    kept_weights = torch.where(kept, weights, 0.0)
    loss = (kl * kept_weights).sum() / kept_weights.sum().clamp(min=1e-8)
    predicted = drafter.draft_ids.to(device)[last_argmax(log_q.detach())]
    hits = (predicted == argmax) & kept
    result = BlockResult(loss=loss)
    for k in range(size - 1):
        n = kept[:, :, k].sum()
        result.counts.append(n)
        result.accuracies.append((hits[:, :, k].sum() / n.clamp(min=1)).float().detach())
    run = hits.long().cumprod(dim=-1).sum(-1)  # hits from slot 1 on, per block
    starts = eligible[:, :, 0]
    result.runs = torch.where(starts, run, 0).sum()
    result.blocks = starts.sum()
    return result
