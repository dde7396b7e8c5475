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
from tests.fsdp import RecordingRoot, fake_fsdp_trainer
from tests.methods.vllm_medusa_reference import load_vllm_medusa
from train.config import ConfigError
from train.data.datamodule import LMDataModule
from train.export.medusa_layout import export_vllm_medusa
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.module import MedusaModule, head_metrics
from train.models.heads import MedusaHeads, medusa_loss

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
    trainer = _trainer(tmp_path, 4)
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
    heads.save_pretrained(tmp_path / "heads")
    export_vllm_medusa(heads, tmp_path / "heads_vllm")
    mixin_dir = tmp_path / "heads"
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


def test_head_metrics_count_every_rank_against_the_verifier():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    vocab, length = 8, 6
    verifier = torch.full((1, length, vocab), -5.0)
    for t in range(length - 1):
        verifier[0, t, ids[0, t + 1]] = 5.0
    heads = torch.zeros(1, 1, length, vocab)
    for t in range(length - 2):
        heads[0, 0, t, 0] = 3.0  # rank 0: always token 0 (wrong)
        heads[0, 0, t, ids[0, t + 2]] = 2.0  # rank 1: the verifier's token
    m = head_metrics(heads, verifier, ids, k_top=3)
    assert int(m["rank_0_0"]) == 0 and int(m["rank_0_1"]) == int(m["n_0"]) == 4 and int(m["rank_0_2"]) == 0


def test_medusa2_needs_lora_and_self_distillation_checks_its_prompt():
    with pytest.raises(ConfigError, match="method.lora.enabled"):
        MedusaConfig(optimizer=ADAMW, joint=True)
    with pytest.raises(ConfigError, match="method.prompt_len"):
        MedusaConfig(optimizer=ADAMW, seq_len=24, prompt_len=20)
    with pytest.raises(ConfigError, match="method.heads_lr_multiplier"):
        MedusaConfig(optimizer=ADAMW, heads_lr_multiplier=0)


def _trainer(tmp_path, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )


LORA = {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]}


def _lora_b(module: MedusaModule) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in module.verifier.named_parameters() if "lora_B" in n]


def test_medusa2_trains_heads_first_then_adapters_never_the_base(tmp_path):
    verifier = tiny_llama(hidden=32, seed=0)
    base = {k: v.clone() for k, v in verifier.state_dict().items()}
    cfg = MedusaConfig(
        optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, joint=True, lora=LORA, backbone_frozen_steps=2
    )
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    lrs = [g["lr"] for g in module.configure_optimizers().param_groups]
    assert lrs == [pytest.approx(1e-2), pytest.approx(4e-2)]  # adapters, heads at 4x
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=_data())
    assert all(float(b.abs().sum()) == 0 for b in _lora_b(module))  # frozen steps: heads only
    assert any(p.abs().sum() > 0 for p in module.heads.blocks[0].parameters())
    trainer = _trainer(tmp_path, 4)
    trainer.fit(module, datamodule=_data())
    assert any(float(b.abs().sum()) > 0 for b in _lora_b(module))  # then the adapters train
    plain = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in verifier.state_dict().items()
    }
    assert all(torch.equal(base[k], plain[k]) for k in base)  # the base weights never move
    # checkpoints hold the heads and the adapters only, and load back into a fresh module
    trainer.save_checkpoint(tmp_path / "m2.ckpt")
    state = torch.load(tmp_path / "m2.ckpt", weights_only=False)["state_dict"]
    assert state and all(k.startswith("heads.") or "lora_" in k for k in state)
    fresh = MedusaModule(tiny_llama(hidden=32, seed=0), MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    fresh.load_state_dict(state, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(_lora_b(fresh), _lora_b(module), strict=True))
    # the merged verifier the finish step evaluates against computes what the adapted one does
    merged = module.evaluation_verifier(verifier)
    ids = torch.tensor([[256, 5, 9, 3, 7, 11]])
    module.verifier.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, module.verifier(input_ids=ids).logits)
    assert not hasattr(merged, "disable_adapter")


