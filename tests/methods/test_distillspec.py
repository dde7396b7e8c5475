"""DistillSpec: config validation, the training step per data source, checkpoints without the verifier,
NaN guard, resume, LoRA, the exported drafter as a Hugging Face ``assistant_model``, and the whole
run through the shared finish step (train/report.py, tested on its own in tests/test_report.py)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import open_dict

from tests.conftest import CONF_DIR, REPO_ROOT, make_tokenizer, tiny_llama
from tests.fsdp import RecordingRoot, fake_fsdp_trainer
from train.cli.train_command import load_spec
from train.config import ConfigError
from train.data.datamodule import PromptDataModule
from train.losses import divergence
from train.methods.distillspec.config import DATA_SOURCES, DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.training.callbacks import GracefulStop, NonFiniteLossError, NonFiniteLossGuard

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
TEXT = "def add(a, b):\n    return a + b  # sum of two numbers\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> DistillSpecConfig:
    base = dict(
        optimizer=ADAMW, max_new_tokens=6, prompt_len=8, batch_size=4, num_prompts=8, num_val_prompts=4
    )
    base.update(kw)
    return DistillSpecConfig(**base)


def _splits() -> dict[str, Dataset]:
    docs = [f"{TEXT * 2} # doc {i} " + "x" * (i % 7) for i in range(24)]
    return {
        "train": Dataset.from_dict({"text": docs[:16]}),
        "validation": Dataset.from_dict({"text": docs[16:]}),
    }


def _module(cfg: DistillSpecConfig) -> tuple[DistillSpecModule, PromptDataModule]:
    tok = make_tokenizer()
    drafter, verifier = tiny_llama(hidden=32, seed=1), tiny_llama(hidden=64, seed=0)
    drafter.train()
    data = PromptDataModule(
        _splits(),
        tok,
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
    )
    return DistillSpecModule(drafter, verifier, tok, cfg, seed=0), data


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"divergence": "kl"}, "method.divergence must be one of ('fkl', 'rkl', 'jsd', 'tvd'), got 'kl'"),
        ({"lmbda": 1.5}, "method.lmbda must be in [0, 1], got 1.5"),
        ({"lmbda": -0.1}, "method.lmbda"),
        ({"beta": 2.0}, "method.beta must be in [0, 1]"),
        ({"temperature": 0.0}, "method.temperature must be > 0"),
        ({"temperature": -1.0}, "method.temperature"),
        ({"data_source": "web"}, "method.data_source must be one of"),
        ({"verifier_temperature": -0.5}, "method.verifier_temperature must be null or a finite number >= 0"),
        ({"verifier_temperature": float("nan")}, "method.verifier_temperature"),
        ({"max_new_tokens": 0}, "method.max_new_tokens"),
        ({"lora": {"enabled": True, "r": 0}}, "method.lora.r"),
        ({"lora": {"rank": 4}}, "method.lora"),
        ({"optimizer": functools.partial(torch.optim.AdamW, lr=-1.0)}, "method.optimizer.lr"),
        ({"validate_before": "yes"}, "method.validate_before must be true or false"),
    ],
)
def test_bad_config_fails_naming_the_key(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(**kw)


def _compose(overrides: list[str], tmp_path: Path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=overrides + [f"paths.root_dir={tmp_path}"],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        cfg.paths.run_dir = str(tmp_path / "run")
        del cfg["hydra"]
    return cfg


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.divergence=kl", "method.divergence"),
        ("method.lmbda=2", "method.lmbda"),
        ("method.beta=-1", "method.beta"),
        ("method.temperature=0", "method.temperature"),
        ("eval.gammas=[0]", "eval.gammas"),
        ("eval.num_prompts=0", "eval.num_prompts"),
    ],
)
def test_experiment_rejects_bad_values_at_start_up(override, key, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_spec(_compose(["experiment=distillspec", override], tmp_path))


def test_experiment_composes_and_sources_enumerate(tmp_path):
    spec = load_spec(_compose(["experiment=distillspec"], tmp_path))
    assert spec.name == "distillspec" and isinstance(spec.method, DistillSpecConfig)
    assert spec.model.name == "smollm2" and spec.model.smollm2 is not None and spec.data.name == "chat"
    ev = spec.eval
    assert ev.temperatures == [0.0, 1.0] and ev.gammas is None and len(ev.seeds) == 1
    # the adaptive chain (cap 6, threshold 0.3) behind prompt lookup, on every core other work leaves
    assert {label: c["gamma"] for label, c in ev.decoder_configs.items()} == {"sd_lookup": 6}
    assert ev.decoder_configs["sd_lookup"]["draft_length"] == "cost"
    assert ev.decoder_configs["sd_lookup"]["lookup_tokens"] == 6
    assert (ev.num_prompts, ev.prompt_len, ev.max_new_tokens, ev.num_threads) == (8, 256, 48, "idle")
    # the main job starts from the pair's generic drafter and distils it with JSD on the on-policy mix
    m = spec.method
    assert (m.divergence, m.data_source, m.verifier_temperature, m.answers) == (
        "jsd",
        "mixed_verifier",
        0.0,
        None,
    )
    ablation = load_spec(_compose(["experiment=distillspec_ablation"], tmp_path))
    assert ablation.method.answers == "pair" and ablation.trainer.max_time == "00:00:04:00"
    tiny = load_spec(_compose(["experiment=distillspec_tiny"], tmp_path))
    assert tiny.model.name == "tiny" and tiny.data.name == "stdlib" and tiny.eval.gammas == [1, 2, 4]
    assert [_cfg(data_source=s, lmbda=0.3).on_policy_probability for s in DATA_SOURCES] == [
        0.0,
        0.0,
        1.0,
        0.3,
        0.3,
    ]
    assert _cfg(data_source="mixed_fixed").off_policy_source == "fixed"
    assert _cfg(data_source="mixed_verifier").off_policy_source == "verifier"


def test_tokenizer_mismatch_fails_when_loading(tiny_pair_dir, tmp_path):
    from train.config import ModelConfig
    from train.models.loading import TokenizerMismatchError, load_pair

    other = tmp_path / "drafter"
    tiny_llama(hidden=32, seed=1).save_pretrained(other)
    tok = make_tokenizer()
    vocab = tok.get_vocab()
    swapped = {t: (vocab["b"] if t == "a" else vocab["a"] if t == "b" else i) for t, i in vocab.items()}
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab=swapped, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    ).save_pretrained(other)
    cfg = ModelConfig(name="t", verifier=str(tiny_pair_dir / "verifier"), drafter=str(other))
    with pytest.raises(TokenizerMismatchError):
        load_pair(cfg)


# ------------------------------------------------------------------------------------------ module


@pytest.mark.parametrize("source", ["fixed", "verifier", "drafter"])
@pytest.mark.parametrize("div", ["fkl", "rkl", "jsd", "tvd"])
def test_training_step_runs_for_every_source_and_divergence(source, div):
    module, data = _module(_cfg(data_source=source, divergence=div))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    ro = module.make_batch(batch, source, module._generator(0, 0))
    assert int(ro.continuation_mask.sum()) > 0
    assert not ro.continuation_mask[:, : ro.prompt_width].any()  # the loss never sees prompt tokens
    loss, d_logits, _, mask = module.distill_loss(ro)
    assert d_logits.shape[:2] == mask.shape and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in module.drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all(p.grad is None for p in module.verifier.parameters())


def test_each_rank_draws_its_own_on_policy_rollouts(monkeypatch):
    """Under DDP the ranks hold different prompts (Lightning's distributed sampler) and, at the same
    step, differently seeded rollouts: training_step salts the rollout generator with the rank."""
    module, data = _module(_cfg(data_source="drafter"))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    real, seen = module.make_batch, []

    def recorded(*args):
        rollout = real(*args)
        seen.append(rollout.sequences)
        return rollout

    monkeypatch.setattr(module, "make_batch", recorded)
    for rank in (0, 1, 0):
        monkeypatch.setattr(type(module), "global_rank", property(lambda self, r=rank: r))
        module.training_step(batch, 0)
    assert torch.equal(seen[0], seen[2])  # reproducible per (step, rank)
    assert not torch.equal(seen[0], seen[1])  # another rank, other samples


def _fixed_batch(module: DistillSpecModule, data: PromptDataModule) -> dict[str, torch.Tensor]:
    data.setup()
    return next(iter(data.train_dataloader()))


def test_training_loss_adds_the_ground_truth_ce_times_ce_weight():
    """loss = divergence + ce_weight x CE on the corpus continuation (ce_weight 0: the divergence alone)."""
    module, data = _module(_cfg(data_source="fixed", ce_weight=0.3))
    batch = _fixed_batch(module, data)
    with torch.no_grad():
        div = module.distill_loss(module._fixed(batch))[0]
        ce = module.ground_truth_ce(batch)
        assert float(ce) > 0.1
        torch.testing.assert_close(module.training_step(batch, 0), div + 0.3 * ce)
        module.cfg.ce_weight = 0.0
        torch.testing.assert_close(module.training_step(batch, 0), div)


def test_distill_loss_uses_the_configured_jsd_beta():
    module, data = _module(_cfg(data_source="fixed", divergence="jsd", beta=0.1))
    ro = module._fixed(_fixed_batch(module, data))
    with torch.no_grad():
        loss, d_logits, v_logits, mask = module.distill_loss(ro)
        want = divergence("jsd", d_logits, v_logits, mask, beta=0.1)
        other = divergence("jsd", d_logits, v_logits, mask, beta=0.5)
    torch.testing.assert_close(loss, want)
    assert abs(float(want) - float(other)) > 1e-4  # beta matters for these logits


def test_gradient_clipping_under_fsdp_goes_through_the_fsdp_root():
    """trainer=fsdp (bf16-mixed): Lightning's FSDPPrecision refuses clipping by norm, so the default hook
    raised at the first optimizer step; the norm of the whole sharded drafter is the FSDP root's."""
    module, _ = _module(_cfg())
    root = RecordingRoot()
    module.trainer = fake_fsdp_trainer(root)
    module.configure_gradient_clipping(module.configure_optimizers(), 1.0, "norm")
    assert root.clipped == [1.0]


def test_verifier_rollouts_are_cached_per_prompt():
    module, data = _module(_cfg(data_source="verifier"))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    a = module.make_batch(batch, "verifier", module._generator(0, 0))
    assert len(module.answers) == batch["input_ids"].shape[0]
    b = module.make_batch(batch, "verifier", module._generator(5, 0))  # another seed: the same answers
    assert torch.equal(a.sequences[a.continuation_mask], b.sequences[b.continuation_mask])


def _verifier_forward_widths(
    module: DistillSpecModule, batch: dict[str, torch.Tensor], source: str
) -> list[int]:
    """The token widths of the verifier's forwards during one training step on ``source``."""
    widths: list[int] = []
    module.pick_source = lambda step: source  # type: ignore[method-assign]
    hook = module.verifier.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        module.training_step(batch, 0)
    finally:
        hook.remove()
    return widths


@pytest.mark.parametrize("budget_mb, reused", [(64.0, True), (0.0, False)])
def test_the_verifier_never_recomputes_what_it_computed_before(budget_mb, reused):
    """Within verifier_cache_mb: a verifier batch seen before runs no verifier forward (its continuations'
    logits are kept), and an on-policy batch on seen prompts runs the verifier over its continuation only
    (the prompts' caches are kept). With 0 MiB every batch is one full forward over prompt and continuation
    (the losses are the same either way, tested in tests/training/test_verifier_scores.py)."""
    module, data = _module(_cfg(data_source="mixed_verifier", verifier_cache_mb=budget_mb))
    batch = _fixed_batch(module, data)
    width = batch["input_ids"].shape[1]
    first = _verifier_forward_widths(module, batch, "verifier")
    assert first[0] == width  # the generation's prefill
    again = _verifier_forward_widths(module, batch, "verifier")
    on_policy = _verifier_forward_widths(module, batch, "drafter")
    if reused:
        assert again == []
        assert len(on_policy) == 1 and on_policy[0] < module.cfg.max_new_tokens
    else:
        assert len(again) == 1 and again[0] > width
        assert len(on_policy) == 1 and on_policy[0] > width


def test_verifier_cache_mb_is_validated_at_start_up():
    with pytest.raises(ConfigError, match="method.verifier_cache_mb"):
        _cfg(verifier_cache_mb=-1)


def test_drafter_context_cuts_the_drafters_prompt_in_training_only():
    """``method.drafter_context``: a training step runs the drafter over the prompt's last C tokens and the
    continuation; validation (eval mode) over the whole prompt; the verifier's scores see the whole prompt."""
    with pytest.raises(ConfigError, match="method.drafter_context"):
        _cfg(drafter_context=0)
    module, data = _module(_cfg(data_source="mixed_verifier", drafter_context=3))
    batch = next(iter(data.train_dataloader()))
    widths: list[int] = []
    hook = module.drafter.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        _verifier_forward_widths(module, batch, "verifier")
        n, prompt_width = module.cfg.max_new_tokens, batch["input_ids"].shape[1]
        assert prompt_width > 3 and widths and widths[-1] <= 3 + n
        module.eval()
        rollouts = module.make_batch(batch, "verifier", torch.Generator().manual_seed(0))
        module.distill_loss(rollouts)
        assert widths[-1] == rollouts.sequences.shape[1] > 3 + rollouts.sequences.shape[1] - prompt_width
    finally:
        hook.remove()


def test_answers_given_in_advance_are_used_instead_of_generating(monkeypatch):
    """The fixed-data arm: continuations given offline (cut to max_new_tokens) are what verifier batches
    train on, and the verifier generates nothing for those prompts; other prompts are still answered."""
    from train.models.answers import Answer

    module, data = _module(_cfg(data_source="verifier"))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    given = [7, 8, 9, 10] * 20
    empty = torch.zeros(0, 1)
    module.preload_answers([Answer(p, given, empty, empty) for p in prompts[1:]])
    generated: list[int] = []
    real = module.verifier_sampler.sample
    monkeypatch.setattr(
        module.verifier_sampler.__class__,
        "sample",
        lambda self, model, i, a, g, **kw: generated.append(i.shape[0]) or real(model, i, a, g, **kw),
    )
    ro = module.make_batch(batch, "verifier", module._generator(0, 0))
    assert generated == [1]  # only the prompt without an answer
    tail = ro.sequences[:, ro.prompt_width :]
    cut = given[: module.cfg.max_new_tokens]
    for row in range(1, ids.shape[0]):
        assert tail[row][ro.continuation_mask[row, ro.prompt_width :]].tolist() == cut


def test_offline_answers_need_the_answer_cache():
    with pytest.raises(ConfigError, match="method.answers"):
        _cfg(answers="pair", cache_answers=False)


@pytest.mark.parametrize("cache", [True, False])
def test_greedy_verifier_continuations_while_the_drafter_samples(cache):
    """verifier_temperature=0: the verifier's training continuations are its greedy rollouts (whatever the
    generator), the drafter's on-policy rollouts and the validation continuations still sample at
    ``temperature``."""
    from train.decoding.sampling import SamplingParams
    from train.training.rollout import rollout

    module, data = _module(_cfg(data_source="mixed_verifier", verifier_temperature=0.0, cache_answers=cache))
    assert module.cfg.verifier_rollout_temperature == 0.0 and module.sampler.params.temperature == 1.0
    data.setup()
    batch = next(iter(data.train_dataloader()))
    ids, attn = batch["input_ids"], batch["attention_mask"]
    greedy = rollout(
        module.verifier,
        ids,
        attn,
        module.cfg.max_new_tokens,
        SamplingParams(temperature=0.0),
        eos_token_id=module.sampler.eos_token_id,
        pad_token_id=module.sampler.pad_token_id,
        vocab_size=module.sampler.vocab_size,
    )
    for seed in (0, 7):
        got = module.make_batch(batch, "verifier", module._generator(seed, 0))
        assert torch.equal(got.sequences, greedy.sequences)
    drawn = [module.make_batch(batch, "drafter", module._generator(s, 0)).sequences for s in (1, 2)]
    assert not torch.equal(drawn[0], drawn[1])  # the drafter still samples
    assert _cfg().verifier_rollout_temperature == 1.0  # null: the rollout temperature


def test_validation_measures_greedy_agreement_on_greedy_verifier_continuations():
    """val/greedy_agreement: 1 for a drafter equal to the verifier; for another drafter, the share of the
    verifier's greedy continuation tokens that are also the drafter's argmax there (teacher-forced)."""
    import copy

    module, data = _module(_cfg())
    data.setup()
    batch = next(iter(data.val_dataloader()))
    module.on_validation_epoch_start()
    module.validation_step(batch, 0)
    greedy = module._val_greedy_cache[0]
    mask = greedy.continuation_mask[:, greedy.prompt_width :]
    with torch.no_grad():
        drafter_argmax = module.logits(module.drafter, greedy)[..., : module.sampler.vocab_size].argmax(-1)
    verifier_tokens = greedy.sequences[:, greedy.prompt_width :]
    expected = (drafter_argmax == verifier_tokens)[mask].float().mean()
    sums = module._val_sums
    assert sums["greedy_agreement"] / sums["greedy_tokens"] == pytest.approx(float(expected))
    assert sums["greedy_tokens"] == int(mask.sum()) > 0

    twin = DistillSpecModule(copy.deepcopy(module.verifier), module.verifier, module.tokenizer, module.cfg)
    twin.on_validation_epoch_start()
    twin.validation_step(batch, 0)
    assert twin._val_sums["greedy_agreement"] == pytest.approx(twin._val_sums["greedy_tokens"])
    assert twin._val_sums["acceptance"] == pytest.approx(twin._val_sums["tokens"], rel=1e-4)


def test_mixture_draws_on_policy_batches_with_probability_lambda():
    module, _ = _module(_cfg(data_source="mixed_fixed", lmbda=0.25))
    picks = [module.pick_source(s) for s in range(2000)]
    assert set(picks) == {"drafter", "fixed"}
    assert abs(picks.count("drafter") / 2000 - 0.25) < 0.04
    assert picks == [module.pick_source(s) for s in range(2000)]  # reproducible on resume


def _trainer(tmp_path: Path, max_steps: int, callbacks_extra: list[L.Callback] = (), **kw) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=-1, every_n_train_steps=1
    )
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ckpt, NonFiniteLossGuard(), *callbacks_extra],
        default_root_dir=tmp_path,
        **kw,
    )


