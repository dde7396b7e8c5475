"""The evaluator's decoding engine: sampling math, decoders and the metric contract."""

from .autoregressive import AutoregressiveDecoder
from .metrics import (
    DecodeResult,
    DecodeStats,
    acceptance_rate,
    accepted_per_block,
    aggregate,
    block_efficiency,
    cost_ratio,
    expected_acceptance,
    loop_overhead,
    mbsu,
    param_count,
    per_position_acceptance,
    simulated_block_efficiency,
    speedup,
    summarize,
    tokens_per_second,
)
from .sampling import SamplingParams, residual, sample, warp
from .speculative import SpeculativeDecoder

__all__ = [
    "AutoregressiveDecoder",
    "DecodeResult",
    "DecodeStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "accepted_per_block",
    "acceptance_rate",
    "aggregate",
    "block_efficiency",
    "cost_ratio",
    "expected_acceptance",
    "loop_overhead",
    "mbsu",
    "param_count",
    "per_position_acceptance",
    "residual",
    "sample",
    "simulated_block_efficiency",
    "speedup",
    "summarize",
    "tokens_per_second",
    "warp",
]
