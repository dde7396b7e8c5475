"""Medusa-1 training: config validation, head metrics on hand-made logits, a micro fit on a frozen
verifier (heads only in the checkpoint), and the two export layouts reloading to the same logits."""

from __future__ import annotations

import functools
import json

import lightning as L
import pytest
import torch
from datasets import Dataset

from tests.conftest import make_tokenizer, tiny_llama
from train.config import ConfigError
from train.data.datamodule import LMDataModule
from train.export_heads import export_heads, load_vllm_medusa
from train.methods.medusa import MedusaConfig, MedusaModule, head_metrics
from train.models.heads import MedusaHeads

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(num_heads=0), "method.num_heads"),
        (dict(decay=0.0), "method.decay"),
        (dict(seq_len=5), "method.seq_len"),
    ],
)
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        MedusaConfig(optimizer=ADAMW, **kw)


def test_head_metrics_on_hand_made_logits():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    vocab, length = 9, 7
    verifier = torch.full((1, length, vocab), -5.0)
    for t in range(length - 1):
        verifier[0, t, ids[0, t + 1]] = 5.0  # the verifier predicts the corpus exactly
    heads = torch.full((2, 1, length, vocab), -5.0)
    for t in range(length):
        if t + 2 < length:
            heads[0, 0, t, ids[0, t + 2]] = 5.0  # head 0 always right
        heads[1, 0, t, 0] = 5.0  # head 1 always wrong
    m = head_metrics(heads, verifier, ids)
    assert int(m["top1_0"]) == int(m["n_0"]) == 5 and int(m["agree_0"]) == 5
    assert int(m["top1_1"]) == 0 and int(m["n_1"]) == 4
    # every usable position: head 0 agrees, head 1 does not -> one extra token per call, tau = 2
    assert int(m["run"]) == int(m["positions"]) == length - 2 - 1


def _data() -> LMDataModule:
    docs = [f"def f{i}(x):\n    return x * {i}  # doc {i}\n" * 4 for i in range(40)]
    splits = {
        "train": Dataset.from_dict({"text": docs[:32]}),
        "validation": Dataset.from_dict({"text": docs[32:]}),
    }
    return LMDataModule(splits, make_tokenizer(), seq_len=24, batch_size=4, seed=0, drop_last=True)


def test_micro_fit_trains_heads_only_and_logs_per_head_metrics(tmp_path):
    verifier = tiny_llama(hidden=32, seed=0)
    before = {k: v.clone() for k, v in verifier.state_dict().items()}
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=3, seq_len=24, batch_size=4)
    heads = MedusaHeads.from_verifier(verifier, 3, 1)
    module = MedusaModule(verifier, heads, cfg)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=_data())
    metrics = trainer.callback_metrics
    for k in range(3):
        assert 0.0 <= float(metrics[f"val/head{k}_top1"]) <= float(metrics[f"val/head{k}_top5"]) <= 1.0
    assert 1.0 <= float(metrics["val/simulated_block_efficiency"]) <= 4.0
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items())  # frozen
    assert any(p.abs().sum() > 0 for p in heads.blocks[0].parameters())  # the residual layers trained
    ckpt = tmp_path / "medusa.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert state and all(k.startswith("heads.") for k in state)


def test_both_export_layouts_reload_to_the_same_logits(tmp_path):
    heads = MedusaHeads(hidden_size=16, vocab_size=23, num_heads=3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    mixin_dir = export_heads(heads, tmp_path)
    hidden = torch.randn(2, 5, 16)
    expected = heads(hidden)
    torch.testing.assert_close(MedusaHeads.from_pretrained(mixin_dir)(hidden), expected)
    config = json.loads((tmp_path / "heads_vllm" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True
    assert (
        config["hidden_size"],
        config["vocab_size"],
        config["num_heads"],
        config["num_hidden_layers"],
    ) == (16, 23, 3, 2)
    torch.testing.assert_close(load_vllm_medusa(tmp_path / "heads_vllm")(hidden), expected)
