"""RoPE frequencies stay exact float32 through every dtype move (issue 43, item 3): the EAGLE-3 drafter
at once, a loaded causal LM before its next forward, and FSDP's buffers under ``trainer=fsdp``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision
from lightning.pytorch.strategies import FSDPStrategy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.conftest import CONF_DIR
from train.config import instantiate_group
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.loading import load_model
from train.models.rotary import exact_inv_freq, keep_rotary_float32

pytestmark = pytest.mark.usefixtures("one_thread")

MOVES: dict[str, Callable[[torch.nn.Module], object]] = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "bf16-true plugin": lambda m: HalfPrecision("bf16-true").convert_module(m),
}


def _llama(rope: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=97,
        max_position_embeddings=8192,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 500000.0},
    )
    return LlamaForCausalLM(config).eval()


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _float32_reference(config: LlamaConfig) -> torch.Tensor:
    """The frequencies as a fresh float32 rotary module computes them (what vLLM serves with)."""
    return LlamaRotaryEmbedding(config).inv_freq


def _assert_exact(model: torch.nn.Module, reference: torch.Tensor) -> None:
    rotary = [m for m in model.modules() if isinstance(m, LlamaRotaryEmbedding)]
    assert rotary
    for module in rotary:
        for name in ("inv_freq", "original_inv_freq"):
            buffer = getattr(module, name)
            assert buffer.dtype == torch.float32, (name, buffer.dtype)
            assert torch.equal(buffer, reference), (name, (buffer - reference).abs().max())


@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_eagle3_drafter_rope_stays_exact_float32_after_a_dtype_move(move: str, rope: dict | None) -> None:
    verifier = _llama(rope)
    drafter = Eagle3Drafter.from_verifier(verifier.to(torch.bfloat16))  # moved to the embedding's dtype
    reference = _float32_reference(drafter.layer_config)
    _assert_exact(drafter, reference)
    MOVES[move](drafter)
    assert drafter.fc.weight.dtype != torch.float32  # the weights did move
    _assert_exact(drafter, reference)
    drafter.float()
    _assert_exact(drafter, reference)


@pytest.mark.parametrize("move", list(MOVES))
def test_a_loaded_causal_lm_uses_exact_float32_rope_after_a_dtype_move(move: str, tmp_path: Path) -> None:
    """DistillSpec's and SD^2's drafters come from ``load_model``: whatever moves them (a precision
    plugin, ``.half()``), the frequencies are exact again before the rotary module's next forward."""
    _llama(LLAMA3_ROPE).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype="bfloat16")
    reference = _float32_reference(model.config)
    _assert_exact(model, reference)
    MOVES[move](model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    _assert_exact(model, reference)


def test_keep_rotary_float32_leaves_a_module_it_cannot_recompute_in_float32() -> None:
    module = torch.nn.Module()
    module.register_buffer("inv_freq", torch.tensor([1.0, 0.5], dtype=torch.bfloat16), persistent=False)
    assert exact_inv_freq(module) is None
    keep_rotary_float32(module)
    assert module.inv_freq.dtype == torch.float32 and module.inv_freq.tolist() == [1.0, 0.5]


def _fsdp_strategy() -> FSDPStrategy:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=["trainer=fsdp"])
    strategy = instantiate_group(cfg, "trainer").strategy
    assert isinstance(strategy, FSDPStrategy), strategy
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")  # what trainer=fsdp's precision makes
    return strategy


def test_fsdp_trainer_keeps_buffers_and_reductions_in_float32() -> None:
    policy = _fsdp_strategy().mixed_precision_config
    assert policy is not None
    assert policy.param_dtype == torch.bfloat16
    assert policy.buffer_dtype == torch.float32 and policy.reduce_dtype == torch.float32


def _fsdp_forward(rank: int, folder: str, results: dict) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from tests.fsdp import gloo_rank

    with gloo_rank(rank, 1, folder):
        model = _llama()
        wrapped = FullyShardedDataParallel(
            model, mixed_precision=_fsdp_strategy().mixed_precision_config, device_id=torch.device("cpu")
        )
        with torch.no_grad():
            wrapped(torch.tensor([[1, 2, 3]]))
        results["inv_freq"] = model.model.rotary_emb.inv_freq.clone()


@pytest.mark.slow
def test_fsdp_under_trainer_fsdp_keeps_rope_float32_through_a_forward(tmp_path: Path) -> None:
    """FSDP itself, one gloo process on the CPU, wrapped with ``trainer=fsdp``'s policy."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.start_processes(_fsdp_forward, args=(str(tmp_path), results), nprocs=1, start_method="spawn")
    assert torch.equal(results["inv_freq"], _float32_reference(_llama().config))
