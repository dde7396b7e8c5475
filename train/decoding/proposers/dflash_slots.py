"""A DFlash block's slots as distributions (:class:`BlockSlots`), and the tree sampled from them
(:func:`sample_tree`).

One drafter forward gives each slot of a block its logits over the draft vocabulary. Without DSpark's
Markov head those are the slots' distributions, whatever is drafted at the other slots. With the head
(:mod:`train.models.markov_head`) a slot's logits get the bias of the token before it, so the
distribution at a slot depends on what was chosen (or drawn) at the slot before: the walk left to right
along a chain, or the bias of each node's own parent in a tree. At T > 0 every distribution is the
biased logits divided by ``draft_temperature`` and warped like the verifier's (temperature, top-k,
top-p). docs/dflash.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.proposers.tree_proposers import gumbel_top_k
from train.decoding.sampling import SamplingParams, draw_index, uniforms, warp
from train.models.dflash_drafter import DFlashDrafter

__all__ = ["BlockSlots", "sample_tree"]


class BlockSlots:
    """The slots' distributions of a :class:`DFlashDrafter`'s blocks over its draft ids ``targets``."""

    def __init__(self, drafter: DFlashDrafter, targets: torch.Tensor, draft_temperature: float) -> None:
        self.targets = targets
        #: The draft ids as a list (a column's target id without a tensor read).
        self.target_ids: list[int] = targets.tolist()
        self.draft_temperature = draft_temperature
        head = drafter.markov_head
        #: The Markov head's float32 factors and bias table, shared with the drafter's other decoders
        #: (:meth:`~train.models.markov_head.MarkovHead.walk_weights`): a slot whose predecessor is a draft
        #: token (every slot after the first, and the first where the anchor is one) reads its row of the
        #: table instead of an N x r product (about a tenth of a DSpark block on a CPU). None: no head.
        self.markov = head.walk_weights(targets) if head is not None else None
        #: Draft-vocabulary column of each target id, where the walk has a table to read.
        self._columns = (
            {target: column for column, target in enumerate(self.target_ids)}
            if self.markov is not None and self.markov.table is not None
            else {}
        )

    def biased(self, row: torch.Tensor, previous: int) -> torch.Tensor:
        """A slot's (N,) float logits plus the Markov head's bias after the target id ``previous``: the
        table's row where ``previous`` is a draft token and the table is kept, else computed."""
        walk = self.markov
        assert walk is not None
        column = self._columns.get(previous)
        if column is not None and walk.table is not None:
            return row + walk.table[column]
        return torch.addmv(row, walk.w2, walk.w1[previous])

    def along_argmax(self, logits: torch.Tensor, anchor: int) -> torch.Tensor:
        """The block's logits (n, N) with the Markov head's bias of each slot's predecessor on the argmax
        path (slot 1's: the anchor's); unchanged without a Markov head."""
        if self.markov is None:
            return logits
        rows, previous = [], anchor
        for row in logits:
            rows.append(self.biased(row, previous))
            previous = self.target_ids[int(rows[-1].argmax())]
        return torch.stack(rows)

    def warped(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Rows of logits as distributions at T > 0: divided by ``draft_temperature``, warped."""
        return warp(logits / self.draft_temperature, params)

    def sampled_walk(
        self, logits: torch.Tensor, anchor: int, params: SamplingParams, u: list[float]
    ) -> tuple[list[int], torch.Tensor]:
        """DSpark's sequential stage at T > 0: slot by slot, the block's logits plus the bias of the token
        just drawn, warped, then drawn from with ``u``; the columns and the rows they were drawn from."""
        rows, columns, previous = [], [], anchor
        for i, row in enumerate(logits):
            rows.append(self.warped(self.biased(row, previous)[None], params)[0])
            columns.append(draw_index(rows[-1], u[i]))
            previous = self.target_ids[columns[-1]]
        return columns, torch.stack(rows)

    def after(self, row: torch.Tensor, previous: list[int], params: SamplingParams) -> torch.Tensor:
        """A slot's q (k, N) after each of the ``previous`` tokens: its logits (N,) warped, with the Markov
        head's bias of each predecessor where there is a head; without one every row is the same
        distribution, computed once."""
        if self.markov is None:
            return self.warped(row[None], params).expand(len(previous), -1)
        return self.warped(torch.stack([self.biased(row, token) for token in previous]), params)


def sample_tree(
    slots: BlockSlots,
    logits: torch.Tensor,
    anchor: int,
    widths: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: frozenset[int],
) -> Draft:
    """A tree sampled from the block at T > 0 (children per depth ``widths``; RSD-C's tree, Jeon et al.
    2024): every node at depth d (the anchor's children at depth 1) gets ``widths[d]`` children drawn
    *without replacement* (Gumbel-top-k over the draft vocabulary; fewer where q has fewer tokens) from
    slot d + 1's q after that node's token (:meth:`BlockSlots.after`: the same q for every node without
    a Markov head, whose slots do not read the tokens before them), in draw order, each handed that q; no
    node after an eos, no depth past the block's slots (``logits``: (n, N)). Verified by the recursive
    rule without replacement: lossless for any q, since every sibling set is a without-replacement sample
    of the q it carries, made from the committed sequence and the node's path alone."""
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []
    columns: list[int] = []
    rows: list[torch.Tensor] = []
    frontier: list[tuple[int, int]] = [(-1, anchor)]  # (node, its token) to expand
    for depth, width in enumerate(widths[: logits.shape[0]]):
        q = slots.after(logits[depth], [token for _, token in frontier], params)  # (k, N)
        drawn, scores = gumbel_top_k(torch.log(q), width, uniforms(tuple(q.shape), generator, q.device))
        expand: list[tuple[int, int]] = []
        for row, ((parent, _), picks, marks) in enumerate(
            zip(frontier, drawn.tolist(), scores.tolist(), strict=True)
        ):
            for rank, (column, score) in enumerate(zip(picks, marks, strict=True)):
                if score == -math.inf:  # q has fewer tokens than the width
                    break
                token = slots.target_ids[column]
                if token not in eos:
                    expand.append((len(tokens), token))
                tokens.append(token)
                parents.append(parent)
                ranks.append(rank)
                columns.append(column)
                rows.append(q[row])
        frontier = expand
        if not frontier:
            break
    q_rows = torch.stack(rows)
    return Draft(
        tokens, parents, q_rows, ranks, kind="without_replacement", support=slots.targets, columns=columns
    )