def test_medusa2_loss_is_the_base_loss_plus_heads_weight_times_the_heads_loss():
    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, joint=True, lora=LORA)
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        head_logits, logits = module._forward(ids)
        heads, _ = medusa_loss(head_logits, ids, decay=cfg.decay)
        base = module._base_loss(ids, logits)
        for weight in (0.2, 0.7):
            cfg.heads_weight = weight
            torch.testing.assert_close(module.training_step({"input_ids": ids}, 0), base + weight * heads)


def test_the_heads_loss_decays_by_the_configured_decay():
    """Training and validation weight head k by method.decay**k (not medusa_loss's default)."""
    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=3, seq_len=24, batch_size=4, decay=0.3)
    heads = MedusaHeads.from_verifier(verifier, 3, 1)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(std=0.5)  # heads that differ from one another
    module = MedusaModule(verifier, heads, cfg)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, per_head = medusa_loss(module._forward(ids)[0], ids)
        want = sum(0.3**k * loss for k, loss in enumerate(per_head))
        torch.testing.assert_close(module.training_step({"input_ids": ids}, 0), want)
        module.validation_step({"input_ids": ids}, 0)
    assert module._sums["loss"] == pytest.approx(float(want) * 2, rel=1e-5)  # summed over the 2 blocks


@pytest.mark.parametrize("joint", [False, True])
def test_gradient_clipping_under_fsdp_goes_through_the_fsdp_root(joint):
    """trainer=fsdp (bf16-mixed): Lightning's FSDPPrecision refuses clipping by norm, so the default hook
    raised at the first optimizer step; the norm of everything sharded is the FSDP root's."""
    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, seq_len=24, joint=joint, lora=LORA if joint else None)
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    root = RecordingRoot()
    module.trainer = fake_fsdp_trainer(root)
    module.configure_gradient_clipping(module.configure_optimizers(), 1.0, "norm")
    assert root.clipped == [1.0]


def test_medusa2_self_distillation_regenerates_blocks_and_keeps_the_verifier_close(tmp_path):
    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(
        optimizer=ADAMW,
        num_heads=2,
        seq_len=24,
        batch_size=4,
        joint=True,
        lora=LORA,
        self_distill=True,
        prompt_len=8,
    )
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    ids = torch.randint(0, 200, (3, 24))
    regenerated = module._regenerate(ids, module._generator(0, 0))
    assert regenerated.shape == ids.shape and torch.equal(regenerated[:, :8], ids[:, :8])
    # seeded by (run seed, step, rank): a resumed run regenerates the same blocks, another rank others
    assert torch.equal(module._regenerate(ids, module._generator(0, 0)), regenerated)
    assert not torch.equal(module._regenerate(ids, module._generator(0, 1))[:, 8:], regenerated[:, 8:])
    # at the start the adapters are zero: the KL to the frozen verifier is 0
    logits = module.verifier(input_ids=ids).logits
    assert float(module._base_loss(ids, logits)) == pytest.approx(0.0, abs=1e-6)
    _trainer(tmp_path, 2).fit(module, datamodule=_data())
    assert all(torch.isfinite(p).all() for p in module.heads.parameters())


def test_each_rank_regenerates_its_own_blocks(monkeypatch):
    """training_step seeds the regeneration by (run seed, step, rank): reproducible, distinct per rank."""
    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(
        optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, self_distill=True, prompt_len=8
    )
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg, seed=3)
    real, seen = module._regenerate, []

    def recorded(ids, generator=None):
        out = real(ids, generator)
        seen.append(out)
        return out

    monkeypatch.setattr(module, "_regenerate", recorded)
    batch = {"input_ids": torch.randint(0, 200, (2, 24))}
    for rank in (0, 1, 0):
        monkeypatch.setattr(type(module), "global_rank", property(lambda self, r=rank: r))
        module.training_step(batch, 0)
    assert torch.equal(seen[0], seen[2]) and not torch.equal(seen[0], seen[1])


