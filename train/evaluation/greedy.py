"""The temperature-0 check: every output must be the verifier's greedy output, up to low-precision ties.

At a difference, the verifier's next-token logits are recomputed in float32 at the first differing
position, with one uncached forward over the prompt and the common prefix. When both tokens' logits
lie within a few units in the last place (ulps) of the top logit, in the precision the verifier
computes in, the two were equally good to that precision: batched and cached forwards may round them
either way, so the difference is recorded as a *tie* (a warning), not an error. Anything else is a
:class:`GreedyMismatchError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from train.decoding import model_device
from train.evaluation.decoder_build import TimedEntry
from train.evaluation.eval_config import EvalConfig
from train.tables import format_value

__all__ = ["GreedyMismatchError", "classify_difference", "first_difference", "float32_logits", "ulp"]

log = logging.getLogger(__name__)


class GreedyMismatchError(RuntimeError):
    """A decoder's output at temperature 0 differs from the verifier's greedy output (not a tie)."""


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Index of the first differing new token (the shorter length if one is a prefix); None if equal."""
    for i, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude`` (one unit in the last place)."""
    info = torch.finfo(dtype)
    m = max(abs(float(magnitude)), float(info.tiny))
    return float(2.0 ** math.floor(math.log2(m)) * info.eps)


@torch.inference_mode()
def float32_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits (V,) in float32 after ``input_ids`` (1, T), from one uncached forward.

    A float32 model's logits are used as they are. For a lower-precision model the final hidden state
    (the output head's input, captured with a hook) is projected through a linear head in float32;
    if the head is not a plain ``nn.Linear``, or its float32 projection disagrees with the model's own
    logits beyond their precision (a soft-capped or rescaled head), the logits are upcast instead.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    captured: list[torch.Tensor] = []
    handle = None
    if isinstance(head, torch.nn.Linear):
        handle = head.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
    try:
        out = model(input_ids=input_ids.to(model_device(model)), use_cache=False)
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits[0, -1]
    if logits.dtype == torch.float32 or not captured or not isinstance(head, torch.nn.Linear):
        return logits.float()
    hidden = captured[0][0, -1].float()
    bias = head.bias.float() if head.bias is not None else None
    projected = F.linear(hidden, head.weight.float(), bias)
    low = logits.float()
    scale = low.abs().clamp_min(1.0)
    if bool(((projected - low).abs() <= 4 * torch.finfo(logits.dtype).eps * scale).all()):
        return projected
    return low


def classify_difference(
    verifier: torch.nn.Module,
    prompt: torch.Tensor,
    reference: Sequence[int],
    output: Sequence[int],
    tie_ulps: float,
) -> dict[str, Any] | None:
    """None when ``output`` equals ``reference`` (the greedy output); else a record of the first difference.

    The record: ``position`` (new-token index), ``tokens`` ([greedy token, decoder token], None past
    an end), ``margin`` (|logit difference| in float32), ``top2_margin`` (top logit - second logit),
    ``tolerance`` and ``margin_ulps`` (the margin in ulps of the verifier's dtype), and ``tie``: both
    tokens within ``tie_ulps`` ulps of the top logit.
    """
    j = first_difference(reference, output)
    if j is None:
        return None
    a = int(reference[j]) if j < len(reference) else None
    b = int(output[j]) if j < len(output) else None
    record: dict[str, Any] = {
        "position": j,
        "tokens": [a, b],
        "margin": None,
        "top2_margin": None,
        "tolerance": None,
        "margin_ulps": None,
        "tie": False,
    }
    if a is None or b is None:
        return record  # one output stopped early: no pair of logits to compare
    context = torch.cat([prompt.reshape(-1).cpu(), torch.tensor(list(reference[:j]), dtype=torch.long)])
    logits = float32_logits(verifier, context.unsqueeze(0))
    la, lb = float(logits[a]), float(logits[b])
    top2 = torch.topk(logits, 2).values
    top = float(top2[0])
    dtype = next(verifier.parameters()).dtype
    unit = ulp(dtype if dtype.is_floating_point else torch.float32, max(abs(la), abs(lb), abs(top)))
    tolerance = tie_ulps * unit
    margin = abs(la - lb)
    record.update(
        margin=margin,
        top2_margin=top - float(top2[1]),
        tolerance=tolerance,
        margin_ulps=margin / unit,
        tie=(top - la) <= tolerance and (top - lb) <= tolerance,
    )
    return record


def check_greedy(
    verifier: torch.nn.Module,
    entry: TimedEntry,
    prompts: list[torch.Tensor],
    reference: list[list[int]],
    outputs: list[list[int]],
    seed: int,
    cfg: EvalConfig,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Compare one entry's temperature-0 outputs with the baseline's: return the low-precision ties and
    the other differences (the mismatches), in prompt order; under ``cfg.strict_greedy`` raise
    :class:`GreedyMismatchError` at the first mismatch."""
    ties: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        record = classify_difference(verifier, prompts[i], ref, out, cfg.tie_ulps)
        if record is not None:
            found.append({"seed": seed, "prompt": i, **record})
    for rec in found:
        where = (
            f"{entry.label} with drafter {entry.drafter!r}, seed {seed}, prompt {rec['prompt']}, "
            f"new token {rec['position']}: greedy token {rec['tokens'][0]} "
            f"vs decoder token {rec['tokens'][1]}"
        )
        if rec["tie"]:
            ties.append(rec)
            # expected in bfloat16 (recorded in results.json as greedy_ties): the log file, not the terminal
            log.info(
                "low-precision tie at temperature 0 (%s; float32 margin %s ulp)", where, rec["margin_ulps"]
            )
            continue
        mismatches.append(rec)
        margin = (
            ""
            if rec["margin_ulps"] is None
            else (
                f", float32 margin {format_value(rec['margin_ulps'], 1)} "
                f"ulp > {format_value(cfg.tie_ulps, 1)}"
            )
        )
        msg = (
            f"temperature-0 output differs from the verifier's greedy output ({where}{margin}); "
            f"{sum(1 for r in found if not r['tie'])} of {len(prompts)} prompts differ"
        )
        if cfg.strict_greedy:
            raise GreedyMismatchError(msg)
        log.warning(msg)
    return ties, mismatches
