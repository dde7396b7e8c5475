"""Chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023), docs/decoding.md.

A thin composition of the engine's parts: a :class:`~train.decoding.proposers.model_proposer.ModelProposer`
drafts up to ``gamma`` tokens with the drafter, :func:`~train.decoding.loop.run_synchronous` verifies them
in one verifier forward with the chain rule (:func:`~train.decoding.rules.chain.greedy_chain` at T = 0,
:func:`~train.decoding.rules.chain.chain_rejection` otherwise) and keeps both caches in step. See
``loop.py`` for the block structure and the cache invariants.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ClassVar

import torch

from train.decoding.cost_probe import step_costs
from train.decoding.costs import StepCosts
from train.decoding.decoders.base import Decoder
from train.decoding.draft_gate import check_fallback_cut, plain_step_gate
from train.decoding.length_policy import CostAwareLength
from train.decoding.loop import run_synchronous
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.proposers.gated_proposer import behind_gate
from train.decoding.proposers.lookup_proposer import lookup_first, prompt_lookup
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.proposers.steered_proposer import SteeredProposer
from train.decoding.rules.rejection import RejectionRule
from train.decoding.sampling import SamplingParams


class SpeculativeDecoder(Decoder):
    """Chain speculative decoding of ``verifier`` with ``drafter`` proposing ``gamma`` tokens per block.

    ``lenience`` (``"linear"``, ``"squared"``, ``"exponential"`` or None) with ``eps`` in (0, 1] gives
    the lossy DistillSpec acceptance test min(1, f(p, eps) / q); eps = 1 is lossless. Lenience only
    applies when sampling (temperature > 0); greedy decoding always reproduces the verifier's argmax.

    ``steering`` (SD^2, e.g. :class:`train.models.steering_module.SteeringModule`): the drafter's MLPs get
    biases from the verifier's states at the last committed position, refreshed after every verification
    (:mod:`train.decoding.proposers.steered_proposer`); verification is unchanged, so it stays lossless.
    A ``steered`` drafter (one carrying its own module, :class:`train.models.steering_module.SteeredDrafter`)
    is unpacked into the two, so the evaluator measures it under the same ``sd`` configs as plain drafters.

    ``confidence_threshold`` t in [0, 1): gamma becomes a cap, and a block's chain ends after the
    first draft the drafter gives a probability below t (0: always ``gamma`` drafts; lossless either
    way, :class:`~train.decoding.proposers.model_proposer.ModelProposer`).

    ``lookup_tokens`` K > 0: prompt lookup first (:mod:`train.decoding.proposers.lookup_proposer`): where
    the committed sequence's last ``lookup_max_ngram`` .. ``lookup_min_ngram`` tokens occurred before,
    the block drafts the (up to K) tokens that followed, at no model cost; elsewhere the drafter drafts
    its ``gamma``. Lossless: the copied draft is a function of the committed sequence.

    ``draft_length="cost"``: ``gamma`` becomes a cap and each block drafts the length with the most
    expected tokens per second under the pair's measured step costs (``costs``, else measured at the
    first call and cached per machine, :mod:`train.decoding.cost_probe`), zero included: a plain
    verifier step where no draft pays (:mod:`train.decoding.length_policy`). Copies are cut the same
    way. Lossless like every length rule here. ``"fixed"`` (the default): ``gamma`` drafts, or the
    confidence stop.

    Verifier and drafter must share a tokenizer. Their output sizes may differ (padded embeddings):
    the verifier's distribution is always kept whole, the drafter proposes only ids it has (zero mass
    elsewhere), so the output is exactly the verifier's either way.
    """

    accepts: ClassVar[tuple[str, ...]] = ("model", "steered")

    # more than 8 parameters: the pair, then the keys of conf/decoding/*.yaml, which Hydra passes by name, and
    # ``costs`` (fixed step costs that tests give instead of measuring them)
    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: torch.nn.Module,
        gamma: int = 4,
        lenience: str | None = None,
        eps: float = 1.0,
        steering: Any = None,
        confidence_threshold: float = 0.0,
        lookup_tokens: int = 0,
        lookup_max_ngram: int = 3,
        lookup_min_ngram: int = 2,
        draft_length: str = "fixed",
        costs: StepCosts | None = None,
        plain_steps: str = "never",
        fallback_cut: bool = False,
    ) -> None:
        if getattr(drafter, "drafter_kind", "model") == "steered":
            if steering is not None:
                raise ValueError("the drafter carries its own steering module; pass steering=None")
            drafter, steering = drafter.drafter, drafter.steering  # type: ignore[assignment]
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        #: The verification rule, with the lenience and eps it was given (validated there).
        self.rule = RejectionRule(lenience, float(eps))
        self.verifier = verifier
        self.drafter = drafter
        self.gamma = gamma
        if draft_length not in ("fixed", "cost"):
            raise ValueError(f"draft_length must be 'fixed' or 'cost', got {draft_length!r}")
        self._verifier = TimedModel(verifier)
        #: The cost-aware draft length (``draft_length="cost"``), else None.
        self.length = CostAwareLength(costs) if draft_length == "cost" else None
        self.draft_length = draft_length
        if plain_steps == "auto" and draft_length == "cost":
            raise ValueError(
                "plain_steps='auto' is for draft_length='fixed': a length chosen by cost takes plain steps"
            )
        self._gate = plain_step_gate(plain_steps, costs)
        check_fallback_cut(fallback_cut, plain_steps, draft_length, confidence_threshold=confidence_threshold)
        self._proposer = ModelProposer(
            TimedModel(drafter), self._verifier.vocab_size, confidence_threshold, self.length
        )
        self.fallback_cut = fallback_cut
        if fallback_cut:
            self._proposer.fallback_length = CostAwareLength(costs)
        self.confidence_threshold = self._proposer.confidence_threshold
        gated = self._gate is not None
        self._lookup = prompt_lookup(lookup_tokens, lookup_max_ngram, lookup_min_ngram, self.length, gated)
        self.vocab_size = self._verifier.vocab_size
        self.steering = steering
        if steering is not None and hasattr(steering, "check_pair"):
            steering.check_pair(verifier, drafter)  # a module made for another pair fails here

    @property
    def lossless(self) -> bool:
        """False with a lenient (lossy) acceptance test at T > 0; T = 0 is greedy either way."""
        return self.rule.lossless

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier, self.drafter)

    @property
    def step_costs(self) -> StepCosts | None:
        """The pair's measured step costs this decoder chooses its draft lengths or its plain steps by
        (None: chosen by neither, or not measured yet)."""
        if self.length is not None:
            return self.length.costs
        return self._gate.costs if self._gate is not None else None

    def measure_costs(self) -> StepCosts:
        """The pair's step costs for checks of 1 .. the most tokens a block can verify, measured once per
        machine and setting (:func:`~train.decoding.cost_probe.step_costs`); a steered drafter's step is
        timed steered."""
        most = max(self.gamma, self._lookup.num_tokens if self._lookup is not None else 0) + 1
        costs = step_costs(self._verifier, self._proposer.drafter, most, self.steering)
        if self._proposer.fallback_length is not None:  # the gate's fallback cut by the same costs
            self._proposer.fallback_length.costs = costs
        return costs

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        if self.length is not None and self.length.costs is None:
            self.length.costs = self.measure_costs()
        # SD^2: hooks on the drafter for the duration of this call only (the drafter stays plain)
        attached = self.steering.attach(self.drafter) if self.steering is not None else nullcontext(None)
        with attached as handle:
            steered = SteeredProposer(self._proposer, self.steering, handle) if handle is not None else None
            fallback = self._proposer.propose_cut if self.fallback_cut else None  # steered too: its hook
            drafting = behind_gate(steered or self._proposer, self._gate, self.measure_costs, fallback)
            proposer, max_draft = lookup_first(drafting, self.gamma, self._lookup, self._gate)
            result = run_synchronous(
                self._verifier,
                proposer,
                prompt,
                max_new_tokens,
                max_draft,
                params,
                eos,
                generator,
                self.rule,
            )
        if steered is not None:
            result.stats.guide_time += steered.guide_time
        return result
