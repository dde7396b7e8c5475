"""Optimizer / scheduler partials, float32 master weights and gradient clipping (train/training/optim.py)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import get_cosine_schedule_with_warmup

import train.training.optim as optim
from tests.fsdp import RecordingRoot, fake_fsdp_trainer, gloo_rank
from train.config import ConfigError
from train.training.optim import (
    check_optimizer,
    clip_grad_norm,
    clip_gradients,
    configure_optimizers,
    float32_trainables,
    weights_dtype,
)


@pytest.mark.parametrize(
    ("optimizer", "scheduler", "message"),
    [
        ("adamw", None, "method.optimizer must be a Hydra partial"),
        (functools.partial(torch.optim.AdamW, lr=0.0), None, "method.optimizer.lr must be > 0"),
        (functools.partial(torch.optim.AdamW, weight_decay=-1.0), None, "method.optimizer.weight_decay"),
        (functools.partial(torch.optim.AdamW), "cosine", "method.scheduler must be a Hydra partial or null"),
    ],
)
def test_bad_partials_name_the_key(optimizer, scheduler, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_optimizer("method", optimizer, scheduler)


def test_optimizer_alone_or_with_a_per_step_scheduler():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = configure_optimizers(params, functools.partial(torch.optim.SGD, lr=0.1), None)
    assert isinstance(opt, torch.optim.SGD)
    sched = functools.partial(get_cosine_schedule_with_warmup, num_warmup_steps=1, num_training_steps=4)
    out = configure_optimizers(params, functools.partial(torch.optim.SGD, lr=0.1), sched)
    assert out["lr_scheduler"]["interval"] == "step" and out["optimizer"].param_groups[0]["params"] == params


def test_adam_and_sgd_run_fused_on_a_cpu_and_take_the_same_step_as_the_default():
    torch.manual_seed(0)
    make = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    models = [torch.nn.Linear(16, 8) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = configure_optimizers(models[0].parameters(), make, None)
    default = make(models[1].parameters())
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    x = torch.randn(4, 16)
    for model, opt in zip(models, (fused, default), strict=True):
        for _ in range(3):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert optim.fused_kwargs(functools.partial(torch.optim.SGD, lr=0.1), [torch.zeros(2)]) == {"fused": True}


@pytest.mark.parametrize(
    ("optimizer", "params"),
    [
        (functools.partial(torch.optim.AdamW, fused=False), [torch.zeros(2)]),  # the config's word stands
        (functools.partial(torch.optim.AdamW, foreach=True), [torch.zeros(2)]),
        (functools.partial(torch.optim.RMSprop), [torch.zeros(2)]),  # no fused kernel
        (torch.optim.AdamW, [torch.zeros(2)]),  # not a partial: nothing to read
        (functools.partial(torch.optim.AdamW), [torch.zeros(2), torch.zeros(2, device="meta")]),
        (functools.partial(torch.optim.AdamW), [torch.zeros(2, dtype=torch.long)]),
        (functools.partial(torch.optim.AdamW), []),
    ],
)
def test_the_default_kernel_where_fused_is_not_asked_for_or_not_there(optimizer, params):
    assert optim.fused_kwargs(optimizer, params) == {}


def test_param_groups_given_as_iterators_reach_the_optimizer_whole():
    model = torch.nn.Linear(4, 4)
    groups = [{"params": iter([model.weight]), "lr": 0.1}, {"params": (p for p in [model.bias])}]
    opt = configure_optimizers(groups, functools.partial(torch.optim.AdamW, lr=1e-3), None)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    assert opt.param_groups[0]["lr"] == 0.1 and opt.defaults["fused"] is True


class _Regressor(optim.WholeNormClipping, L.LightningModule):
    """One linear layer with large gradients (clipping bites), its optimizer the given partial."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 4)
        self.make = make

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return 100.0 * self.layer(batch).float().square().mean()

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.parameters(), self.make, None, self)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_fused_optimizer_is_clipped_under_bf16_mixed_as_the_default_one_is(algorithm):
    """Lightning's mixed-precision plugin refuses to clip for any fused optimizer; ours clips it with the
    same torch call, so fused and unfused runs end on the same weights."""
    weights = []
    for fused in (True, False):
        module = _Regressor(functools.partial(torch.optim.SGD, lr=0.1, **({} if fused else {"fused": False})))
        trainer = L.Trainer(
            accelerator="cpu",
            precision="bf16-mixed",
            max_steps=3,
            gradient_clip_val=0.5,
            gradient_clip_algorithm=algorithm,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.randn(6, 8), batch_size=2))
        assert trainer.optimizers[0].defaults["fused"] is fused
        weights.append(module.layer.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


def test_no_fused_kernel_when_the_loss_is_scaled():
    params = [torch.zeros(2)]
    assert optim.fused_kwargs(functools.partial(torch.optim.AdamW), params, scaled=True) == {}
    scaler = SimpleNamespace(_trainer=SimpleNamespace(precision_plugin=SimpleNamespace(scaler=object())))
    assert optim.scaled_gradients(scaler)  # type: ignore[arg-type]
    assert not optim.scaled_gradients(SimpleNamespace(_trainer=None))  # type: ignore[arg-type]


def test_a_fused_optimizer_over_scaled_gradients_is_left_to_lightnings_clipping():
    """A config that asks for ``fused`` under ``16-mixed``: clipping goes to Lightning (which refuses it
    with its reason) rather than clipping the scaled gradients directly."""
    calls: list[tuple[float, str]] = []
    module = SimpleNamespace(
        _trainer=SimpleNamespace(precision_plugin=SimpleNamespace(scaler=object())),
        clip_gradients=lambda opt, val, algorithm: calls.append((val, algorithm)),
    )
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 100.0)
    opt = torch.optim.AdamW([weight], fused=True)
    optim._clip_whole(module, opt, 1.0, "norm")  # type: ignore[arg-type]
    assert calls == [(1.0, "norm")] and torch.equal(weight.grad, torch.full((3,), 100.0))


