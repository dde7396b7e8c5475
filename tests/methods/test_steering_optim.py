"""SD^2's loss settings, learning rates and per-arm gradient clipping (train/methods/steering/module.py), on
micro models: each configured weight changes what trains, and the clipping stays per arm under FSDP."""

from __future__ import annotations

import functools

import pytest
import torch
from datasets import Dataset

import train.training.optim as optim
from tests.conftest import make_tokenizer, tiny_llama
from tests.fsdp import RecordingRoot, fake_fsdp_trainer
from train.data.datamodule import PromptDataModule
from train.losses import divergence
from train.methods.steering.build import steering_for
from train.methods.steering.config import DISTILLED_ARM, MAIN_ARM, SteeringConfig
from train.methods.steering.module import SteeringTrainingModule

pytestmark = pytest.mark.usefixtures("one_thread")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def _module(**kw) -> tuple[SteeringTrainingModule, dict[str, torch.Tensor]]:
    """A steered arm and the distilled baseline on micro models, with one training batch."""
    settings = dict(
        optimizer=ADAMW, max_new_tokens=6, prompt_len=8, batch_size=4, num_prompts=8, num_val_prompts=4
    )
    cfg = SteeringConfig(**(settings | kw))
    tok = make_tokenizer()
    verifier, drafter = tiny_llama(hidden=64, seed=0), tiny_llama(hidden=32, seed=1)
    arms: dict = {
        DISTILLED_ARM: (tiny_llama(hidden=32, seed=1), None),
        MAIN_ARM: (drafter, steering_for(cfg, verifier, drafter)),
    }
    docs = [f"def add(a, b):\n    return a + b  # doc {i} " + "x" * (i % 5) for i in range(12)]
    data = PromptDataModule(
        {"train": Dataset.from_dict({"text": docs[:8]}), "validation": Dataset.from_dict({"text": docs[8:]})},
        tok,
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
    )
    data.setup("fit")
    return SteeringTrainingModule(verifier, arms, tok, cfg, seed=0), next(iter(data.train_dataloader()))


def test_the_loss_uses_the_configured_jsd_beta():
    module, batch = _module(divergence="jsd", beta=0.1)
    with torch.no_grad():
        total = module.training_step(batch, 0)
        ro = module.answers(batch["input_ids"], batch["attention_mask"], module._generator(0, 0))
        mask = ro.continuation_mask[:, ro.prompt_width :]
        verifier_logits, states = module.verifier_view(ro)
        logits = {a: module.arm_logits(a, ro, states, module.offset_for(0)) for a in module.drafters}
        want, other = (
            sum(divergence("jsd", x, verifier_logits, mask, beta=beta) for x in logits.values())
            for beta in (0.1, 0.5)
        )
    torch.testing.assert_close(total, want)
    assert abs(float(want) - float(other)) > 1e-4  # beta matters for these logits


def test_steering_modules_learn_at_steering_lr_multiplier_times_the_rate():
    module, _ = _module(steering_lr_multiplier=3.0)
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    drafters, steering = opt.param_groups
    assert drafters["lr"] == pytest.approx(1e-2) and steering["lr"] == pytest.approx(3e-2)
    assert {id(p) for p in steering["params"]} == {id(p) for p in module.steering.parameters()}


def test_each_arm_is_clipped_by_its_norm_summed_over_the_fsdp_shards(monkeypatch):
    """Under FSDP each rank holds a shard of every gradient: an arm's norm is the square root of its
    squared shard norms all-reduced over FSDP's process group (one collective per arm), never a shard's
    own norm; the arms stay apart."""
    module, _ = _module()
    root = RecordingRoot()
    module.trainer = fake_fsdp_trainer(root, clip=0.5)
    reduced: list[tuple[float, object]] = []
    monkeypatch.setattr(optim.dist, "all_reduce", lambda t, group=None: reduced.append((float(t), group)))
    arms = {
        DISTILLED_ARM: list(module.drafters[DISTILLED_ARM].parameters()),
        MAIN_ARM: [*module.drafters[MAIN_ARM].parameters(), *module.steering[MAIN_ARM].parameters()],
    }
    for params, scale in zip(arms.values(), (1.0, 2.0), strict=True):
        for p in params:
            p.grad = torch.full_like(p, scale)
    module.configure_gradient_clipping(module.configure_optimizers(), 0.5, "norm")
    assert root.clipped == []  # per arm, not one global norm
    sizes = [sum(p.numel() for p in params) for params in arms.values()]
    assert reduced == [
        (pytest.approx(1.0 * sizes[0]), root.process_group),
        (pytest.approx(4.0 * sizes[1]), root.process_group),
    ]
    for params in arms.values():
        assert float(torch.cat([p.grad.flatten() for p in params]).norm()) == pytest.approx(0.5, rel=1e-4)
