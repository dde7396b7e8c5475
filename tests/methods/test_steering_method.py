"""SD^2 training (train/methods/steering/module.py): config validation, the arms and their independence, stale
guides, zero-init equality of the steered and distilled arms, checkpoints (no verifier, answers kept),
resume, export (steering/ + drafter/ loading with standard tools), the steered drafter in the evaluator,
and the whole run through the real entry point (slow) and under CPU DDP (slow)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf, open_dict
from transformers import AutoModelForCausalLM

from tests.conftest import CONF_DIR, REPO_ROOT, make_tokenizer, tiny_llama
from train.cli.train_command import load_spec
from train.config import ConfigError
from train.data.datamodule import PromptDataModule
from train.decoding import AutoregressiveDecoder, SamplingParams, SpeculativeDecoder
from train.evaluation import build_eval_config
from train.evaluation.decoder_build import build_decoders
from train.methods.steering.build import steering_for
from train.methods.steering.config import DISTILLED_ARM, MAIN_ARM, SteeringConfig
from train.methods.steering.module import SteeringTrainingModule
from train.models.steering_module import SteeredDrafter, SteeringModule
from train.rundir import newest_artifact, newest_artifact_of

pytestmark = pytest.mark.usefixtures("one_thread")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
TEXT = "def add(a, b):\n    return a + b  # sum of two numbers\n"


def _cfg(**kw) -> SteeringConfig:
    base = dict(
        optimizer=ADAMW,
        max_new_tokens=6,
        prompt_len=8,
        batch_size=4,
        num_prompts=8,
        num_val_prompts=4,
        gamma=3,
    )
    base.update(kw)
    return SteeringConfig(**base)


def _splits() -> dict[str, Dataset]:
    docs = [f"{TEXT * 2} # doc {i} " + "x" * (i % 7) for i in range(24)]
    return {
        "train": Dataset.from_dict({"text": docs[:16]}),
        "validation": Dataset.from_dict({"text": docs[16:]}),
    }


def _module(cfg: SteeringConfig, extra_arm: bool = False) -> tuple[SteeringTrainingModule, PromptDataModule]:
    tok = make_tokenizer()
    verifier, drafter = tiny_llama(hidden=64, seed=0), tiny_llama(hidden=32, seed=1)
    arms: dict = {}
    if cfg.distilled_baseline:
        arms[DISTILLED_ARM] = (tiny_llama(hidden=32, seed=1), None)
    arms[MAIN_ARM] = (drafter, steering_for(cfg, verifier, drafter))
    if extra_arm:
        other = tiny_llama(hidden=32, seed=2)
        arms["distillspec_steered"] = (other, steering_for(cfg, verifier, other))
    data = PromptDataModule(
        _splits(),
        tok,
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
    )
    references = {"pretrained": lambda: tiny_llama(hidden=32, seed=1)}
    return SteeringTrainingModule(verifier, arms, tok, cfg, seed=0, references=references), data


def _trainer(tmp_path: Path, max_steps: int, clip: float = 1.0, **kw) -> L.Trainer:
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=1
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
        gradient_clip_val=clip,
        callbacks=[ckpt],
        default_root_dir=tmp_path,
        **kw,
    )


def _batch(module: SteeringTrainingModule, data: PromptDataModule) -> dict[str, torch.Tensor]:
    data.setup("fit")
    return next(iter(data.train_dataloader()))


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"divergence": "kl"}, "method.divergence must be one of"),
        ({"gamma": 0}, "method.gamma must be >= 1"),
        ({"temperature": 0.0}, "method.temperature must be > 0"),
        ({"layers": []}, "method.layers"),
        ({"train_drafter": False, "lora": {"enabled": True}}, "method.lora.enabled must be false"),
        ({"drafter": "./no/such/drafter"}, "method.drafter: no model folder"),
        ({"distillspec_drafter": "./no/such/drafter"}, "method.distillspec_drafter: no model folder"),
    ],
)
def test_bad_config_fails_naming_the_key(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(**kw)


def _compose(overrides: list[str], tmp_path: Path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.run_dir = str(tmp_path / "run")
        del cfg["hydra"]
    return cfg


def test_experiment_composes_with_three_seeds_at_both_temperatures(tmp_path):
    spec = load_spec(_compose(["experiment=steering_tiny"], tmp_path))
    assert spec.name == "steering_tiny" and isinstance(spec.method, SteeringConfig)
    assert spec.method.distillspec_drafter == "auto" and spec.method.distilled_baseline
    assert spec.eval.temperatures == [0.0, 1.0] and len(spec.eval.seeds) >= 3
    with pytest.raises(ConfigError, match=re.escape("method.gamma")):
        load_spec(_compose(["experiment=steering_tiny", "method.gamma=0"], tmp_path))


def test_the_real_pair_experiment_reads_layers_scaled_to_its_verifier(tmp_path):
    """``experiment=steering`` runs on the real pair, whole chat prompts, both temperatures."""
    spec = load_spec(_compose(["experiment=steering"], tmp_path))
    assert spec.name == "steering" and spec.model.name == "smollm2" and spec.model.smollm2 is not None
    assert spec.method.prompt_len >= 256 and spec.eval.temperatures == [0.0, 1.0]
    assert spec.method.distillspec_drafter == "auto"


def test_newest_distillspec_drafter_of_the_same_verifier(tmp_path):
    for run, verifier in (("2026-01-01_00-00-00", "/v"), ("2026-01-02_00-00-00", "/v"), ("2026-01-03", "/w")):
        folder = tmp_path / "distillspec" / run
        (folder / "drafter").mkdir(parents=True)
        (folder / "drafter" / "config.json").write_text("{}")
        OmegaConf.save(OmegaConf.create({"model": {"verifier": verifier}}), folder / "config.yaml")
    assert newest_artifact(str(tmp_path), "distillspec", "/v", "drafter") == str(
        tmp_path / "distillspec" / "2026-01-02_00-00-00" / "drafter"
    )
    assert newest_artifact(str(tmp_path), "distillspec", "/other", "drafter") is None
    # a recipe, then its tiny twin: the first experiment that has a run of this verifier wins
    twin = tmp_path / "distillspec_tiny" / "2026-02-01_00-00-00"
    (twin / "drafter").mkdir(parents=True)
    (twin / "drafter" / "config.json").write_text("{}")
    OmegaConf.save(OmegaConf.create({"model": {"verifier": "/w"}}), twin / "config.yaml")
    both = ("distillspec", "distillspec_tiny")
    assert newest_artifact_of(str(tmp_path), both, "/v", "drafter").endswith("2026-01-02_00-00-00/drafter")
    assert newest_artifact_of(str(tmp_path), both[::-1], "/w", "drafter") == str(twin / "drafter")
    assert newest_artifact_of(str(tmp_path), both, "/other", "drafter") is None


# ------------------------------------------------------------------------------------------ module


def test_at_zero_initialisation_the_steered_arm_equals_the_distilled_arm():
    module, data = _module(_cfg())
    batch = _batch(module, data)
    ro = module.answers(batch["input_ids"], batch["attention_mask"], module._generator(0))
    _, states = module.verifier_view(ro)
    with torch.no_grad():
        plain = module.arm_logits(DISTILLED_ARM, ro, states, 2)
        steered = module.arm_logits(MAIN_ARM, ro, states, 2)
        torch.testing.assert_close(steered, plain, rtol=0, atol=0)
        module.steering_of(MAIN_ARM).project.weight.normal_(0, 0.1)
        moved = module.arm_logits(MAIN_ARM, ro, states, 2)
    assert not torch.allclose(moved, plain)
    # the hooks were removed after the forward: the drafter is plain again
    torch.testing.assert_close(module.arm_logits(DISTILLED_ARM, ro, states, 2), plain, rtol=0, atol=0)


def test_the_first_block_is_unsteered_and_later_blocks_one_to_offset_stale():
    """Offset o simulates verifications committing o tokens each (decoding's guide positions): the first
    o answer tokens are drafted before any verification, unsteered, as in decoding; then guides are
    1..o positions stale."""
    module, data = _module(_cfg())
    batch = _batch(module, data)
    ro = module.answers(batch["input_ids"], batch["attention_mask"], module._generator(0))
    _, states = module.verifier_view(ro)
    with torch.no_grad():
        module.steering_of(MAIN_ARM).project.weight.normal_(0, 0.5)
        by_offset = {o: module.arm_logits(MAIN_ARM, ro, states, o) for o in (1, 2, 3)}
        plain = module.arm_logits(DISTILLED_ARM, ro, states, 1)
    assert not torch.allclose(by_offset[1], by_offset[3])
    for o, logits in by_offset.items():
        torch.testing.assert_close(logits[:, :o], plain[:, :o], rtol=0, atol=0)
        assert not torch.allclose(logits[:, o], plain[:, o]), o
    assert module.staleness(ro, 2).tolist() == [0, 0, 1, 2, 1, 2][: ro.sequences.shape[1] - ro.prompt_width]


def test_offsets_cover_one_to_gamma_and_are_reproducible():
    module, _ = _module(_cfg(gamma=4))
    offsets = [module.offset_for(s) for s in range(400)]
    assert set(offsets) == {1, 2, 3, 4} and min(offsets.count(o) for o in range(1, 5)) > 60
    assert offsets == [module.offset_for(s) for s in range(400)]


def test_training_step_trains_every_arm_and_the_steering_module():
    module, data = _module(_cfg(), extra_arm=True)
    batch = _batch(module, data)
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss)
    loss.backward()
    for label in (MAIN_ARM, "distillspec_steered"):
        grad = module.steering_of(label).project.weight.grad
        assert grad is not None and grad.abs().sum() > 0, label  # zero-initialised, yet it learns
    for label, drafter in module.drafters.items():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters()), label
    assert len(module.answers) == batch["input_ids"].shape[0]
    assert all(p.grad is None for p in module.verifier.parameters())


def test_each_rank_samples_its_own_verifier_answers(monkeypatch):
    """Under DDP the ranks hold different prompts and, for a prompt, differently seeded answers: the
    answer generator is salted with the rank (one run, two ranks, the same batch)."""
    seen = []
    for rank in (0, 1):
        module, data = _module(_cfg())
        monkeypatch.setattr(type(module), "global_rank", property(lambda self, r=rank: r))
        cache = module.answers

        def recorded(*args, cache=cache):
            rollout = cache(*args)
            seen.append(rollout.sequences)
            return rollout

        monkeypatch.setattr(module, "answers", recorded)
        module.training_step(_batch(module, data), 0)
    assert seen[0].shape[0] == seen[1].shape[0] and not torch.equal(seen[0], seen[1])


def test_train_drafter_false_trains_the_steering_module_alone(tmp_path):
    """No drafter parameter trains (the unsteered baseline arm would be the untouched drafter: it is left
    out), and ratios are taken against the untouched drafter (``pretrained``)."""
    module, data = _module(_cfg(train_drafter=False))  # distilled_baseline on, as by default
    assert not any(p.requires_grad for p in module.drafters.parameters())
    before = {k: v.clone() for k, v in module.drafters.state_dict().items()}
    _trainer(tmp_path, 3).fit(module, datamodule=data)
    after = module.drafters.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert module.steering_of(MAIN_ARM).project.weight.abs().sum() > 0
    assert DISTILLED_ARM not in module.drafters
    assert module.reference_drafter == "pretrained"
    evaluated = module.drafters_to_evaluate()
    assert set(evaluated) == {"pretrained", MAIN_ARM}
    untouched = tiny_llama(hidden=32, seed=1).state_dict()
    assert all(torch.equal(v, untouched[k]) for k, v in evaluated["pretrained"].state_dict().items())


def test_arms_do_not_interact(tmp_path):
    """The distilled arm trained beside a steered one ends exactly where it ends trained alone: shared
    batches and verifier, separate parameters, per-arm gradient clipping (tight enough to bite)."""
    both, data = _module(_cfg())
    _trainer(tmp_path / "both", 3, clip=0.01).fit(both, datamodule=data)
    alone, data2 = _module(_cfg())
    del alone.drafters[MAIN_ARM]  # keep the baseline arm only (the steering module stays, unused)
    alone.steering[MAIN_ARM].requires_grad_(False)
    _trainer(tmp_path / "alone", 3, clip=0.01).fit(alone, datamodule=data2)
    a, b = both.drafters[DISTILLED_ARM].state_dict(), alone.drafters[DISTILLED_ARM].state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_fit_validates_checkpoints_without_the_verifier_and_resumes(tmp_path):
    module, data = _module(_cfg())
    trainer = _trainer(tmp_path, 4)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    for key in (
        "val/expected_acceptance",
        "val/simulated_block_efficiency",
        "val/loss",
        f"val/{DISTILLED_ARM}/expected_acceptance",
        f"val/{DISTILLED_ARM}/simulated_block_efficiency",
        "train/loss",
        "train/expected_acceptance",
        "train/guide_offset",
    ):
        assert key in metrics, key
    assert 0.0 <= float(metrics["val/expected_acceptance"]) <= 1.0
    assert 1.0 <= float(metrics["val/simulated_block_efficiency"]) <= 4.0
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(k.startswith(("drafters.", "steering.")) for k in saved["state_dict"])
    assert len(saved["verifier_answers"]["prompts"]) == len(module.answers) > 0

    resumed, data2 = _module(_cfg())
    trainer2 = _trainer(tmp_path / "resumed", 6)
    trainer2.fit(resumed, datamodule=data2, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert trainer2.global_step == 6
    assert set(resumed.answers.answers) >= set(saved["verifier_answers"]["prompts"])


def test_a_checkpoint_written_before_the_renaming_still_gives_its_answers():
    """Checkpoints before issue 53 kept the answers as ``verifier_responses``: they are read from there
    (and a checkpoint with both reads the new entry)."""
    module, data = _module(_cfg())
    module.training_step(_batch(module, data), 0)
    state = module.answers.state()
    assert state["prompts"]
    for checkpoint in ({"verifier_responses": state}, {"verifier_answers": state, "verifier_responses": {}}):
        resumed, _ = _module(_cfg())
        resumed.on_load_checkpoint(checkpoint)
        assert set(resumed.answers.answers) == set(state["prompts"])


def test_export_loads_with_standard_tools_and_decodes_losslessly(tmp_path):
    module, data = _module(_cfg(), extra_arm=True)
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    with torch.no_grad():
        module.steering_of(MAIN_ARM).project.weight.normal_(0, 0.5)  # a visibly nonzero module
    out = module.export(str(tmp_path / "run" / "steering"))
    steering = SteeringModule.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["verifier_layers"] == module.layers and config["drafter_layers"] == 2
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "drafter")
    assert (tmp_path / "run" / "distilled_drafter" / "config.json").is_file()
    assert (tmp_path / "run" / "distillspec_steered" / "steering" / "config.json").is_file()
    ids = torch.tensor([[256, 5, 9, 3, 7, 11, 2]])
    with torch.no_grad():
        torch.testing.assert_close(drafter(ids).logits, module.drafters[MAIN_ARM](ids).logits)
        torch.testing.assert_close(steering.project.weight, module.steering_of(MAIN_ARM).project.weight)
    verifier = module.verifier
    steered = SteeredDrafter(drafter, steering)
    decoder = SpeculativeDecoder(verifier, steered, gamma=3)
    assert decoder.steering is steering and decoder.drafter is drafter
    greedy = AutoregressiveDecoder(verifier).generate(ids, 20, SamplingParams()).tokens
    assert torch.equal(decoder.generate(ids, 20, SamplingParams()).tokens, greedy)


def test_evaluator_measures_a_steered_drafter_under_sd_but_not_under_trees():
    verifier, drafter = tiny_llama(hidden=64, seed=0), tiny_llama(hidden=32, seed=1)
    steered = SteeredDrafter(drafter, SteeringModule.for_pair(verifier, drafter))
    cfg = build_eval_config({"decoders": ["sd", "specinfer"], "gammas": [2]})
    decoders = build_decoders(verifier, steered, cfg)
    assert list(decoders) == ["sd@g2"] and decoders["sd@g2"].steering is steered.steering
    assert set(build_decoders(verifier, drafter, cfg)) == {"sd@g2", "specinfer"}
    with pytest.raises(ValueError, match="carries its own steering module"):
        SpeculativeDecoder(verifier, steered, steering=steered.steering)


# ------------------------------------------------------------------------------------------ end to end


def _micro_run(tmp_path: Path, extra: list[str], name: str) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / name
    micro = "hidden_size={h},num_layers=2,num_heads=2,intermediate_size=32,max_steps=2"
    cmd = [
        sys.executable,
        "train.py",
        "experiment=steering_tiny",
        f"paths.tiny_dir={tmp_path / 'tiny'}",
        "model.tiny.vocab_size=300",
        "model.tiny.seq_len=64",
        "model.tiny.val_blocks=2",
        *(
            f"model.tiny.{role}.{kv}"
            for role, h in (("verifier", 16), ("drafter", 8))
            for kv in micro.format(h=h).split(",")
        ),
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "method.num_prompts=32",
        "method.num_val_prompts=4",
        "method.batch_size=4",
        "eval.num_prompts=2",
        "eval.max_new_tokens=12",
        "eval.seeds=[0]",
        "eval.plots=false",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
        "~callbacks.progress_bar",
        *extra,
    ]
    env = {**os.environ, "DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    return proc, run_dir


@pytest.mark.slow
def test_main_job_end_to_end_with_the_distillspec_row(tmp_path):
    """``experiment=steering_tiny`` through the real entry point on a micro pair, with a fake earlier
    DistillSpec run of the same verifier for ``distillspec_drafter=auto``: every row is reported."""
    proc, run_dir = _micro_run(tmp_path, [], "first")  # no DistillSpec run yet: that arm is skipped
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["drafters"]) == {"pretrained", DISTILLED_ARM, MAIN_ARM}
    # a DistillSpec run of this verifier: its exported drafter is picked up by distillspec_drafter=auto
    fake = tmp_path / "checkpoints" / "distillspec_tiny" / "2026-01-01_00-00-00"  # the tiny twin
    fake.mkdir(parents=True)
    (fake / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    import shutil

    shutil.copytree(run_dir / "distilled_drafter", fake / "drafter")
    proc, run_dir = _micro_run(tmp_path, [], "second")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["reference"] == DISTILLED_ARM
    assert set(report["drafters"]) == {
        "pretrained",
        DISTILLED_ARM,
        MAIN_ARM,
        "distillspec",
        "distillspec_steered",
    }
    for name, per_decoder in report["drafters"].items():
        for per_t in per_decoder.values():
            assert set(per_t) == {"0", "1"} and per_t["0"]["block_efficiency"]["mean"] >= 1.0, name
    assert set(report["ratios"][MAIN_ARM]["sd"]) == {"0", "1"}
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert all(r["greedy_match"] for r in results["runs"] if r["temperature"] == 0.0)
    assert (run_dir / "steering" / "config.json").is_file() and (
        run_dir / "drafter" / "config.json"
    ).is_file()
    assert "## Arms (last validation)" in (run_dir / "report.md").read_text()
    # method.train_drafter=false: no drafter trains, so no distilled arm; ratios to the untouched drafter
    proc, run_dir = _micro_run(tmp_path, ["method.train_drafter=false"], "frozen")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["reference"] == "pretrained"
    assert set(report["drafters"]) == {"pretrained", MAIN_ARM, "distillspec", "distillspec_steered"}


@pytest.mark.slow
def test_cpu_ddp_two_processes(tmp_path):
    proc, run_dir = _micro_run(
        tmp_path,
        [
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.enable_progress_bar=false",
            "method.distillspec_drafter=null",
        ],
        "ddp",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["method"]["method"] == "sd2-steering"
    assert report["drafters"][MAIN_ARM]["sd"]["0"]["block_efficiency"]["mean"] >= 1.0
    assert len(list(tmp_path.rglob("steering/config.json"))) == 1  # rank 1 exported nothing