def test_float32_trainables_upcasts_what_trains_and_keeps_tied_weights_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5), torch.nn.LayerNorm(5))
    model.to(torch.bfloat16)
    model[2].requires_grad_(False)  # frozen: keeps its dtype
    tied = torch.nn.Linear(4, 5, bias=False).to(torch.bfloat16)
    tied.weight = model[0].weight  # the same Parameter object in two places, as tied embeddings are
    model.append(tied)
    assert weights_dtype(model) == torch.bfloat16
    before = model[0].weight.detach().clone()
    assert float32_trainables(model) is model
    assert model[0].weight.dtype == model[1].weight.dtype == torch.float32
    assert model[3].weight is model[0].weight  # still tied
    assert model[2].weight.dtype == torch.bfloat16  # frozen
    assert torch.equal(model[0].weight.detach().to(torch.bfloat16), before)  # exact upcast
    assert weights_dtype(torch.nn.ReLU()) == torch.float32


def _grads(*shapes: tuple[int, ...], scale: float, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def test_clip_grad_norm_on_one_device_is_torchs():
    for scale in (10.0, 0.01):  # clipped, and left alone
        mine, ref = _grads((5, 3), (7,), scale=scale, seed=0), _grads((5, 3), (7,), scale=scale, seed=0)
        norm = clip_grad_norm(mine, 1.0)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref, 1.0))
        for a, b in zip(mine, ref, strict=True):
            torch.testing.assert_close(a.grad, b.grad)


class _Arms(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)


def test_under_fsdp_the_global_norm_goes_through_the_root_and_groups_sum_over_the_shards(monkeypatch):
    """FSDPPrecision refuses clipping by norm (Lightning's default hook raises): the global norm goes
    through the FSDP root's clip_grad_norm_, a group's norm is all-reduced over FSDP's process group."""
    module, root = _Arms(), RecordingRoot()
    module.trainer = fake_fsdp_trainer(root)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    clip_gradients(module, opt, 0.5, "norm")
    clip_gradients(module, opt, 0.5, None)
    assert root.clipped == [0.5, 0.5]
    reduced = []
    monkeypatch.setattr(optim.dist, "all_reduce", lambda t, group=None: reduced.append((float(t), group)))
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    clip_gradients(module, opt, 0.5, "norm", [list(module.a.parameters()), list(module.b.parameters())])
    assert reduced == [(12.0, root.process_group), (12.0, root.process_group)]  # one collective per arm
    assert root.clipped == [0.5, 0.5]
    norm = float(torch.cat([p.grad.flatten() for p in module.a.parameters()]).norm())
    assert norm == pytest.approx(0.5, rel=1e-5)  # clipped by the reduced norm, sqrt(12)
    clip_gradients(module, opt, 0.0, "norm")  # 0 or None: off
    assert root.clipped == [0.5, 0.5] and len(reduced) == 2


def _shard_worker(rank: int, out: str) -> None:
    """Rank ``rank`` of 2 holds its half of each arm's flattened gradients (as FSDP's flat parameters:
    a contiguous half, so a parameter may lie wholly on one rank) and clips each arm by its own norm."""
    with gloo_rank(rank, 2, out):
        shards, norms = [], []
        for arm, scale in enumerate((10.0, 0.01)):
            full = torch.cat([p.grad.flatten() for p in _grads((5, 3), (7,), (2,), scale=scale, seed=arm)])
            half = full.numel() // 2 + 1
            piece = full[rank * half : (rank + 1) * half].clone()
            # this rank's views: every parameter's part of the piece; a part may be empty (grad None)
            params = [torch.nn.Parameter(torch.zeros(n)) for n in (piece.numel() - 3, 3, 0)]
            offset = 0
            for p in params:
                p.grad = piece[offset : offset + p.numel()].clone() if p.numel() else None
                offset += p.numel()
            norms.append(clip_grad_norm(params, 1.0, dist.group.WORLD))
            shards.append(torch.cat([p.grad for p in params if p.grad is not None]))
        torch.save({"norms": norms, "shards": shards}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow  # two processes, ~15 s on 2 cores
def test_per_arm_norm_from_two_gloo_shards_is_the_full_norm(tmp_path):
    """Two gloo processes each hold half of every arm's gradients: the norm each arm is clipped by is
    the norm of the whole gradient, and the clipped halves put together are single-process clipping."""
    mp.spawn(_shard_worker, args=(str(tmp_path),), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for arm, scale in enumerate((10.0, 0.01)):
        full = _grads((5, 3), (7,), (2,), scale=scale, seed=arm)
        want = torch.nn.utils.clip_grad_norm_(full, 1.0)
        for r in ranks:
            torch.testing.assert_close(r["norms"][arm], want)
        clipped = torch.cat([r["shards"][arm] for r in ranks])
        torch.testing.assert_close(clipped, torch.cat([p.grad.flatten() for p in full]))
    assert float(ranks[0]["norms"][0]) > 1.0 > float(ranks[0]["norms"][1])  # one arm clipped, one not
