"""Optimizers and schedulers from Hydra partials, shared by every method's config and module.

A method config holds ``optimizer`` / ``scheduler`` as Hydra ``_partial_: true`` nodes (a
``functools.partial`` once instantiated); :func:`check_optimizer` validates them at start-up and
:func:`configure_optimizers` turns them into what Lightning's ``configure_optimizers`` returns.
This module sits at the bottom of the layering: it imports only :mod:`train.config` of ours.
"""

from __future__ import annotations

import functools
from typing import Any

from train.config import require

__all__ = ["check_optimizer", "configure_optimizers", "partial_kwarg"]


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


def configure_optimizers(params: Any, optimizer: Any, scheduler: Any) -> Any:
    """Lightning's optimizer (or optimizer + scheduler dict) from Hydra partials.

    params: the parameters to train. The scheduler, if any, steps every optimizer step.
    """
    opt = optimizer(params)
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}
