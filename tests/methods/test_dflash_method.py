"""method=dflash: config validation at start-up, the block loss (one forward of many blocks is each block
alone; it learns), the module's fit, validation figures and non-finite guard, the export in both layouts
(reloaded bit for bit; the speculators layout vLLM reads), the finish report, and the recipes' configs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import make_tokenizer
from train.config import ConfigError
from train.export.dflash_speculators import load_dflash_speculators
from train.export.hub import verify_kind
from train.export.kinds import export_kind
from train.methods.dflash.build import dflash_drafter
from train.methods.dflash.config import DFlashConfig
from train.methods.dflash.module import DFlashModule
from train.models.dflash_drafter import DFlashDrafter, block_inputs
from train.models.dflash_loss import block_loss, block_mask, sample_anchors, slot_weights
from train.models.eagle3_ttt import verifier_targets
from train.report import Finishable, RunContext, finish
from train.training.answer_data import AnswerDataModule

from .test_eagle3_method import ADAMW, AUX, PAD, _generated, _trainer, _validator, _verifier

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def _cfg(**kw) -> DFlashConfig:
    base = dict(
        optimizer=ADAMW,
        block_size=BLOCK,
        num_layers=2,
        num_anchors=8,
        max_len=32,
        batch_size=4,
        draft_vocab_size=None,
        aux_layers=AUX,
        num_prompts=4,
        num_val_prompts=4,
    )
    base.update(kw)
    return DFlashConfig(**base)


def _build(dtype: torch.dtype = torch.float32, **kw) -> tuple[DFlashModule, AnswerDataModule]:
    cfg = _cfg(**kw)
    verifier, tok = _verifier(dtype), make_tokenizer()
    answers = _generated(verifier)
    split = {"train": answers, "validation": answers}  # overfit: validate on what it trains on
    drafter = dflash_drafter(cfg, verifier, tok, split["train"])
    return DFlashModule(verifier, drafter, cfg, tok), AnswerDataModule(
        split, PAD, cfg.batch_size, cfg.max_len, seed=0
    )


def _logits(drafter: DFlashDrafter, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dtype = drafter.fc.weight.dtype
    context = torch.randn(1, 6, drafter.hidden_size, generator=gen).to(dtype)
    with torch.no_grad():
        kv = drafter.context_kv(context, torch.arange(6)[None])
        block = block_inputs(torch.tensor([5]), drafter.block_size, drafter.mask_token_id)
        return drafter(block, torch.arange(6, 6 + drafter.block_size)[None], kv)


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"block_size": 1}, "method.block_size"),
        ({"num_layers": 0}, "method.num_layers"),
        ({"num_anchors": 0}, "method.num_anchors"),
        ({"slot_decay": 0.0}, "method.slot_decay"),
        ({"markov_rank": -1}, "method.markov_rank"),
        ({"markov_rank": 2.5}, "method.markov_rank"),
        ({"max_len": 4}, "method.max_len"),
        ({"feature_cache_dir": "x"}, "method.feature_cache_dir"),
        ({"answer_engine": "spark"}, "method.answer_engine"),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        _cfg(**override)


def test_layers_the_verifier_lacks_and_a_mask_outside_the_vocabulary_are_refused():
    verifier = _verifier()
    with pytest.raises(ConfigError, match="method.aux_layers"):
        dflash_drafter(_cfg(aux_layers=[0, 5]), verifier, make_tokenizer(), [])
    with pytest.raises(ConfigError, match="method.mask_token_id"):
        dflash_drafter(_cfg(mask_token_id=10**6), verifier, make_tokenizer(), [])


def test_the_mask_token_is_no_special_token():
    module, _ = _build()
    assert module.drafter.mask_token_id not in {PAD, 257, *module.tokenizer.all_special_ids}


# ------------------------------------------------------------------------------------------ the loss


def test_slot_weights_skip_the_anchor_and_decay():
    w = slot_weights(5, 2.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[2:], torch.exp(-torch.arange(1, 4) / 2.0))


def test_anchors_have_context_and_a_target_and_are_distinct():
    loss_mask = torch.zeros(3, 12, dtype=torch.long)
    loss_mask[:, 5:] = 1
    attention = torch.ones_like(loss_mask)
    attention[2, 8:] = 0
    anchors, valid = sample_anchors(loss_mask, attention, 6, torch.Generator().manual_seed(0))
    for row in range(3):
        kept = anchors[row][valid[row]].tolist()
        assert kept == sorted(set(kept)) and all(a >= 4 for a in kept)  # next token inside the mask
        assert all(attention[row, a + 1] for a in kept)
    assert int(valid[2].sum()) == 3  # positions 4, 5, 6 only: the rest pad, never scored


def test_one_forward_of_many_blocks_is_each_block_alone():
    """The block mask gives every block exactly what decoding gives it: the context before its anchor
    and its own slots."""
    verifier = _verifier()
    drafter = DFlashDrafter.from_verifier(verifier, num_layers=2, block_size=BLOCK, aux_layers=AUX)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    states = verifier(ids, output_hidden_states=True).hidden_states
    context = drafter.fuse(drafter.aux_features(states))
    anchors, valid = torch.tensor([[3, 7, 11]]), torch.ones(1, 3, dtype=torch.bool)
    kv = drafter.context_kv(context, torch.arange(16)[None])
    block_ids = block_inputs(ids.gather(1, anchors), BLOCK, drafter.mask_token_id).reshape(1, -1)
    positions = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    mask = block_mask(anchors, valid, torch.ones_like(ids), BLOCK)
    together = drafter(block_ids, positions, kv, attention_mask=mask).view(3, BLOCK, -1)
    for i, a in enumerate(anchors[0].tolist()):
        alone_kv = drafter.context_kv(context[:, :a], torch.arange(a)[None])
        alone = drafter(
            block_ids[:, i * BLOCK : (i + 1) * BLOCK], positions[:, i * BLOCK : (i + 1) * BLOCK], alone_kv
        )
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)
    broken = mask.clone()
    broken[..., 3 + 1] = True  # every block sees position 4: the first block reads its own future
    leaked = drafter(block_ids, positions, kv, attention_mask=broken).view(3, BLOCK, -1)
    assert not torch.allclose(leaked[0], together[0], atol=1e-4)


def test_the_block_loss_learns_the_verifiers_continuations():
    """A few hundred steps on one batch of the verifier's answers: the loss falls and slot 1 hits."""
    torch.manual_seed(0)
    verifier = _verifier()
    answers = _generated(verifier)
    data = AnswerDataModule({"train": answers, "validation": answers}, PAD, 4, 32, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    drafter = DFlashDrafter.from_verifier(verifier, num_layers=1, block_size=BLOCK, aux_layers=AUX)
    with torch.no_grad():
        out = verifier(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    aux = torch.cat(drafter.aux_features(out.hidden_states), -1)
    targets = verifier_targets(out.logits, drafter.draft_ids, drafter.t2d)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for step in range(120):
        result = block_loss(drafter, aux, batch, targets, 16, 4.0, torch.Generator().manual_seed(step))
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        losses.append(float(result.loss))
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    assert float(result.accuracies[0]) > 0.8


# ------------------------------------------------------------------------------------------ module


def test_fit_validate_and_the_nonfinite_guard(tmp_path):
    module, data = _build()
    initial = module.drafter.fc.weight.detach().clone()
    _trainer(tmp_path, 3).fit(module, datamodule=data)
    assert not torch.equal(module.drafter.fc.weight, initial)
    _validator(tmp_path).validate(module, datamodule=data, verbose=False)
    metrics = module.last_validation
    assert set(metrics) >= {"val/loss", "val/acc_1", f"val/acc_{BLOCK - 1}", "val/simulated_block_efficiency"}
    assert 1.0 <= metrics["val/simulated_block_efficiency"] <= BLOCK
    with torch.no_grad():
        module.drafter.fc.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=re.escape("method.optimizer.lr")):
        _trainer(tmp_path, 1).fit(module, datamodule=data)


# ------------------------------------------------------------------------------------------ finish step


def test_export_writes_both_layouts_with_the_trained_weights(tmp_path):
    module, data = _build(torch.bfloat16, draft_vocab_size=64)
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    out = module.export(str(tmp_path / "run" / "dflash"))
    trained = module.trained_drafter()
    assert trained.fc.weight.dtype == torch.bfloat16 and not trained.training
    expected = _logits(trained)
    reloaded = DFlashDrafter.from_pretrained(out).to(torch.bfloat16).eval()
    assert reloaded.aux_layers == AUX and reloaded.block_size == BLOCK and reloaded.draft_vocab_size == 64
    assert reloaded.mask_token_id == trained.mask_token_id
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=0)
    assert export_kind(out) == "dflash"

    speculators = tmp_path / "run" / "dflash_speculators"
    assert export_kind(speculators) == "dflash_speculators"
    config = json.loads((speculators / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["aux_hidden_state_layer_ids"] == AUX and config["mask_token_id"] == trained.mask_token_id
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert config["target_hidden_size"] == layer["hidden_size"] and config["draft_vocab_size"] == 64
    from safetensors.torch import load_file

    names = set(load_file(str(speculators / "model.safetensors")))
    want = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "embed_tokens.weight"}
    for i in range(2):
        want |= {
            f"layers.{i}.self_attn.{n}.weight"
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        want |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        want |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    assert want <= names and not any(n.startswith("model.") for n in names)
    readme = (speculators / "README.md").read_text()
    assert '"method": "dflash"' in readme and f'"num_speculative_tokens": {BLOCK - 1}' in readme
    loaded = load_dflash_speculators(speculators).to(torch.bfloat16).eval()
    torch.testing.assert_close(_logits(loaded), expected, rtol=0, atol=0)
    verify_kind(out, "dflash")
    verify_kind(speculators, "dflash_speculators")


def test_a_full_vocabulary_export_carries_no_vocabulary_maps(tmp_path):
    module, _ = _build()
    module.export(str(tmp_path / "dflash"))
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "dflash_speculators" / "model.safetensors")))
    assert "d2t" not in names and "t2d" not in names  # vLLM allocates no d2t for a full vocabulary
    load_dflash_speculators(tmp_path / "dflash_speculators")


