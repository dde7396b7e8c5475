"""method=eagle3: config validation, the drafter's draft vocabulary counted on the training answers, a
float32 drafter beside a frozen bfloat16 verifier that is no part of the module, a micro fit (loss falls,
per-step metrics logged, validation's chain statistics), the finish step's two export layouts reloading to
the trained drafter's logits, and the non-finite loss guard."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.conftest import make_tokenizer, tiny_llama
from tests.models.speculators_reference import load_speculators
from train.config import ConfigError
from train.export.model_card import write_model_card
from train.methods.eagle3.build import eagle3_drafter
from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.models.answers import Answer, generate_answers
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.eagle3_ttt import chain_counts
from train.report import Finishable, RunContext, finish
from train.training.answer_data import AnswerDataModule

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
AUX = [0, 1, 1]  # tiny_llama has 2 layers: EAGLE-3's default [2, L//2, L-3] would be out of range
EOS, PAD = 257, 258
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> Eagle3Config:
    base = dict(
        optimizer=ADAMW,
        ttt_steps=STEPS,
        max_len=32,
        batch_size=4,
        draft_vocab_size=None,
        aux_layers=AUX,
        num_prompts=4,
        num_val_prompts=4,
    )
    base.update(kw)
    return Eagle3Config(**base)


def _verifier(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """tiny_llama(hidden=64, seed=0) with its head scaled up: peaked distributions, so the greedy
    answers and the drafter's targets are clear-cut (a random head is near uniform)."""
    verifier = tiny_llama(hidden=64, seed=0)
    assert verifier.config.num_hidden_layers == 2 and max(AUX) < 2
    with torch.no_grad():
        verifier.lm_head.weight.mul_(20.0)
    return verifier.to(dtype)


def _answer(prompt: list[int], answer: list[int]) -> Answer:
    return Answer(
        prompt=prompt,
        answer=answer,
        top_ids=torch.zeros(len(answer), 1, dtype=torch.int32),
        top_logprobs=torch.zeros(len(answer), 1, dtype=torch.float16),
    )


def _generated(verifier: torch.nn.Module, n: int = 4, seed: int = 0) -> list[Answer]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (6,), generator=gen).tolist() for _ in range(n)]
    return generate_answers(verifier, prompts, [EOS], max_new_tokens=10, batch_size=n, top_logprobs=2)


def _build(
    dtype: torch.dtype = torch.float32, comparison: torch.nn.Module | None = None, **kw
) -> tuple[Eagle3Module, AnswerDataModule]:
    cfg = _cfg(**kw)
    verifier, tok = _verifier(dtype), make_tokenizer()
    answers = _generated(verifier)
    assert sum(len(a.answer) for a in answers) > 4 * 3  # the verifier says something
    split = {"train": answers, "validation": answers}  # overfit: validate on what it trains on
    drafter = eagle3_drafter(cfg, verifier, tok, split["train"])
    module = Eagle3Module(verifier, drafter, cfg, tok, comparison=comparison)
    return module, AnswerDataModule(split, PAD, cfg.batch_size, cfg.max_len, seed=0)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _trainer(tmp_path, max_steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
    )


def _validator(tmp_path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def _inputs(drafter: Eagle3Drafter, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 7), generator=gen)
    features = torch.randn(2, 7, drafter.hidden_size, generator=gen)
    return ids, features, torch.arange(7).expand(2, 7)


