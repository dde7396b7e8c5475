"""What every decoder shares: :class:`Decoder` (the one ``generate``), request validation, EOS sets.

A decoder is a composition of the engine's parts (a proposer, the verification rules, a schedule); it
only says which models a request must fit (:meth:`Decoder.models`) and how to decode a validated
prompt (:meth:`Decoder.decode`). ``generate`` checks the request, turns the EOS ids into a set and
runs under ``torch.inference_mode``, the same way for every decoder.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from train.decoding.costs import StepCosts
from train.decoding.draft_gate import DraftGate
from train.decoding.loop import run_synchronous
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.proposers.gated_proposer import Propose, behind_gate
from train.decoding.proposers.lookup_proposer import PromptLookupProposer, lookup_first
from train.decoding.proposers.protocol import Proposer
from train.decoding.rules.rejection import LOSSLESS
from train.decoding.rules.verdict import VerificationRule
from train.decoding.sampling import SamplingParams


def max_positions(model: torch.nn.Module) -> int | None:
    """The model's maximum sequence length from its config (None when it does not declare one)."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    if isinstance(eos_token_id, torch.Tensor):
        return frozenset(int(x) for x in eos_token_id.reshape(-1).tolist())
    return frozenset(int(x) for x in eos_token_id)


def validate_request(
    input_ids: torch.Tensor,
    max_new_tokens: int,
    params: Any,
    models: Iterable[torch.nn.Module],
) -> list[int]:
    """Check a ``generate`` request; return the prompt as a list of ints.

    input_ids: (1, T) or (T,) integer tensor with T >= 1.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of shape (1, T), got {type(input_ids).__name__}")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"input_ids must have batch size 1, shape (1, T); got shape {tuple(input_ids.shape)}"
            )
        input_ids = input_ids[0]
    elif input_ids.dim() != 1:
        raise ValueError(f"input_ids must have shape (1, T); got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("empty prompt: input_ids must contain at least one token (shape (1, T) with T >= 1)")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    prompt = [int(x) for x in input_ids.tolist()]
    total = len(prompt) + max_new_tokens
    for model in models:
        limit = max_positions(model)
        if limit is not None and total > limit:
            raise ValueError(
                f"prompt length {len(prompt)} + max_new_tokens {max_new_tokens} = {total} exceeds "
                f"{type(model).__name__}'s max_position_embeddings = {limit}"
            )
    return prompt


_DEFAULT_PARAMS = SamplingParams()


class Decoder:
    """The shared ``generate`` of every decoder; subclasses implement :meth:`models` and :meth:`decode`."""

    #: The kinds of drafter this decoder takes (what a drafter *is* is its own ``drafter_kind``:
    #: ``model``, ``heads`` or ``steered``); the evaluator pairs drafters and decoders by it.
    accepts: ClassVar[tuple[str, ...]] = ("model",)
    #: The plain-step gate of a decoder built with ``plain_steps="auto"`` (:mod:`train.decoding.draft_gate`).
    _gate: DraftGate | None = None

    @property
    def plain_steps(self) -> str:
        """``auto`` when a gate may take plain verifier steps instead of drafted blocks, else ``never``."""
        return "auto" if self._gate is not None else "never"

    def models(self) -> tuple[torch.nn.Module, ...]:
        """The models a request must fit (their maximum positions are checked)."""
        raise NotImplementedError

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        """Decode a validated request (``prompt`` as a list of ids)."""
        raise NotImplementedError

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams = _DEFAULT_PARAMS,
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1, T).

        Returns the new tokens only (1-D, on CPU), stopping after the first EOS (any id of
        ``eos_token_id``; included). ``max_new_tokens == 0`` returns an empty tensor and zero counts
        without running a model. Random numbers come from ``generator`` only (drawn on its own device),
        so a seed reproduces the output whatever devices the models sit on.
        """
        prompt = validate_request(input_ids, max_new_tokens, params, self.models())
        return self.decode(prompt, max_new_tokens, params, eos_set(eos_token_id), generator)


class DraftTreeDecoder(Decoder):
    """A decoder whose proposer drafts up to ``depth`` tokens a block (a tree, or a chain as a one-child
    tree) under the synchronous schedule, verified by ``_rule`` (lossless rejection sampling unless a
    subclass sets Medusa's lossy rule). Subclasses set ``_verifier``, ``_proposer`` and ``depth``, and
    ``_lookup`` for prompt lookup first (:func:`~train.decoding.proposers.lookup_proposer.prompt_lookup`;
    the proposer drafts where the context offers nothing to copy). ``_gate`` (a subclass's
    ``plain_steps="auto"``): the proposer drafts only in blocks where its drafts have paid for their cost
    so far, a plain verifier step elsewhere (:mod:`train.decoding.draft_gate`; the costs measured at the
    first call by :meth:`measure_costs`), or ``_fallback``'s draft where a subclass gives one."""

    _verifier: TimedModel
    _proposer: Proposer
    depth: int
    _rule: VerificationRule = LOSSLESS
    _lookup: PromptLookupProposer | None = None
    #: What the proposer drafts where the gate refuses its shape (None: a plain step).
    _fallback: Propose | None = None

    @property
    def draft_budget(self) -> int:
        """The most tokens the proposer (or its fallback) drafts a block: ``depth`` unless a subclass's
        fallback drafts longer."""
        return self.depth

    def measure_costs(self) -> StepCosts:
        """The pair's step costs the gate weighs drafted blocks by (a subclass with a gate says how)."""
        raise NotImplementedError(f"{type(self).__name__} has no plain-step gate")

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        drafting = behind_gate(self._proposer, self._gate, self.measure_costs, self._fallback)
        proposer, max_draft = lookup_first(drafting, self.draft_budget, self._lookup, self._gate)
        return run_synchronous(
            self._verifier,
            proposer,
            prompt,
            max_new_tokens,
            max_draft,
            params,
            eos,
            generator,
            self._rule,
        )


def check_feature_drafter(verifier: torch.nn.Module, drafter: Any, vocab_size: int, name: str) -> None:
    """Refuse a drafter on the verifier's hidden states (EAGLE-3, DFlash) made for another verifier: its
    hidden size and vocabulary must be the verifier's, and the layers it reads must exist
    (``hidden_states`` indices below the verifier's layer count). ``name`` names the drafter kind."""
    config = getattr(verifier, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden is not None and int(hidden) != drafter.hidden_size:
        raise ValueError(
            f"the {name} drafter reads hidden states of size {drafter.hidden_size}, but the verifier's are "
            f"{hidden}: it was made for another verifier"
        )
    if drafter.vocab_size != vocab_size:
        raise ValueError(
            f"the {name} drafter's vocabulary has {drafter.vocab_size} tokens, but the verifier's has "
            f"{vocab_size}: it was made for another verifier"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and not all(0 <= i < int(layers) for i in drafter.aux_layers):
        raise ValueError(
            f"the {name} drafter reads layers {drafter.aux_layers}, but the verifier has {layers}: "
            "it was made for another verifier"
        )
