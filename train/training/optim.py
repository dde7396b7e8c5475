"""Optimizers, schedulers, trainable dtypes and gradient clipping, shared by every method.

A method config holds ``optimizer`` / ``scheduler`` as Hydra ``_partial_: true`` nodes (a
``functools.partial`` once instantiated); :func:`check_optimizer` validates them at start-up and
:func:`configure_optimizers` turns them into what Lightning's ``configure_optimizers`` returns.
:func:`float32_trainables` gives every trainable parameter (and so its optimizer state) float32
master weights; :func:`clip_gradients` is the body of every method's ``configure_gradient_clipping``
(:class:`WholeNormClipping` for the methods that clip by one norm over everything that trains),
correct on one device, under DDP and under FSDP (docs/scale.md).
This module sits at the bottom of the layering: it imports only :mod:`train.config` of ours.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import ShardingStrategy

from train.config import require

__all__ = [
    "WholeNormClipping",
    "check_optimizer",
    "clip_grad_norm",
    "clip_gradients",
    "configure_optimizers",
    "float32_trainables",
    "fused_kwargs",
    "grad_norm",
    "partial_kwarg",
    "scaled_gradients",
    "weights_dtype",
]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def partial_kwarg(partial: Any, name: str) -> Any:
    """Read a keyword argument of a Hydra ``_partial_`` (a ``functools.partial``)."""
    return partial.keywords.get(name) if isinstance(partial, functools.partial) else None


def check_optimizer(prefix: str, optimizer: Any, scheduler: Any) -> None:
    """Validate the optimizer/scheduler partials of a method config; errors name ``<prefix>.optimizer...``."""
    require(callable(optimizer), f"{prefix}.optimizer", "a Hydra partial (_partial_: true)", optimizer)
    require(
        scheduler is None or callable(scheduler), f"{prefix}.scheduler", "a Hydra partial or null", scheduler
    )
    lr = partial_kwarg(optimizer, "lr")
    require(lr is None or (isinstance(lr, int | float) and lr > 0), f"{prefix}.optimizer.lr", "> 0", lr)
    wd = partial_kwarg(optimizer, "weight_decay")
    require(wd is None or wd >= 0, f"{prefix}.optimizer.weight_decay", ">= 0", wd)


# Optimizers with a fused kernel (one pass over every parameter, where the default loops over them) and
# the devices where torch has it for float32/bfloat16 weights.
_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_FUSED_DEVICES = ("cpu", "cuda")


def fused_kwargs(optimizer: Any, params: Sequence[torch.Tensor], scaled: bool = False) -> dict[str, bool]:
    """``{"fused": True}`` where ``optimizer`` (a partial) builds an Adam/AdamW/SGD that sets neither
    ``fused`` nor ``foreach``, every parameter is a floating-point tensor on one CPU or CUDA device type
    and the gradients are not ``scaled`` (``16-mixed``'s loss scaling: a fused step unscales inside the
    step, after clipping would have read the scaled gradients); else ``{}`` (torch's default). On a CPU
    the default updates one parameter at a time, which for a drafter with a full-vocabulary embedding is
    a large part of a step (docs/real_pair.md)."""
    if (
        scaled
        or not isinstance(optimizer, functools.partial)
        or not (isinstance(optimizer.func, type) and issubclass(optimizer.func, _FUSED_OPTIMIZERS))
    ):
        return {}
    if "fused" in optimizer.keywords or "foreach" in optimizer.keywords or not params:
        return {}
    kinds = {p.device.type for p in params}
    if len(kinds) != 1 or kinds.pop() not in _FUSED_DEVICES or not all(p.is_floating_point() for p in params):
        return {}
    return {"fused": True}


def _tensors(params: Iterable[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """(what the optimizer is given, every tensor in it): ``params`` as tensors or param-group dicts."""
    given = [{**g, "params": list(g["params"])} if isinstance(g, dict) else g for g in params]
    tensors = [t for g in given for t in (g["params"] if isinstance(g, dict) else [g])]
    return given, tensors


def scaled_gradients(module: L.LightningModule) -> bool:
    """Whether ``module``'s trainer scales the loss (``16-mixed``'s gradient scaler); False unattached."""
    trainer = module._trainer
    return trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None


def configure_optimizers(
    params: Any, optimizer: Any, scheduler: Any, module: L.LightningModule | None = None
) -> Any:
    """Lightning's optimizer (or optimizer + scheduler dict) from Hydra partials; fused where torch has a
    fused kernel for it (:func:`fused_kwargs`).

    params: the parameters to train (tensors or param-group dicts). The scheduler, if any, steps every
    optimizer step. module: the LightningModule asking, whose trainer says whether gradients are scaled.
    """
    given, tensors = _tensors(params)
    scaled = module is not None and scaled_gradients(module)
    opt = optimizer(given, **fused_kwargs(optimizer, tensors, scaled))
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}


def weights_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (float32 when it has none): the dtype it
    was loaded in, read before :func:`float32_trainables`, is the one its export is written back in."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def float32_trainables(module: ModuleT) -> ModuleT:
    """Upcast every trainable (``requires_grad``) floating-point parameter of ``module`` to float32, in
    place; frozen ones keep their dtype. Returns ``module``.

    Models load in ``model.dtype`` (bfloat16 for the real pairs) and ``bf16-mixed`` autocasts the
    computation but not the weights: AdamW on bfloat16 weights of size ~0.01-0.05 rounds most updates
    at lr 1e-5 away (bfloat16 keeps 8 significant bits). float32 master weights (and so float32
    optimizer state) fix that; the matmuls still run in bfloat16 under autocast. The Parameter objects
    are kept (``.data`` is replaced), so tied weights stay tied. peft already does this for LoRA
    adapters (``get_peft_model(autocast_adapter_dtype=True)``, the default); here it is a no-op for them.
    """
    for param in module.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
    return module


def grad_norm(
    params: Iterable[torch.Tensor], process_group: Any = None, device: torch.device | None = None
) -> torch.Tensor:
    """The 2-norm (float32 scalar) of the gradients of ``params``, taken as one vector.

    ``process_group``: the gradients are sharded over this group (FSDP: each rank holds a disjoint
    piece of every gradient), so the squared local norms are summed over the group before the square
    root; every rank of the group must call this (a collective), also one holding no gradient. None:
    the gradients are whole on every rank (one device; DDP, where they are already all-reduced).
    ``device``: where the scalar lives when this rank holds no gradient (the collective's device).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        squared = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum()
    else:
        squared = torch.zeros((), dtype=torch.float32, device=device)
    if process_group is not None:
        dist.all_reduce(squared, group=process_group)
    return squared.sqrt()


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    process_group: Any = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm of :func:`grad_norm` (so, given the shards'
    ``process_group``, the norm of the whole sharded gradients): every gradient is scaled by
    min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping."""
    params = list(params)
    norm = grad_norm(params, process_group, device)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.device, p.grad.dtype))
    return norm


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
    groups: Sequence[Sequence[torch.Tensor]] | None = None,
) -> None:
    """Clip like Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm``, also under FSDP.

    The body of every method's ``configure_gradient_clipping``. ``groups``: clip each group of
    parameters by its own norm (SD^2's arms); None: one global norm over everything that trains.
    Lightning's own path (``module.clip_gradients``) clips by value anywhere and by norm on one device
    and under DDP, but FSDP's precision plugin refuses ``norm`` (a shard's local norm would be wrong):
    there the global norm goes through the FSDP root's ``clip_grad_norm_``, and per group through
    :func:`clip_grad_norm` with the squared shard norms summed over FSDP's process group.
    """
    if clip_val is None or clip_val <= 0:
        return
    if algorithm not in (None, "norm"):
        _clip_whole(module, optimizer, clip_val, algorithm)
        return
    strategy = module.trainer.strategy
    root = strategy.model if isinstance(strategy, FSDPStrategy) else None
    if groups is None:
        if root is None:
            _clip_whole(module, optimizer, clip_val, "norm")
        else:
            root.clip_grad_norm_(clip_val)  # type: ignore[operator]
        return
    # NO_SHARD keeps whole, all-reduced gradients on every rank, like DDP: nothing to sum
    sharded = root is not None and getattr(root, "sharding_strategy", None) is not ShardingStrategy.NO_SHARD
    process_group = getattr(root, "process_group", None) if sharded else None
    for params in groups:
        clip_grad_norm(params, float(clip_val), process_group, module.device)


def _clip_whole(
    module: L.LightningModule, optimizer: torch.optim.Optimizer, clip_val: float, algorithm: str
) -> None:
    """Lightning's clipping (``module.clip_gradients``), or for a fused optimizer over unscaled gradients
    the same torch call directly: Lightning's mixed-precision plugin refuses any fused optimizer for fear
    of scaled gradients. A fused optimizer a config asked for under ``16-mixed`` goes to Lightning, which
    says why it cannot clip it."""
    if not optimizer.defaults.get("fused") or scaled_gradients(module):
        module.clip_gradients(optimizer, clip_val, algorithm)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)


class WholeNormClipping:
    """A LightningModule mixin (listed before ``L.LightningModule``): Lightning's gradient clipping, the norm
    taken over everything that trains, also when FSDP shards it (:func:`clip_gradients`)."""

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if not isinstance(self, L.LightningModule):
            raise TypeError(f"{type(self).__name__}: WholeNormClipping is a LightningModule mixin")
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