def test_soft_targets_are_the_verifiers_shifted_distributions():
    torch.manual_seed(0)
    verifier_logits = torch.randn(2, 7, 11)
    ids = torch.randint(0, 11, (2, 7))
    # heads that predict exactly the verifier's distribution at t + k + 1: zero KL
    exact = torch.stack([torch.roll(verifier_logits, -(k + 1), dims=1) for k in range(2)])
    loss, per_head = medusa_loss(exact, ids, verifier_logits=verifier_logits)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    # by hand for head 1 with uniform heads: mean over the 4 valid positions of KL(p || uniform)
    uniform = torch.zeros(2, 2, 7, 11)
    _, per_head = medusa_loss(uniform, ids, verifier_logits=verifier_logits)
    p = verifier_logits[:, 2:6].softmax(-1)  # head 1 at t = 0..3 (t + 3 < 7) reads the verifier's row t + 2
    kl = (p * (p.log() + torch.log(torch.tensor(11.0)))).sum(-1).mean()
    assert float(per_head[1]) == pytest.approx(float(kl), rel=1e-5)


def test_finish_exports_heads_with_their_tree_and_evaluates_medusa(tmp_path, monkeypatch):
    from train import report as report_module
    from train.evaluation import EvalConfig
    from train.report import Finishable, RunContext, finish

    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, tree_nodes=3, tree_top=3)
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg)
    assert isinstance(module, Finishable)
    _trainer(tmp_path, 2).fit(module, datamodule=_data())
    assert len(module.rank_accuracy) == 2 and len(module.rank_accuracy[0]) == 3
    tree = module.measured_tree()
    assert tree is not None and len(tree) == 3
    prompts = [torch.tensor([[256, 10, 20, 30, 40]]), torch.tensor([[256, 50, 60, 70]])]
    monkeypatch.setattr(report_module, "build_prompts", lambda *a, **k: prompts)
    eval_cfg = EvalConfig(
        temperatures=[0.0, 1.0],
        seeds=[0],
        decoders=[
            "medusa",
            {"name": "chain2", "_target_": "train.decoding.HeadsDecoder", "tree": [[0], [0, 0]]},
            "medusa_typical",
        ],
        max_new_tokens=6,
        progress=False,
        warmup=False,
        plots=False,
    )
    run = tmp_path / "run"
    report = finish(
        module,
        verifier,
        make_tokenizer(),
        RunContext(
            run,
            eval_cfg,
            name="unit",
            config={"name": "unit", "model": {"verifier": "org/verifier", "drafter": "org/drafter"}},
        ),
    )
    assert MedusaHeads.from_pretrained(run / "heads").tree == tree
    assert load_vllm_medusa(run / "heads_vllm").num_heads == 2
    assert set(report["drafters"]) == {"medusa-1"} and report["method"]["tree"] == tree
    results = json.loads((run / "eval" / "results.json").read_text())
    for r in results["runs"]:
        assert r["lossless"] == (r["decoder"] != "medusa_typical" or r["temperature"] == 0.0)
        if r["temperature"] == 0.0:
            assert r["greedy_match"] is True
    text = (run / "report.md").read_text()
    assert "## Heads (last validation)" in text and "medusa_typical (lossy)" in text
    assert "base_model: org/verifier" in (run / "heads" / "README.md").read_text()
    for folder in ("heads", "heads_vllm"):
        assert "AutoModelForCausalLM" not in (run / folder / "README.md").read_text()
    assert "vllm serve org/verifier --speculative-config" in (run / "heads_vllm" / "README.md").read_text()


def test_export_saves_ngram_models_of_the_training_split(tmp_path):
    from train.models.ngram import NGramLM

    verifier = tiny_llama(hidden=32, seed=0)
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, seq_len=24, batch_size=4, ngram_orders=[2, 3])
    documents = [[5, 6, 7, 5, 6, 8], [6, 7, 5]]
    module = MedusaModule(verifier, MedusaHeads.from_verifier(verifier, 2, 1), cfg, None, lambda: documents)
    module.export(str(tmp_path / "heads"))
    for order in (2, 3):
        lm = NGramLM.load(tmp_path / "heads" / f"ngram_{order}")
        want = NGramLM(order, lm.vocab_size).fit(documents)
        assert lm.order == order and lm.vocab_size == verifier.config.vocab_size
        assert lm.logprob([[5, 6]], [7]) == pytest.approx(want.logprob([[5, 6]], [7]))
    with pytest.raises(ConfigError, match="method.ngram_orders"):
        MedusaConfig(optimizer=ADAMW, ngram_orders=[5])