def _logits(drafter: Eagle3Drafter, seed: int = 0) -> torch.Tensor:
    ids, features, pos = _inputs(drafter, seed)
    dtype = drafter.fc.weight.dtype
    with torch.no_grad():
        return drafter(ids, features.to(dtype), pos).logits


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(ttt_steps=0), "method.ttt_steps"),
        (dict(ttt_steps=5, max_len=7), "method.max_len"),
        (dict(max_len=STEPS + 2), "method.max_len"),
        (dict(decay=0.0), "method.decay"),
        (dict(decay=1.5), "method.decay"),
        (dict(decay=-0.5), "method.decay"),
        (dict(decay="0.8"), "method.decay"),
        (dict(draft_vocab_size=0), "method.draft_vocab_size"),
        (dict(aux_layers=[]), "method.aux_layers"),
        (dict(aux_layers=[-1, 0, 1]), "method.aux_layers"),
        (dict(aux_layers=[1, 2]), "method.aux_layers"),  # vLLM's EAGLE-3 fuses three: refused before training
        (dict(vllm_export="yes"), "method.vllm_export"),
        (dict(batch_size=0), "method.batch_size"),
        (dict(speculative_tokens=0), "method.speculative_tokens"),
        (dict(optimizer=functools.partial(torch.optim.AdamW, lr=-1.0)), "method.optimizer.lr"),
    ],
)
def test_bad_config_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        _cfg(**kw)


def test_good_edges_of_the_config_pass():
    _cfg(max_len=STEPS + 3, decay=1.0, draft_vocab_size=1)
    assert _cfg().draft_vocab_size is None


# ------------------------------------------------------------------------------------------ drafter


def test_draft_vocab_is_the_most_frequent_answer_tokens_and_eos():
    verifier, tok = _verifier(), make_tokenizer()
    # answer counts: 5 x4, 7 x3, 9 x2, 11 x1, eos x2; the prompts' token 3 (x12) must not count
    train = [_answer([3] * 6, [5, 5, 5, 7, 7, 9, EOS]), _answer([3] * 6, [5, 7, 9, 11, EOS])]
    drafter = eagle3_drafter(_cfg(draft_vocab_size=4), verifier, tok, train)
    assert drafter.draft_vocab_size == 4 and drafter.aux_layers == AUX
    assert drafter.draft_ids.tolist() == [5, 7, 9, EOS]
    assert drafter.t2d.nonzero().flatten().tolist() == [5, 7, 9, EOS] and drafter.t2d.numel() == 260
    assert (drafter.d2t == torch.tensor([5, 7, 9, EOS]) - torch.arange(4)).all()  # index i -> i + d2t[i]
    torch.testing.assert_close(drafter.lm_head.weight, verifier.lm_head.weight[[5, 7, 9, EOS]])
    torch.testing.assert_close(drafter.embed_tokens.weight, verifier.get_input_embeddings().weight)
    # eos is kept even when it is not among the most frequent: 2 slots -> 5 and eos, not 7
    assert eagle3_drafter(_cfg(draft_vocab_size=2), verifier, tok, train).draft_ids.tolist() == [5, EOS]
    # None, or a size >= the vocabulary: every id
    for size in (None, 260, 300):
        full = eagle3_drafter(_cfg(draft_vocab_size=size), verifier, tok, train)
        assert full.draft_vocab_size == 260 and bool(full.t2d.all())


def test_drafter_trains_in_float32_beside_a_frozen_bfloat16_verifier_outside_the_module():
    module, _ = _build(torch.bfloat16)
    verifier = module.verifier
    assert next(verifier.parameters()).dtype == torch.bfloat16
    assert module.export_dtype == torch.bfloat16
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert {p.dtype for p in module.drafter.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in verifier.parameters())
    verifier_ids = {id(p) for p in verifier.parameters()}
    assert verifier_ids and not verifier_ids & {id(p) for p in module.parameters()}
    assert all(k.startswith("drafter.") for k in module.state_dict())
    assert "verifier" not in dict(module.named_children())
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(module.drafter.embed_tokens.weight) not in optimized  # the verifier's, frozen
    assert id(module.drafter.fc.weight) in optimized and not verifier_ids & optimized


# ------------------------------------------------------------------------------------------ training