def test_finish_without_evaluation_exports_and_reports_the_validation(tmp_path):
    module, data = _build()
    assert isinstance(module, Finishable)
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    _validator(tmp_path).validate(module, datamodule=data, verbose=False)
    report = finish(module, module.verifier, module.tokenizer, RunContext(tmp_path / "run", name="unit"))
    assert report["drafter_dir"] == str(tmp_path / "run" / "dflash")
    summary = report["method"]
    assert summary["method"] == "dflash" and summary["block_size"] == BLOCK and summary["aux_layers"] == AUX
    text = (tmp_path / "run" / "report.md").read_text()
    assert "## DFlash drafter (last validation)" in text and "| 3 | anchor + 3 |" in text


def test_slot_k_is_scored_against_the_verifiers_row_for_anchor_plus_k(monkeypatch):
    """A drafter that returns, at position p, the verifier's own log-probabilities of row p - 1 (its
    prediction for position p) scores loss 0 and accuracy 1 at every slot; the same drafter one row off
    does not (the loss reads the rows where it should)."""
    verifier = _verifier()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    attention, loss_mask = torch.ones_like(ids), torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    drafter = DFlashDrafter.from_verifier(verifier, num_layers=1, block_size=BLOCK, aux_layers=AUX)
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
    aux = torch.cat(drafter.aux_features(out.hidden_states), -1)
    targets = verifier_targets(out.logits, drafter.draft_ids, drafter.t2d)
    for shift, perfect in ((1, True), (0, False)):

        def oracle(self, block_ids, positions, context, attention_mask=None, shift=shift):
            rows = (positions - shift).clamp(0, ids.shape[1] - 1)
            return targets.logprobs.gather(1, rows[..., None].expand(-1, -1, targets.logprobs.shape[-1]))

        monkeypatch.setattr(DFlashDrafter, "forward", oracle)
        rows = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
        result = block_loss(drafter, aux, rows, targets, 8, 4.0)
        accuracies = [float(a) for a in result.accuracies]
        if perfect:
            assert float(result.loss) < 1e-5 and accuracies == [1.0] * (BLOCK - 1)
        else:
            assert float(result.loss) > 0.1 and max(accuracies) < 1.0


