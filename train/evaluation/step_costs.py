"""The pair's step costs in an evaluation, and the best speedup any draft length could have reached.

:func:`pair_costs` measures (or reads from the per-machine cache, :mod:`train.decoding.cost_probe`) the
verifier's forward over 1 .. 9 tokens and the drafter's step, once per drafter, before anything is timed;
results.json keeps them under ``step_costs`` and the tables print them beside the baseline.

:func:`run_bound` turns a run's pooled figures into its bound: given the per-position acceptance it
measured, the drafter steps it spent per drafted position and the step costs, the best speedup over plain
decoding a chain of any fixed length (none included) reaches (:func:`~train.decoding.costs.speedup_bound`).
A decoder far below its bound chose its lengths badly; a bound below 1 says no length could have paid on
this machine with this drafter. For trees, heads and EAGLE-3 the bound is the chain's along the accepted
path (their drafters' step costs are not measured: an EAGLE-3 or heads bound counts their drafting as free,
so it is an upper bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.decoding import DecodeStats, TimedModel, per_position_acceptance
from train.decoding.cost_probe import MEASURED_TOKENS, step_costs
from train.decoding.costs import StepCosts, speedup_bound
from train.evaluation.decoder_build import drafter_kind
from train.models.draft_vocab import with_draft_vocab

__all__ = ["MEASURED_TOKENS", "break_even_tau", "costs_line", "pair_costs", "run_bound"]


def pair_costs(verifier: torch.nn.Module, drafter: torch.nn.Module) -> StepCosts:
    """The verifier's forward over 1 .. :data:`MEASURED_TOKENS` tokens and, for a drafter model, its step
    as the decoders call it (over its draft vocabulary where it has one; a steered drafter steered)."""
    model = steering = None
    kind = drafter_kind(drafter)
    if kind == "model":
        model = with_draft_vocab(drafter)
    elif kind == "steered":
        model, steering = with_draft_vocab(drafter.drafter), drafter.steering
    timed = TimedModel(model) if model is not None else None
    return step_costs(TimedModel(verifier), timed, MEASURED_TOKENS, steering)


def run_bound(stats: DecodeStats, costs: StepCosts) -> float:
    """The best speedup a chain of any fixed length could have reached with this run's measured
    per-position acceptance and drafter steps per drafted position (module docstring)."""
    acceptance = per_position_acceptance(stats)
    steps = stats.drafter_calls - stats.drafter_prefill_calls
    per_draft = steps / stats.drafted if stats.drafted else 0.0
    return speedup_bound(acceptance, costs, per_draft)[1]


def break_even_tau(costs: Mapping[str, Any], tokens_per_call: float, drafter_cost: float) -> float:
    """The block efficiency a decoder needs to match plain decoding when each verifier call checks
    ``tokens_per_call`` tokens (interpolated between measured counts) and adds ``drafter_cost`` verifier
    steps of drafting: ``V(t) / V(1) + drafter_cost``."""
    c = StepCosts.from_dict(dict(costs))
    low = max(1, int(tokens_per_call))
    frac = tokens_per_call - low
    v = c.check(low) + frac * (c.check(low + 1) - c.check(low))
    return v / c.check(1) + drafter_cost


def costs_line(results: Mapping[str, Any]) -> str | None:
    """One line per drafter: what a check of n tokens and a drafter step cost on the machine that ran."""
    all_costs = results.get("step_costs") or {}
    if not all_costs:
        return None
    env = results.get("environment", {})
    lines = []
    for name, raw in all_costs.items():
        c = StepCosts.from_dict(raw)
        shown = [n for n in (1, 2, 3, 4, 6, 8) if n <= len(c.verify)]
        ms = "/".join(f"{1000 * c.check(n):.0f}" for n in shown)
        rel = "/".join(f"{c.check(n) / c.check(1):.2f}" for n in shown)
        draft = (
            f"; drafter step {1000 * c.draft:.1f} ms ({c.draft_ratio:.3f} of a verifier step)"
            if c.draft
            else ""
        )
        lines.append(
            f"- {name}: verifier forward over {'/'.join(map(str, shown))} tokens {ms} ms "
            f"({rel} one-token steps){draft}"
        )
    return (
        f"Step costs measured on this machine before timing ({env.get('dtype', '?')}, "
        f"{env.get('torch_threads', '?')} threads; cached per machine, dtype, threads and pair; "
        "`bound` = the best speedup a chain of any fixed length reaches with the run's measured "
        "per-position acceptance and these costs, 1 = plain decoding):\n\n" + "\n".join(lines) + "\n"
    )
