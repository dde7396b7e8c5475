"""Evaluation results reach every logger; W&B also gets the table and the plots."""

from __future__ import annotations

from lightning.pytorch.loggers import CSVLogger, WandbLogger

from train.evaluation import EvalConfig, evaluate_drafters, scalar_metrics


def test_loggers_receive_scalars_table_and_images(verifier, drafter, prompts, tmp_path):
    class FakeWandb(WandbLogger):
        def __init__(self):  # no W&B run: record what would be sent
            self.metrics, self.payloads = [], []

        @property
        def experiment(self):
            return type("Run", (), {"log": lambda _, payload: self.payloads.append(payload)})()

        def log_metrics(self, metrics, step=None):
            self.metrics.append((metrics, step))

    wandb_logger = FakeWandb()
    csv_logger = CSVLogger(save_dir=str(tmp_path), name="csv", version="")
    cfg = EvalConfig(
        temperatures=[0.0], decoders=["sd_g2"], seeds=[0], max_new_tokens=4, warmup=False, progress=False
    )
    results = evaluate_drafters(
        verifier, {"d": drafter}, prompts, cfg, out_dir=tmp_path, loggers=[csv_logger, wandb_logger], step=7
    )
    assert "eval/d/sd_g2/T0/verifier_tokens_per_call" in scalar_metrics(results)
    csv_logger.save()
    assert "eval/d/sd_g2/T0/block_efficiency" in (tmp_path / "csv" / "metrics.csv").read_text()
    ((metrics, step),) = wandb_logger.metrics
    assert step == 7 and "eval/ar/T0/tokens_per_second" in metrics
    (payload,) = wandb_logger.payloads
    import wandb

    assert isinstance(payload["eval/results"], wandb.Table)
    assert isinstance(payload["eval/block_efficiency"], wandb.Image)  # one gamma: the bar chart
    assert isinstance(payload["eval/per_position_acceptance"], wandb.Image)
