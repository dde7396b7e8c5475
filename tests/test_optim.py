"""Optimizer / scheduler partials shared by the method configs (train/optim.py)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from train.config import ConfigError
from train.optim import check_optimizer, configure_optimizers


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