def test_micro_fit_lowers_the_loss_and_validation_logs_chain_statistics(tmp_path):
    module, data = _build()
    before = {k: v.clone() for k, v in module.verifier.state_dict().items()}
    assert len(data.rows["train"]) == 4  # one batch, the same every epoch
    record = _Losses()
    trainer = _trainer(tmp_path, 30, [record])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 30 and len(record.losses) == 30
    losses = record.losses
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.25 * losses[0], losses
    assert sum(losses[-5:]) < sum(losses[:5])
    metrics = trainer.callback_metrics
    for k in range(STEPS):
        assert 0.0 <= float(metrics[f"train/acc_{k}"]) <= 1.0
        assert torch.isfinite(metrics[f"train/loss_{k}"])
    assert float(metrics["train/loss"]) == pytest.approx(losses[-1], rel=1e-5)
    # the verifier is untouched
    assert all(torch.equal(before[k], v) for k, v in module.verifier.state_dict().items())

    assert module.last_validation == {}
    (logged,) = _validator(tmp_path).validate(module, datamodule=data, verbose=False)
    for k in range(STEPS):
        assert 0.0 <= logged[f"val/acc_{k}"] <= 1.0 and 0.0 <= logged[f"val/cond_acc_{k}"] <= 1.0
    tau = logged["val/simulated_block_efficiency"]
    assert 1.0 <= tau <= 1.0 + STEPS
    # full vocabulary: every eligible position is kept, so step 0's plain and conditional accuracy agree
    assert logged["val/acc_0"] == pytest.approx(logged["val/cond_acc_0"])
    assert logged["val/acc_0"] > 0.5  # it learnt the answers it validates on
    assert set(module.last_validation) == set(logged)
    assert all(module.last_validation[k] == pytest.approx(v) for k, v in logged.items())
    # the logged chain statistics are those of chain_counts over the validation batches
    run = starts = 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            result = module.ttt(batch)
            counts = chain_counts(result.hits, result.eligible)
            run, starts = run + int(counts["run"]), starts + int(counts["starts"])
    assert starts > 0 and tau == pytest.approx(1 + run / starts)
    assert tau > 1.0  # some chain is accepted


def test_a_non_finite_loss_names_the_learning_rate(tmp_path):
    module, data = _build()
    with torch.no_grad():
        module.drafter.fc.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=re.escape("method.optimizer.lr")):
        _trainer(tmp_path, 1).fit(module, datamodule=data)


# ------------------------------------------------------------------------------------------ finish step