def test_the_markov_head_reads_the_rows_token_before_each_slot(monkeypatch):
    """DSpark's teacher forcing: slot k of the block at anchor a is biased by the row's own token at
    a + k - 1 (the anchor itself for slot 1), and the bias reaches the loss; a fresh head adds nothing."""
    verifier = _verifier()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    attention, loss_mask = torch.ones_like(ids), torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    rows = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    drafter = DFlashDrafter.from_verifier(verifier, num_layers=1, block_size=BLOCK, aux_layers=AUX)
    dspark = DFlashDrafter.from_verifier(
        verifier, num_layers=1, block_size=BLOCK, aux_layers=AUX, markov_rank=4
    )
    dspark.load_state_dict(drafter.state_dict(), strict=False)
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
    aux = torch.cat(drafter.aux_features(out.hidden_states), -1)
    targets = verifier_targets(out.logits, drafter.draft_ids, drafter.t2d)
    plain = block_loss(drafter, aux, rows, targets, 8, 4.0, torch.Generator().manual_seed(0))
    fresh = block_loss(dspark, aux, rows, targets, 8, 4.0, torch.Generator().manual_seed(0))
    assert float(fresh.loss) == pytest.approx(float(plain.loss), rel=1e-6)  # markov_w2 starts at zero
    seen: list[torch.Tensor] = []
    bias = dspark.markov_bias

    def recording(previous):
        seen.append(previous.clone())
        return bias(previous)

    monkeypatch.setattr(dspark, "markov_bias", recording)
    with torch.no_grad():
        dspark.markov_head.markov_w2.weight.normal_(generator=torch.Generator().manual_seed(2))
    biased = block_loss(dspark, aux, rows, targets, 8, 4.0, torch.Generator().manual_seed(0))
    anchors, valid = sample_anchors(loss_mask, attention, 8, torch.Generator().manual_seed(0))
    (previous,) = seen
    for b in range(2):
        for i in range(anchors.shape[1]):
            if valid[b, i]:
                a = int(anchors[b, i])
                want = [int(ids[b, min(a + k - 1, 19)]) for k in range(1, BLOCK)]
                assert previous[b, i].tolist() == want, (b, a)
    assert abs(float(biased.loss) - float(plain.loss)) > 1e-3


