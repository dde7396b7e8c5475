"""The evaluator's decoding engine (docs/decoding.md, "How the engine is built"; docs/architecture.md).

By role: ``decoders/`` (one file per decoder; ``base.Decoder.generate`` is the one ``generate`` they
share), ``proposers/`` (the drafting side; ``protocol.Proposer`` names all the loop uses), ``rules/``
(verification as pure functions: chain, recursive, tree walk, typical), the schedules ``loop``
(synchronous) and ``async_loop`` (AMUSD), and the building blocks ``model_call`` (one timed forward),
``cache``, ``tree_attention``, ``draft``, ``sampling``, ``metrics`` (the metric contract) and
``refine`` (BPD). The names below are the engine's public face.
"""

import warnings
from typing import Any

from train.decoding.cache import cache_length, crop_cache, keep_positions
from train.decoding.decoders.async_decoder import AsyncSpeculativeDecoder
from train.decoding.decoders.autoregressive import AutoregressiveDecoder
from train.decoding.decoders.dflash_decoder import DFlashDecoder
from train.decoding.decoders.eagle3_decoder import Eagle3Decoder
from train.decoding.decoders.heads_decoder import HeadsDecoder
from train.decoding.decoders.speculative import SpeculativeDecoder
from train.decoding.decoders.tree_decoder import TreeSpeculativeDecoder
from train.decoding.draft import Draft
from train.decoding.metrics import (
    DecodeResult,
    DecodeStats,
    acceptance_rate,
    accepted_per_block,
    aggregate,
    block_efficiency,
    cost_ratio,
    drafter_calls_per_verifier_call,
    expected_acceptance,
    loop_overhead,
    mbsu,
    param_count,
    per_position_acceptance,
    simulated_block_efficiency,
    speedup,
    summarize,
    tokens_per_second,
    verifier_tokens_per_call,
)
from train.decoding.model_call import CallResult, TimedModel
from train.decoding.proposers.heads_proposer import HeadsProposer, chain_choices
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.proposers.protocol import Proposer
from train.decoding.rules.chain import accepted_length, chain_rejection, greedy_chain
from train.decoding.rules.recursive import recursive_rejection
from train.decoding.sampling import SamplingParams, residual, sample, warp
from train.models.introspect import input_vocab_size, model_device, output_vocab_size

__all__ = [
    "AsyncSpeculativeDecoder",
    "AutoregressiveDecoder",
    "DFlashDecoder",
    "CallResult",
    "DecodeResult",
    "DecodeStats",
    "HeadsProposer",
    "HeadsDecoder",
    "Eagle3Decoder",
    "Draft",
    "ModelProposer",
    "Proposer",
    "SamplingParams",
    "SpeculativeDecoder",
    "TimedModel",
    "TreeSpeculativeDecoder",
    "accepted_length",
    "accepted_per_block",
    "acceptance_rate",
    "aggregate",
    "block_efficiency",
    "cache_length",
    "chain_choices",
    "chain_rejection",
    "cost_ratio",
    "crop_cache",
    "drafter_calls_per_verifier_call",
    "expected_acceptance",
    "greedy_chain",
    "input_vocab_size",
    "keep_positions",
    "loop_overhead",
    "mbsu",
    "model_device",
    "output_vocab_size",
    "param_count",
    "per_position_acceptance",
    "recursive_rejection",
    "residual",
    "sample",
    "simulated_block_efficiency",
    "speedup",
    "summarize",
    "tokens_per_second",
    "verifier_tokens_per_call",
    "warp",
]


def __getattr__(name: str) -> Any:
    """Old names that keep working, with a deprecation line: ``MedusaDecoder`` is :class:`HeadsDecoder`
    (it runs Medusa, blockwise decoding and BPD alike)."""
    if name == "MedusaDecoder":
        warnings.warn(
            "train.decoding.MedusaDecoder is deprecated; it is now HeadsDecoder",
            DeprecationWarning,
            stacklevel=2,
        )
        return HeadsDecoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
