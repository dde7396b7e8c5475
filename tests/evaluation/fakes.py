"""Stand-in decoders for the evaluation tests, built through ``_target_`` like real decoder configs."""

from __future__ import annotations

from typing import Any

import torch

from train.decoding import AutoregressiveDecoder, DecodeResult

#: (decoder name, prompt length, eos_token_id) of every generate call, in call order.
CALLS: list[tuple[str, int, Any]] = []


class RecordingDecoder:
    """The verifier's own output (so greedy checks pass), recording each call in :data:`CALLS`."""

    def __init__(self, verifier: torch.nn.Module, drafter: torch.nn.Module, tag: str = "rec") -> None:
        self.tag = tag
        self.inner = AutoregressiveDecoder(verifier)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: Any = None,
        eos_token_id: Any = None,
        generator: Any = None,
    ) -> DecodeResult:
        CALLS.append((self.tag, int(input_ids.shape[-1]), eos_token_id))
        return self.inner.generate(input_ids, max_new_tokens, params, eos_token_id, generator)


class HoldingDecoder(RecordingDecoder):
    """A :class:`RecordingDecoder` keeping what its config loaded (``steering=``, ``refiner=``) in
    ``loaded``, as real decoders keep a steering module or a refiner's rescoring LM."""

    def __init__(self, verifier: torch.nn.Module, drafter: torch.nn.Module, **loaded: Any) -> None:
        super().__init__(verifier, drafter, "hold")
        self.loaded = loaded


class SwapDecoder:
    """Greedy decoding of the verifier, except that new token ``position`` becomes ``token`` (and the
    output ends there): a decoder that breaks exactness at one known place."""

    def __init__(
        self, verifier: torch.nn.Module, drafter: torch.nn.Module, position: int = 0, token: int = 0
    ) -> None:
        self.position, self.token = position, token
        self.inner = AutoregressiveDecoder(verifier)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: Any = None,
        eos_token_id: Any = None,
        generator: Any = None,
    ) -> DecodeResult:
        result = self.inner.generate(input_ids, max_new_tokens, params, eos_token_id, generator)
        tokens = result.tokens.clone()
        if params is not None and params.temperature == 0 and len(tokens) > self.position:
            tokens = torch.cat([tokens[: self.position], torch.tensor([self.token])])
        return DecodeResult(tokens=tokens, stats=result.stats)


def inline(target: type, name: str, **settings: Any) -> dict[str, Any]:
    """An inline decoder config for ``eval.decoders``."""
    return {"_target_": f"{__name__}.{target.__name__}", "name": name, **settings}