def test_fit_logs_validation_and_checkpoint_has_no_verifier(tmp_path):
    module, data = _module(_cfg(data_source="mixed_verifier", lmbda=0.5))
    trainer = _trainer(tmp_path, 4)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    for key in (
        "val/expected_acceptance",
        "val/simulated_block_efficiency",
        "val/loss",
        "val/greedy_agreement",
        "train/loss",
        "train/expected_acceptance",
        "train/on_policy_fraction",
    ):
        assert key in metrics, key
    assert 0.0 <= float(metrics["val/expected_acceptance"]) <= 1.0
    assert 0.0 <= float(metrics["val/greedy_agreement"]) <= 1.0
    assert 1.0 <= float(metrics["val/simulated_block_efficiency"]) <= 5.0
    assert len(module._val_cache) == len(module._val_greedy_cache) == 1  # generated once, reused
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all(k.startswith("drafter.") for k in state)
    assert sum(v.numel() for v in state.values()) == sum(
        p.numel() for p in module.drafter.state_dict().values()
    )


def test_validating_first_records_the_starting_drafter_and_the_report_compares_it(tmp_path):
    """What the train command does with ``validate_before``: ``trainer.validate`` at step 0, then ``fit``
    (its state from inference mode does not reach training); every validation is recorded, the verifier's
    continuations are generated once, and the report's table compares step 0 with the last step."""
    module, data = _module(_cfg(data_source="mixed_verifier", lmbda=0.5, validate_before=True))
    assert module.validate_before_fit
    trainer = _trainer(tmp_path, 4)
    trainer.validate(module, datamodule=data, verbose=False)
    start = dict(module.validation_history[0])
    trainer.fit(module, datamodule=data)
    assert [e["step"] for e in module.validation_history] == [0, 2, 4]
    assert len(module._val_cache) == len(module._val_greedy_cache) == 1  # generated once, reused
    last = module.validation_history[-1]
    assert float(trainer.callback_metrics["val/expected_acceptance"]) == pytest.approx(
        last["expected_acceptance"]
    )
    assert last["loss"] != start["loss"]  # the drafter moved between the two
    (table,) = module.report_sections()
    assert "| metric | step 0 | step 4 | ratio |" in table
    ratio = last["expected_acceptance"] / start["expected_acceptance"]
    assert (
        f"| {start['expected_acceptance']:.4f} | {last['expected_acceptance']:.4f} | {ratio:.3f} |" in table
    )
    assert module.report_summary()["validation"] == module.validation_history
    plain, _ = _module(_cfg())  # without validate_before: no table (a single validation has no "before")
    plain.validation_history = [start]
    assert not plain.validate_before_fit and plain.report_sections() == []