def test_a_dspark_drafter_exports_to_speculators_dspark_layout(tmp_path):
    """With a Markov head the speculators folder is the ``dspark`` model type vLLM's ``dspark`` method
    loads (``markov_rank``, the head under ``markov_head.markov_w1`` / ``markov_w2``), both folders reload
    bit for bit, and serving names the ``dspark`` method."""
    from safetensors.torch import load_file

    from train.serving.exports import served_export

    module, data = _build(draft_vocab_size=64, markov_rank=4)
    _trainer(tmp_path, 2).fit(module, datamodule=data)
    assert module.drafter.markov_head is not None
    assert float(module.drafter.markov_head.markov_w2.weight.abs().sum()) > 0  # it trained
    out = module.export(str(tmp_path / "run" / "dflash"))
    trained = module.trained_drafter()
    reloaded = DFlashDrafter.from_pretrained(out).eval()
    assert reloaded.markov_rank == 4
    previous = torch.tensor([3, 7, 11])
    torch.testing.assert_close(reloaded.markov_bias(previous), trained.markov_bias(previous), rtol=0, atol=0)
    speculators = tmp_path / "run" / "dflash_speculators"
    config = json.loads((speculators / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert config["speculators_config"]["algorithm"] == "dspark" and config["markov_rank"] == 4
    assert config["markov_head_type"] == "vanilla" and config["enable_confidence_head"] is False
    tensors = load_file(str(speculators / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (trained.vocab_size, 4)
    assert tensors["markov_head.markov_w2.weight"].shape == (64, 4)
    loaded = load_dflash_speculators(speculators).eval()
    torch.testing.assert_close(loaded.markov_bias(previous), trained.markov_bias(previous), rtol=0, atol=0)
    assert export_kind(speculators) == "dflash_speculators"
    assert served_export(speculators).method == "dspark"
    assert '"method": "dspark"' in (speculators / "README.md").read_text()
    verify_kind(speculators, "dflash_speculators")


def test_the_finish_step_measures_an_eagle3_drafter_beside_dflash(tmp_path):
    """``compare_eagle3`` names an EAGLE-3 drafter folder; it joins the drafters the evaluator measures.
    A bad path fails at start-up, naming the key."""
    from tests.methods.test_eagle3_method import _cfg as eagle3_cfg
    from train.methods.dflash.build import eagle3_to_compare
    from train.methods.eagle3.build import eagle3_drafter

    module, _ = _build()
    eagle3 = eagle3_drafter(eagle3_cfg(), module.verifier, module.tokenizer, [])
    eagle3.save_pretrained(tmp_path / "eagle3")
    cfg = _cfg(compare_eagle3=str(tmp_path / "eagle3"))

    class Spec:
        class paths:
            checkpoints_dir = str(tmp_path)

        class model:
            verifier = "unused"

    class Pair:
        verifier = module.verifier

    module = DFlashModule(module.verifier, module.drafter, cfg, eagle3=eagle3_to_compare(cfg, Pair, Spec))
    assert list(module.drafters_to_evaluate()) == ["dflash", "eagle3"]
    assert not any(name.startswith("eagle3") for name, _ in module.named_parameters())  # not a child
    assert eagle3_to_compare(_cfg(compare_eagle3="auto"), Pair, Spec) is None  # no EAGLE-3 run there
    with pytest.raises(ConfigError, match="method.compare_eagle3"):
        _cfg(compare_eagle3=str(tmp_path / "missing"))
