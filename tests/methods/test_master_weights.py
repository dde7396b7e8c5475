"""bf16 runs train float32 master weights: every method, on a micro pair loaded in bfloat16 and trained
under ``bf16-mixed`` (as ``model=qwen3|llama3 trainer=gpu|fsdp`` do), keeps what trains and its AdamW
state in float32, so a 1e-5 learning rate moves the weights (bfloat16 weights of ~0.02 would round such
steps away); the frozen verifier stays in bfloat16, and the exports are written back in it."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from datasets import Dataset

from tests.conftest import make_tokenizer, tiny_llama
from train.data.datamodule import LMDataModule, PromptDataModule
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.module import MedusaModule
from train.methods.steering.build import steering_for
from train.methods.steering.config import DISTILLED_ARM, MAIN_ARM, SteeringConfig
from train.methods.steering.module import SteeringTrainingModule
from train.models.heads import MedusaHeads

pytestmark = pytest.mark.usefixtures("one_thread")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-5)
BF16 = torch.bfloat16
PROMPTS = dict(max_new_tokens=6, prompt_len=8, batch_size=4, num_prompts=8, num_val_prompts=4)
DOCS = [f"def f{i}(x):\n    return x * {i}  # doc {i}\n" * 4 for i in range(40)]
SPLITS = {
    "train": Dataset.from_dict({"text": DOCS[:32]}),
    "validation": Dataset.from_dict({"text": DOCS[32:]}),
}


def _bf16(hidden: int, seed: int) -> torch.nn.Module:
    return tiny_llama(hidden=hidden, seed=seed).to(BF16)


def _prompts(cfg) -> PromptDataModule:
    return PromptDataModule(
        SPLITS,
        make_tokenizer(),
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
    )


def _fit(module: L.LightningModule, data: L.LightningDataModule, tmp_path, steps: int = 3) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return trainer


def _snapshot(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters() if p.requires_grad]


def _check_trained(trainer: L.Trainer, modules: list[torch.nn.Module], before: list[torch.Tensor]) -> None:
    """Every trainable parameter and its AdamW state are float32, and nearly every weight moved at lr 1e-5."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    state = trainer.optimizers[0].state
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.float32 for p in params)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before, strict=True))
    assert changed / sum(p.numel() for p in params) > 0.9  # bfloat16 weights: 11-60% on these runs


def _floating_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if p.is_floating_point()}


def test_distillspec(tmp_path):
    cfg = DistillSpecConfig(optimizer=ADAMW, data_source="fixed", **PROMPTS)
    verifier = _bf16(64, 0)
    module = DistillSpecModule(_bf16(32, 1), verifier, make_tokenizer(), cfg)
    before = _snapshot([module.drafter])
    trainer = _fit(module, _prompts(cfg), tmp_path)
    _check_trained(trainer, [module.drafter], before)
    assert _floating_dtypes(verifier) == {BF16}
    assert _floating_dtypes(module.distilled_drafter()) == {BF16}  # exported in model.dtype, a copy
    assert _floating_dtypes(module.drafter) == {torch.float32}


def _medusa(joint: bool) -> tuple[MedusaModule, torch.nn.Module]:
    verifier = _bf16(32, 0)
    lora = {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]} if joint else None
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, joint=joint, lora=lora)
    return MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg), verifier


def _medusa_data() -> LMDataModule:
    return LMDataModule(SPLITS, make_tokenizer(), seq_len=24, batch_size=4, seed=0, drop_last=True)


def test_medusa1(tmp_path):
    module, verifier = _medusa(joint=False)
    before = _snapshot([module.heads])
    trainer = _fit(module, _medusa_data(), tmp_path)
    _check_trained(trainer, [module.heads], before)
    assert _floating_dtypes(verifier) == {BF16}
    assert _floating_dtypes(module.trained_heads()) == {BF16}  # exported beside the bf16 verifier


def test_medusa2_heads_and_lora(tmp_path):
    module, verifier = _medusa(joint=True)
    before = _snapshot([module.heads, module.verifier])
    trainer = _fit(module, _medusa_data(), tmp_path)
    _check_trained(trainer, [module.heads, module.verifier], before)
    frozen = [p for p in module.verifier.parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {BF16}  # the base weights keep model.dtype
    assert _floating_dtypes(module.evaluation_verifier(verifier)) == {BF16}  # merged, in model.dtype


def test_sd2_steering_and_drafter_arms(tmp_path):
    cfg = SteeringConfig(optimizer=ADAMW, gamma=2, **PROMPTS)
    verifier, drafter = _bf16(64, 0), _bf16(32, 1)
    arms = {DISTILLED_ARM: (_bf16(32, 1), None), MAIN_ARM: (drafter, steering_for(cfg, verifier, drafter))}
    module = SteeringTrainingModule(verifier, arms, make_tokenizer(), cfg)
    before = _snapshot([module.drafters, module.steering])
    trainer = _fit(module, _prompts(cfg), tmp_path)
    _check_trained(trainer, [module.drafters, module.steering], before)
    assert _floating_dtypes(verifier) == {BF16}
    for label in (DISTILLED_ARM, MAIN_ARM):
        assert _floating_dtypes(module.plain_drafter(label)) == {BF16}