def test_resume_continues_global_step(tmp_path):
    module, data = _module(_cfg(data_source="drafter"))
    _trainer(tmp_path, 3).fit(module, datamodule=data)
    last = tmp_path / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 3
    module2, data2 = _module(_cfg(data_source="drafter"))
    trainer = _trainer(tmp_path / "resumed", 5)
    trainer.fit(module2, datamodule=data2, ckpt_path=str(last))
    assert trainer.global_step == 5
    w = "drafter.model.embed_tokens.weight"
    assert not torch.equal(module2.drafter.state_dict()[w[len("drafter.") :]], saved["state_dict"][w])


def test_a_checkpoint_in_the_old_layout_resumes_into_the_renamed_module(tmp_path):
    """Before issue 53 the module held the drafter as ``student`` (weights ``student.*``) and saved the
    verifier's answers as ``teacher_cache``: such a checkpoint (a fresh one renamed back) loads strictly
    and resumes, with the answers it carried."""
    module, data = _module(_cfg(data_source="verifier"))
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert "verifier_answers" in saved and "teacher_cache" not in saved
    old = dict(saved)
    old["state_dict"] = {"student." + k.removeprefix("drafter."): v for k, v in saved["state_dict"].items()}
    old["teacher_cache"] = old.pop("verifier_answers")
    torch.save(old, tmp_path / "old.ckpt")

    fresh, _ = _module(_cfg(data_source="verifier"))
    checkpoint = torch.load(tmp_path / "old.ckpt", weights_only=False)
    fresh.on_load_checkpoint(checkpoint)  # what Lightning calls before it loads the weights
    fresh.load_state_dict(checkpoint["state_dict"])  # strict: every old key found its new name
    for name, value in module.drafter.state_dict().items():
        assert torch.equal(fresh.drafter.state_dict()[name], value), name
    assert set(fresh.answers.answers) == set(saved["verifier_answers"]["prompts"])

    resumed, data2 = _module(_cfg(data_source="verifier"))
    trainer = _trainer(tmp_path / "resumed", 3)
    trainer.fit(resumed, datamodule=data2, ckpt_path=str(tmp_path / "old.ckpt"))
    assert trainer.global_step == 3
    assert set(resumed.answers.answers) >= set(saved["verifier_answers"]["prompts"])


