"""Pure sampling and verification math for speculative decoding.

Every function works on plain tensors; shapes are given in the docstrings with ``V`` the vocabulary
size and ``*`` any leading batch dimensions. The same functions are used for training rollouts and for
evaluation, so a drafter is trained under the regime it is evaluated under (docs/decoding.md).

Temperature 0 means greedy decoding: :func:`warp` returns the one-hot distribution on the argmax, so
every formula below stays well defined (expected acceptance becomes 1 if the argmaxes agree, else 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "LENIENCES",
    "SamplingParams",
    "apply_lenience",
    "compact_residual_mass",
    "draw_index",
    "expected_acceptance_per_position",
    "greedy_ids",
    "residual",
    "residual_mass",
    "sample",
    "sample_with_uniform",
    "uniforms",
    "warp",
]


@dataclass(frozen=True)
class SamplingParams:
    """Decoding regime applied identically to the verifier (p) and the drafter (q).

    temperature: >= 0; 0 means greedy (argmax). top_k: >= 0; 0 disables top-k.
    top_p: in (0, 1]; 1.0 disables nucleus filtering.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or (
            self.temperature < 0
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in the range (0, 1] (1.0 = disabled), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the warped sampling distribution.

    logits: (*, V) float. Returns probs: (*, V) float32, rows summing to 1.
    Order: temperature, then top-k, then top-p (nucleus: a token is kept when the mass of the tokens
    *strictly* more likely than it is below top_p, so the most likely token is always kept and tokens
    tied in probability are kept or dropped together: the result does not depend on sort order or on
    how the vocabulary is permuted). Temperature 0 returns the one-hot
    distribution on the argmax (first index on ties, like ``torch.argmax``).
    """
    if params.temperature == 0.0:
        idx = greedy_ids(logits).unsqueeze(-1)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)
    if params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0:
        # one operation, widening to float32 first (the same values as ``logits.float().softmax``):
        # in the decoding loop every operation costs ~10 us more than its arithmetic, caches cold after a
        # forward (docs/decoding.md, "The loop's own cost")
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    logits = logits.float()
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits.softmax(dim=-1), params.top_p), float("-inf"))
    return logits.softmax(dim=-1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of ``logits`` (*, V) over V, computed in float32: (*,) long, the first index on ties.

    Widening bfloat16 or float16 to float32 is exact, so the result is the same as on the logits as
    given; on a CPU it is 3-5x faster (about 160 us against 45 us for 49,152 bfloat16 logits on two
    cores, docs/real_pair.md): PyTorch's bfloat16 argmax is not vectorised. Every greedy pick of the
    engine goes through here.
    """
    return logits.float().argmax(dim=-1)


def _outside_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(*, V) bool: tokens whose strictly-more-likely mass already reaches ``top_p``.

    Ties are resolved as a group (the mass *strictly* above each token counts), so the mask is
    invariant to permutations of the vocabulary and to the sort's handling of equal values.
    """
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    mass_before = torch.nn.functional.pad(sorted_probs.cumsum(dim=-1), (1, 0))  # (*, V + 1)
    ascending = sorted_probs.flip(-1).contiguous()
    # number of tokens strictly more likely than each token = V - #(tokens <= it)
    n_greater = probs.shape[-1] - torch.searchsorted(ascending, probs.contiguous(), right=True)
    return mass_before.gather(-1, n_greater) >= top_p


def uniforms(
    shape: int | tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Uniform[0, 1) float64 draws from ``generator``, made on the generator's own device, then moved.

    Every random number of the decoders comes from here, so one ``torch.Generator`` gives the same
    draws whatever devices the models sit on (a CPU generator cannot draw on CUDA, and two models on
    two devices could share no device-bound generator).
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    size = (shape,) if isinstance(shape, int) else shape
    u = torch.rand(size, generator=generator, device=gen_device, dtype=torch.float64)
    return u if device is None else u.to(device)


def sample_with_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the token whose cumulative-mass interval holds ``u``.

    probs: (*, V) non-negative (need not be normalised); u: (*,) in [0, 1). Returns (*,) long. A token
    with zero mass is never returned (the last token with positive mass absorbs rounding at u -> 1).
    """
    if probs.dim() == 1:  # one draw (the decoders' case): the same search, with Python scalars
        return torch.tensor(draw_index(probs, float(u)), device=probs.device)
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    target = (u.to(cdf.device, torch.float64) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # where the cdf first reaches its total: the last token the cdf can land on (its mass is positive)
    last_positive = torch.searchsorted(cdf, cdf[..., -1:].contiguous(), right=False).squeeze(-1)
    return torch.minimum(idx, last_positive)


def draw_index(probs: torch.Tensor, u: float) -> int:
    """:func:`sample_with_uniform` for one row (V,) and a Python uniform: the index as a Python int (the
    same float64 cdf and search; the decoders draw one token at a time and want the int)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = float(cdf[-1])
    idx = int(torch.searchsorted(cdf, u * total, right=True))
    if idx == cdf.shape[0]:  # u * total rounded up to the total: the last token with positive mass
        idx = int(torch.searchsorted(cdf, total, right=False))
    return idx


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row. probs: (*, V) non-negative, rows summing to 1. Returns (*,) long.

    The uniforms come from :func:`uniforms`, so the draw depends on the generator only, not on the
    device ``probs`` lives on.
    """
    return sample_with_uniform(probs, uniforms(tuple(probs.shape[:-1]), generator, probs.device))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rejection residual norm(max(0, p - q)).

    p, q: (*, V) probabilities. Returns (*, V). Rows whose residual sums to 0 in floating point (p <= q
    everywhere, e.g. p == q) fall back to p, as docs/decoding.md prescribes.
    """
    r = residual_mass(p, q)
    return r / r.sum(dim=-1, keepdim=True)


def residual_mass(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) *unnormalised*, or p where that sums to 0: what :func:`sample_with_uniform` draws
    the residual from without the division. p, q: (*, V). Returns (*, V)."""
    r = (p - q).clamp_min_(0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def compact_residual_mass(p: torch.Tensor, q: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """:func:`residual_mass` of one row for a q kept compact: ``q`` (N,) over the ids ``support`` (N,),
    zero on every other id of p (V,). The same values as on q placed in the vocabulary (p - 0 = p off
    the support), without forming that row."""
    r = p.clone()
    r.index_copy_(0, support, (p.index_select(0, support) - q).clamp_min_(0.0))
    return r if bool(r.sum() > 0) else p


def _linear(p: torch.Tensor, eps: float) -> torch.Tensor:
    return p / eps


def _squared(p: torch.Tensor, eps: float) -> torch.Tensor:
    return p / (eps * eps)


def _exponential(p: torch.Tensor, eps: float) -> torch.Tensor:
    return p.pow(eps)


#: DistillSpec lenience functions f(p, eps); eps = 1 is the identity (lossless) for all of them.
LENIENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "linear": _linear,
    "squared": _squared,
    "exponential": _exponential,
}


def apply_lenience(p: torch.Tensor, lenience: str | None, eps: float) -> torch.Tensor:
    """f(p, eps) for the lossy acceptance test. p: any shape. lenience None or eps == 1 returns p itself."""
    if lenience is None or eps == 1.0:
        return p
    try:
        fn = LENIENCES[lenience]
    except KeyError:
        raise ValueError(f"lenience must be one of {sorted(LENIENCES)} or None, got {lenience!r}") from None
    return fn(p, eps)


def expected_acceptance_per_position(
    p: torch.Tensor, q: torch.Tensor, lenience: str | None = None, eps: float = 1.0
) -> torch.Tensor:
    """Probability that the acceptance test passes for a draft x ~ q, per row.

    sum_v q(v) min(1, f(p(v), eps) / q(v)) = sum_v min(q(v), f(p(v), eps)); lossless (f = identity)
    this is sum_v min(p(v), q(v)) = 1 - TVD(p, q). p, q: (*, V) probabilities. Returns (*,).
    Clamped to 1: a lenient f often makes the sum sum_v q(v) itself, which rounds to 1 + 1e-7 in float32.
    """
    return torch.minimum(q, apply_lenience(p, lenience, eps)).sum(dim=-1).clamp(max=1.0)
