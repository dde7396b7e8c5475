"""Token-level distillation divergences for training drafters (DistillSpec / GKD).

DistillSpec (Zhou et al., ICLR 2024, arXiv 2310.08461) trains a drafter q_theta to minimise

    E_{(x, y) ~ G} [ mean_t D( p(. | x, y_<t) || q_theta(. | x, y_<t) ) ]

over the continuation tokens y, where p is the frozen verifier and q the drafter (GKD's teacher and student).
GKD (Agarwal et al., arXiv 2306.13649) supplies the generalised Jensen-Shannon divergence and its beta
convention. The formulas are in :mod:`train.losses.rows`; docs/distillspec.md gives them as a table.

Conventions shared by :func:`divergence` and :func:`acceptance_from_logits`:

* **Shapes.** Logits are ``(B, T, V)`` or ``(N, V)`` (any leading shape); ``mask`` has the leading shape,
  bool or 0/1, and its nonzero entries select the continuation tokens that count; None selects all.
* **Reduction.** A 0-d tensor: the mean over the selected tokens of the batch (longer continuations weigh
  more than under a per-sequence ``1/|y|`` mean). An empty mask gives an exact 0 that is still connected
  to ``drafter_logits``' graph, so ``backward()`` yields an all-zero gradient (no NaN from 0/0).
* **Temperature** divides both logits before the softmax; no ``T**2`` gradient rescaling.
* **Vocabulary mismatch** (same tokenizer, embeddings padded to different multiples): both sides are
  compared over the common prefix ``V = min(V_d, V_v)``, the extra logits dropped before the softmax, so
  each side is renormalised over the shared ids and the drafter's padding gets zero gradient.
* **Numerics.** Everything is computed in log space in at least float32 (bf16/fp16 upcast per chunk,
  float64 kept). Log-probabilities are clamped below at the dtype's most negative finite value, so
  ``0 * log 0 = 0`` holds exactly and values and gradients stay finite when probabilities underflow or
  logits are ``-inf``. The only non-finite results are the mathematically infinite ones (RKL when the
  verifier gives exactly zero probability to a token the drafter supports). ``D(p, p)`` may read ~-1e-7
  (rounding, left unclamped so the gradient stays exact).
* **Memory.** Nothing is gathered or flattened up front (a non-contiguous ``logits[:, :-1]`` is not
  copied): the selected positions are processed ``chunk_size`` rows at a time
  (:mod:`train.losses.chunks`). With a gradient, its closed form (:func:`train.losses.rows.row_gradient`)
  is written chunk by chunk into one buffer shaped like ``drafter_logits`` during the forward pass, and
  ``backward`` scales it in place: peak extra memory is that buffer, which autograd needs anyway, plus
  ``O(chunk_size * V)`` float32 intermediates, whatever ``B * T``, with no recomputation (the price: no
  double backward, which distillation never needs).
* The verifier is always detached; no gradient flows into ``verifier_logits``.
"""

from train.losses.divergence import DEFAULT_CHUNK_SIZE, acceptance_from_logits, divergence
from train.losses.rows import DIVERGENCES

__all__ = ["DEFAULT_CHUNK_SIZE", "DIVERGENCES", "acceptance_from_logits", "divergence"]