def test_export_writes_both_layouts_with_the_trained_weights(tmp_path):
    module, data = _build(torch.bfloat16, draft_vocab_size=64)
    initial = module.drafter.fc.weight.detach().clone()
    _trainer(tmp_path, 3).fit(module, datamodule=data)
    assert not torch.equal(module.drafter.fc.weight, initial)  # it trained
    out = module.export(str(tmp_path / "run" / "eagle3"))
    assert out == tmp_path / "run" / "eagle3"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    trained = module.trained_drafter()
    assert trained.fc.weight.dtype == torch.bfloat16 and not trained.training
    assert trained.fc.weight.device.type == "cpu"
    torch.testing.assert_close(trained.fc.weight, module.drafter.fc.weight.to(torch.bfloat16), rtol=0, atol=0)
    expected = _logits(trained)

    reloaded = Eagle3Drafter.from_pretrained(out).to(torch.bfloat16).eval()
    assert reloaded.aux_layers == AUX and reloaded.draft_vocab_size == 64
    assert torch.equal(reloaded.d2t, trained.d2t) and torch.equal(reloaded.t2d, trained.t2d)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=0)

    speculators = tmp_path / "run" / "eagle3_speculators"
    config = json.loads((speculators / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["dtype"] == "bfloat16"
    readme = (speculators / "README.md").read_text()
    assert "vllm serve ./eagle3_speculators" in readme and '"num_speculative_tokens": 3' in readme
    assert readme.startswith("---\nlicense: apache-2.0\n") and "AutoModelForCausalLM" not in readme
    loaded = load_speculators(speculators).to(torch.bfloat16).eval()
    torch.testing.assert_close(_logits(loaded), expected, rtol=0, atol=0)


def test_drafters_to_evaluate_hold_eagle3_and_the_pair_drafter_when_given():
    module, _ = _build(torch.bfloat16)
    drafters = module.drafters_to_evaluate()
    assert list(drafters) == ["eagle3"]
    assert isinstance(drafters["eagle3"], Eagle3Drafter)
    assert drafters["eagle3"].fc.weight.dtype == torch.bfloat16 and not drafters["eagle3"].training
    assert drafters["eagle3"] is not module.drafter  # a copy: evaluation cannot touch the trained weights
    assert module.drafter.fc.weight.dtype == torch.float32
    pair_drafter = tiny_llama(hidden=32, seed=1)
    module, _ = _build(comparison=pair_drafter)
    drafters = module.drafters_to_evaluate()
    assert list(drafters) == ["eagle3", "pair drafter"] and drafters["pair drafter"] is pair_drafter
    assert not any(p is q for p in module.parameters() for q in pair_drafter.parameters())
    assert module.reference_drafter is None and module.artifact_dir == "eagle3"


def test_finish_without_evaluation_exports_and_reports_the_validation(tmp_path):
    module, data = _build()
    assert isinstance(module, Finishable)
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    _validator(tmp_path).validate(module, datamodule=data, verbose=False)
    report = finish(module, module.verifier, module.tokenizer, RunContext(tmp_path / "run", name="unit"))
    assert report["drafter_dir"] == str(tmp_path / "run" / "eagle3")
    assert (tmp_path / "run" / "eagle3_speculators" / "model.safetensors").is_file()
    summary = report["method"]
    assert summary["method"] == "eagle3" and summary["ttt_steps"] == STEPS and summary["aux_layers"] == AUX
    assert summary["answers"] == "generated"
    assert set(summary["validation"]) == set(module.last_validation)
    text = (tmp_path / "run" / "report.md").read_text()
    assert "## EAGLE-3 drafter (last validation)" in text
    assert "| 2 | t+4 |" in text  # one row per step


def test_the_speculators_export_names_a_local_verifier_without_this_machines_path(tmp_path):
    """A verifier loaded from a local folder under the project is named relative to it in config.json
    and the README (no absolute path of this machine leaves it); a Hub id is kept as it is."""
    from train.paths import project_root

    module, _ = _build(torch.float32)
    local = str(Path(project_root()) / "checkpoints" / "smollm2" / "verifier")
    for source, expected in ((local, "checkpoints/smollm2/verifier"), ("org/verifier", "org/verifier")):
        module.verifier.config._name_or_path = source
        module.export(str(tmp_path / expected.replace("/", "_") / "eagle3"))
        folder = tmp_path / expected.replace("/", "_") / "eagle3_speculators"
        config = json.loads((folder / "config.json").read_text())
        assert config["speculators_config"]["verifier"]["name_or_path"] == expected
        readme = (folder / "README.md").read_text()
        assert f"vllm serve {expected} " in readme and str(project_root()) not in readme


def test_a_drafter_vllm_cannot_load_exports_eagle3_only_and_says_why(tmp_path, caplog):
    """Two aux layers need ``vllm_export: false`` (refused at start-up otherwise, above): ``eagle3/`` is
    exported (and its card says there is no vLLM copy), the speculators folder is not; a drafter that
    reaches the export with two layers anyway gets a warning naming ``method.aux_layers``."""
    module, _ = _build(torch.float32, aux_layers=[0, 1], vllm_export=False)
    with caplog.at_level("INFO"):
        out = module.export(str(tmp_path / "run" / "eagle3"))
    assert (out / "model.safetensors").is_file() and not (tmp_path / "run" / "eagle3_speculators").exists()
    assert "method.vllm_export=false" in caplog.text
    module.cfg.vllm_export = True
    with caplog.at_level("WARNING"):
        module.export(str(tmp_path / "run2" / "eagle3"))
    assert not (tmp_path / "run2" / "eagle3_speculators").exists()
    assert "No eagle3_speculators/ export" in caplog.text and "method.aux_layers" in caplog.text
    write_model_card(out)
    assert "it has no copy in the speculators format" in (out / "README.md").read_text()
