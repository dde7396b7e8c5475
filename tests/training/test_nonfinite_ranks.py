"""A non-finite loss on one rank stops every rank with the same error (issue 43, item 8): two gloo
processes under Lightning's DDP strategy on the CPU, only rank 1's loss is NaN."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.fsdp import gloo_rank, run_ranks
from train.training.callbacks import NonFiniteLossError, NonFiniteLossGuard, nonfinite_losses

BAD_STEP = 2
TIMEOUT_S = 120


class NaNOnRankOne(L.LightningModule):
    """A linear model whose loss is NaN on rank 1 from step ``BAD_STEP`` on, finite everywhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_rank == 1 and self.global_step >= BAD_STEP:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _worker(rank: int, out: str) -> None:
    with gloo_rank(rank, 2, out):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=6,
            callbacks=[NonFiniteLossGuard()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=out,
        )
        data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=2)
        try:
            trainer.fit(NaNOnRankOne(), train_dataloaders=data)
            outcome = {"raised": None, "step": trainer.global_step}
        except NonFiniteLossError as err:
            outcome = {"raised": str(err), "step": trainer.global_step}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_with_the_same_error(tmp_path: Path) -> None:
    run_ranks(_worker, tmp_path, timeout_s=TIMEOUT_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for outcome in ranks:
        assert outcome["raised"] is not None, ranks
        assert f"nan on rank 1 of 2) at global step {BAD_STEP}" in outcome["raised"], outcome
    assert ranks[0]["raised"] == ranks[1]["raised"]
    assert [r["step"] for r in ranks] == [BAD_STEP, BAD_STEP]  # the bad batch updated no weights


def _module_in(world_size: int, gathered: list[float]) -> SimpleNamespace:
    strategy = SimpleNamespace(all_gather=lambda value: torch.tensor(gathered).reshape(world_size, 1))
    return SimpleNamespace(_trainer=SimpleNamespace(world_size=world_size, strategy=strategy))


def test_a_finite_loss_here_still_sees_another_ranks_nan() -> None:
    module = _module_in(2, [0.5, float("nan")])
    assert list(nonfinite_losses(torch.tensor(0.5), module)) == [1]  # type: ignore[arg-type]
    assert nonfinite_losses(torch.tensor(0.5), _module_in(2, [0.5, 0.25])) == {}  # type: ignore[arg-type]


def test_on_one_device_only_this_loss_counts() -> None:
    alone = SimpleNamespace(_trainer=None)
    assert list(nonfinite_losses(torch.tensor(float("inf")), alone)) == [0]  # type: ignore[arg-type]
    assert nonfinite_losses(torch.tensor(1.0), alone) == {}  # type: ignore[arg-type]