def test_old_config_keys_and_source_names_still_build_with_a_deprecation_line(tmp_path, monkeypatch):
    """Settings renamed by issue 53 (train.config.RENAMED_KEYS / RENAMED_VALUES) keep working: a config,
    or an override the command line check turns into an addition, builds the new settings and says
    which old key or value is now which."""
    from train.cli.console import check_overrides

    old = ["method.cache_teacher=true", "method.teacher_temperature=0", "method.teacher_cache_mb=64"]
    argv = ["experiment=distillspec_tiny", *old, "method.data_source=mixed_teacher"]
    argv = check_overrides(str(CONF_DIR), "train", argv)
    assert argv == [
        "experiment=distillspec_tiny",
        *("+" + o for o in old),
        "method.data_source=mixed_teacher",
    ]
    with pytest.warns(DeprecationWarning) as caught:
        spec = load_spec(_compose([*argv, "+method.teacher_answers=pair"], tmp_path))
    m = spec.method
    assert (m.cache_answers, m.verifier_temperature, m.verifier_cache_mb, m.answers) == (True, 0, 64, "pair")
    assert m.data_source == "mixed_verifier" and m.off_policy_source == "verifier"
    said = "\n".join(str(w.message) for w in caught)
    for line in (
        "method.cache_teacher is deprecated; it is now method.cache_answers",
        "method.teacher_temperature is deprecated; it is now method.verifier_temperature (its value 0 "
        "replaces method.verifier_temperature=None)",
        "method.teacher_cache_mb is deprecated; it is now method.verifier_cache_mb",
        "method.teacher_answers is deprecated; it is now method.answers",
        "method.data_source=mixed_teacher is deprecated; it is now method.data_source=mixed_verifier",
    ):
        assert line in said, said


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    module, data = _module(_cfg(data_source="fixed"))
    original = module.distill_loss

    def poisoned(ro):
        loss, s, t, m = original(ro)
        return (loss * float("nan") if module.global_step == 3 else loss), s, t, m

    monkeypatch.setattr(module, "distill_loss", poisoned)
    trainer = _trainer(tmp_path, 10)
    with pytest.raises(NonFiniteLossError, match=r"global step 3.*last good checkpoint: .*ckpt"):
        trainer.fit(module, datamodule=data)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_lora_trains_adapters_only_and_merges_into_a_plain_model():
    module, data = _module(_cfg(data_source="fixed", lora={"enabled": True, "r": 4, "alpha": 8}))
    trainable = [n for n, p in module.drafter.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    merged = module.distilled_drafter()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora_" in k for k in merged.state_dict())


def test_exported_drafter_works_as_hf_assistant_model(tmp_path):
    module, data = _module(_cfg(data_source="fixed"))
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    out = module.export(str(tmp_path / "drafter"))
    assert (out / "README.md").exists() and (out / "config.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    drafter = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    verifier = module.verifier
    ids = torch.tensor([tok.encode(TEXT)[:10]])
    plain = verifier.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assisted = verifier.generate(
        ids, max_new_tokens=8, do_sample=False, assistant_model=drafter, pad_token_id=tok.pad_token_id
    )
    assert torch.equal(plain, assisted)


# ------------------------------------------------------------------------------------------ end to end


def _micro_main_job(tmp_path: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``python train.py experiment=distillspec_tiny`` with a micro tiny-pair recipe (built on first use
    into ``tmp_path``), 6 steps, validated before training and every 3 steps; the finished process."""
    micro = "hidden_size={h},num_layers=1,num_heads=2,intermediate_size=32,max_steps=2"
    cmd = [
        sys.executable,
        "train.py",
        "experiment=distillspec_tiny",
        f"paths.tiny_dir={tmp_path / 'tiny'}",
        "model.tiny.vocab_size=300",
        "model.tiny.seq_len=64",
        "model.tiny.val_blocks=2",
        *(
            f"model.tiny.{role}.{kv}"
            for role, h in (("verifier", 16), ("drafter", 8))
            for kv in micro.format(h=h).split(",")
        ),
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "method.validate_before=true",
        "method.num_prompts=64",
        "eval.num_prompts=2",
        "eval.max_new_tokens=16",
        "eval.gammas=[1,2]",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
        "~callbacks.progress_bar",
        *extra,
    ]
    return subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DRAFTSMITH_ROOT": str(tmp_path)},
    )


@pytest.mark.slow
def test_main_job_end_to_end_builds_a_micro_pair_on_first_use(tmp_path):
    """``experiment=distillspec_tiny`` through the real entry point with a micro tiny-pair recipe (built on
    first use into tmp_path) and fewer steps: the whole flow in well under a minute."""
    run_dir = tmp_path / "run"
    proc = _micro_main_job(tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["reference"] == "before" and len(report["decoders"]) == 2
    for side in ("before", "after"):
        for per_t in report["drafters"][side].values():
            assert set(per_t) == {"0", "1"} and per_t["0"]["block_efficiency"]["mean"] >= 1.0
        assert set(report["best"][side]) == {"0", "1"}
    assert set(report["ratios"]["after"][report["decoders"][0]]) == {"0", "1"}
    assert (run_dir / "report.md").exists() and (run_dir / "drafter" / "config.json").exists()
    assert [e["step"] for e in report["method"]["validation"]] == [0, 3, 6]  # validated before training
    assert "## Validation before and after training" in (run_dir / "report.md").read_text()
    assert "| after |" in (run_dir / "drafter" / "README.md").read_text()
    assert str(run_dir) in proc.stdout
    out = proc.stdout + proc.stderr  # short: the plan, progress bars, the summary, where things are
    for noise in (
        "INFO",
        "wandb:",
        "Epoch ",
        "v_num",
        "Loading weights",
        "Writing model",
        "Tip:",
        "Traceback",
    ):
        assert noise not in out, (noise, out[-3000:])
    assert "Full report (every decoder, metric legend)" in proc.stdout
    assert json.loads((tmp_path / "tiny" / "manifest.json").read_text())["parameters"]["verifier"] > 0


class _SigtermAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("stop_at", [3, 6])  # 4 batches per epoch: mid-epoch 1 and mid-epoch 2
def test_interrupted_and_resumed_run_ends_with_the_same_weights(tmp_path, stop_at):
    """SIGTERM mid-epoch, then resume from the checkpoint GracefulStop wrote: data order (the shuffling
    generator across epochs), the verifier's answers (cached in the checkpoint), on-policy draws and
    the optimizer all continue where they stopped, so the weights equal an uninterrupted run's."""
    cfg = dict(data_source="mixed_verifier", lmbda=0.5, num_prompts=16, batch_size=4)
    module, data = _module(_cfg(**cfg))
    _trainer(tmp_path / "straight", 8).fit(module, datamodule=data)
    straight = module.drafter.state_dict()

    module1, data1 = _module(_cfg(**cfg))
    stop = GracefulStop(str(tmp_path / "cut"))
    trainer = _trainer(tmp_path / "cut", 8, callbacks_extra=[stop, _SigtermAtStep(stop_at)])
    with pytest.raises(SIGTERMException):
        trainer.fit(module1, datamodule=data1)
    assert stop.checkpoint and torch.load(stop.checkpoint, weights_only=False)["global_step"] == stop_at

    module2, data2 = _module(_cfg(**cfg))
    resumed = _trainer(tmp_path / "resumed", 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader is not resumable.*")
        resumed.fit(module2, datamodule=data2, ckpt_path=stop.checkpoint)
    assert resumed.global_step == 8
    after = module2.drafter.state_dict()
    for name, value in straight.items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=name)


class SigtermAtValidationEnd(L.Callback):
    """Test helper: the process sends itself SIGTERM at the end of the step-0 validation (after its last
    batch, where Lightning's evaluation loop no longer raises on the signal)."""

    def on_validation_epoch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 0 and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_during_the_validation_before_training_stops_the_run(tmp_path):
    """A SIGTERM that arrives while the starting drafter is validated (``validate_before``) stops the run
    there: no step is trained, nothing is saved or evaluated, exit 143 with the message that says so."""
    run_dir = tmp_path / "run"
    proc = _micro_main_job(
        tmp_path, run_dir, "+callbacks.sigterm._target_=tests.methods.test_distillspec.SigtermAtValidationEnd"
    )
    assert proc.returncode == 143, (proc.stdout + proc.stderr)[-3000:]
    assert "SIGTERM at global step 0: nothing trained yet, nothing saved" in proc.stdout
    assert not (run_dir / "report.json").exists() and not (run_dir / "drafter").exists()
    assert not list(run_dir.rglob("*.ckpt"))
