"""Medusa heads over a draft vocabulary (each head projects onto a few frequent ids) and Medusa trained on
the verifier's own answers: the heads' logits, the loss and metrics over draft rows, vLLM's truncated
vocabulary layout, the config's build and a micro fit (exact decoding with such heads:
tests/decoding/test_heads_decoding.py)."""

from __future__ import annotations

import functools
import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.conftest import make_tokenizer, tiny_llama
from tests.methods.vllm_medusa_reference import load_vllm_medusa
from train.config import ConfigError
from train.export.medusa_layout import export_vllm_medusa
from train.export.medusa_layout import load_vllm_medusa as train_load_vllm_medusa
from train.methods.medusa.build import build_heads, initial_heads
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.module import head_metrics, unpack
from train.methods.registry import build_method
from train.models.answers import Answer, save_answers
from train.models.heads import MedusaHeads, medusa_loss
from train.training.answer_data import AnswerDataModule
from train.training.answer_sources import pair_answers_folder

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
pytestmark = pytest.mark.usefixtures("one_thread")
DRAFT = [0, 2, 3, 5, 8, 9]


def _heads(vocab: int = 11, draft: list[int] | None = DRAFT, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden_size=6, vocab_size=vocab, num_heads=3, num_layers=1, draft_vocab=draft)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    return heads


# ---------------------------------------------------------------------------------------------- the heads


def test_forward_scatters_the_draft_rows_and_is_minus_inf_elsewhere():
    heads = _heads()
    hidden = torch.randn(2, 4, 6)
    draft = heads.draft_logits(hidden)
    full = heads(hidden)
    assert draft.shape == (3, 2, 4, len(DRAFT)) and full.shape == (3, 2, 4, 11)
    torch.testing.assert_close(full[..., DRAFT], draft)
    outside = [i for i in range(11) if i not in DRAFT]
    assert torch.isneginf(full[..., outside]).all()
    assert heads(hidden, num_heads=2).shape[0] == 2


def test_from_verifier_copies_the_draft_ids_rows_of_the_lm_head():
    verifier = tiny_llama(hidden=16, seed=0)
    ids = [1, 4, 7, 20]
    heads = MedusaHeads.from_verifier(verifier, 2, 1, draft_vocab=ids)
    weight = verifier.get_output_embeddings().weight
    for head in heads.lm_heads:
        torch.testing.assert_close(head.weight, weight[ids])
    # a fresh head (identity block) predicts what the verifier's head predicts, over the draft ids
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(heads(hidden)[0][:, ids], hidden @ weight[ids].T)


@pytest.mark.parametrize("draft", [[3, 2], [1, 1, 2], [-1, 2], [2, 11], []])
def test_a_bad_draft_vocabulary_is_refused(draft):
    with pytest.raises(ValueError, match="draft_vocab"):
        MedusaHeads(hidden_size=6, vocab_size=11, num_heads=2, draft_vocab=draft)


def test_both_layouts_keep_the_draft_vocabulary(tmp_path):
    heads = _heads()
    heads.save_pretrained(tmp_path / "heads")
    export_vllm_medusa(heads, tmp_path / "heads_vllm")
    hidden = torch.randn(2, 3, 6)
    expected = heads(hidden)
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert loaded.draft_vocab == DRAFT
    torch.testing.assert_close(loaded(hidden), expected)
    config = json.loads((tmp_path / "heads_vllm" / "config.json").read_text())
    assert (
        config["vocab_size"] == 11 and config["draft_vocab"] == DRAFT and "truncated_vocab_size" not in config
    )
    assert train_load_vllm_medusa(tmp_path / "heads_vllm").draft_vocab == DRAFT
    torch.testing.assert_close(train_load_vllm_medusa(tmp_path / "heads_vllm")(hidden), expected)
    # what vLLM computes from the folder: full-vocabulary rows, and each head's argmax is a draft token,
    # the same one the heads propose here
    vllm = load_vllm_medusa(tmp_path / "heads_vllm")
    assert torch.equal(vllm.propose(hidden), expected.argmax(dim=-1).movedim(0, -1))
    torch.testing.assert_close(vllm(hidden)[..., DRAFT], expected[..., DRAFT])
    # the full-vocabulary heads: no draft vocabulary anywhere
    full = _heads(draft=None)
    export_vllm_medusa(full, tmp_path / "full_vllm")
    assert "draft_vocab" not in json.loads((tmp_path / "full_vllm" / "config.json").read_text())
    assert train_load_vllm_medusa(tmp_path / "full_vllm").draft_vocab is None


def test_vllms_argmax_over_the_exported_rows_stays_in_the_draft_vocabulary(tmp_path):
    """The rows outside the draft vocabulary are the draft rows' mean: their logit is the draft logits'
    mean, never above the maximum, whatever the hidden state (here 2,000 random ones, large and small)."""
    heads = _heads()
    export_vllm_medusa(heads, tmp_path / "heads_vllm")
    vllm = load_vllm_medusa(tmp_path / "heads_vllm")
    hidden = torch.randn(2000, 6) * torch.logspace(-3, 3, 2000).unsqueeze(1)
    proposed = vllm.propose(hidden)
    assert torch.isin(proposed, torch.tensor(DRAFT)).all()
    assert torch.equal(proposed, heads(hidden).argmax(dim=-1).movedim(0, -1))


# ------------------------------------------------------------------------------------- loss and metrics


def test_hard_loss_over_draft_rows_skips_targets_outside_the_draft_vocabulary():
    ids = torch.tensor([[0, 2, 3, 4, 5, 8, 9, 2]])  # 4 is outside DRAFT
    logits = torch.randn(2, 1, 8, len(DRAFT))
    draft = torch.tensor(DRAFT)
    total, per_head = medusa_loss(logits, ids, decay=0.5, draft_ids=draft)
    row = {v: i for i, v in enumerate(DRAFT)}
    expected = []
    for k in range(2):
        terms = [
            -logits[k, 0, t].log_softmax(-1)[row[int(ids[0, t + k + 2])]]
            for t in range(8 - k - 2)
            if int(ids[0, t + k + 2]) in row
        ]
        expected.append(torch.stack(terms).mean())
    torch.testing.assert_close(per_head[0], expected[0])
    torch.testing.assert_close(per_head[1], expected[1])
    torch.testing.assert_close(total, expected[0] + 0.5 * expected[1])


def test_soft_loss_renormalises_the_teacher_over_the_draft_ids():
    ids = torch.tensor([[0, 2, 3, 4, 5, 8]])
    logits = torch.randn(1, 1, 6, len(DRAFT))
    verifier_logits = torch.randn(1, 6, 11)
    _, (loss,) = medusa_loss(logits, ids, verifier_logits=verifier_logits, draft_ids=torch.tensor(DRAFT))
    log_q = logits[0, 0, :4].log_softmax(-1)
    log_p = verifier_logits[0, 1:5][:, DRAFT].log_softmax(-1)  # row t + 1 predicts token t + 2
    expected = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)


def test_target_mask_leaves_the_prompts_tokens_out():
    ids = torch.tensor([[0, 2, 3, 5, 8, 9, 2, 3]])
    target = torch.tensor([[False] * 5 + [True] * 3])  # the answer: the last three tokens
    logits = torch.randn(1, 1, 8, len(DRAFT))
    _, (masked,) = medusa_loss(logits, ids, draft_ids=torch.tensor(DRAFT), target_mask=target)
    changed = logits.clone()
    changed[0, 0, :3] = torch.randn(3, len(DRAFT))  # rows whose targets (t + 2 < 5) are prompt tokens
    _, (again,) = medusa_loss(changed, ids, draft_ids=torch.tensor(DRAFT), target_mask=target)
    torch.testing.assert_close(masked, again)
    row = {v: i for i, v in enumerate(DRAFT)}
    expected = torch.stack(
        [-logits[0, 0, t].log_softmax(-1)[row[int(ids[0, t + 2])]] for t in (3, 4, 5)]
    ).mean()
    torch.testing.assert_close(masked, expected)


def test_head_metrics_read_draft_rows_as_verifier_ids_and_count_targets_only():
    ids = torch.tensor([[0, 2, 3, 5, 8, 9]])
    verifier = torch.full((1, 6, 11), -5.0)
    for t in range(5):
        verifier[0, t, ids[0, t + 1]] = 5.0
    heads = torch.full((1, 1, 6, len(DRAFT)), -5.0)
    row = {v: i for i, v in enumerate(DRAFT)}
    for t in range(4):
        heads[0, 0, t, row[int(ids[0, t + 2])]] = 5.0  # rank 0 right, as a draft row
    draft = torch.tensor(DRAFT)
    m = head_metrics(heads, verifier, ids, k_top=3, draft_ids=draft)
    assert int(m["top1_0"]) == int(m["agree_0"]) == int(m["rank_0_0"]) == int(m["n_0"]) == 4
    target = torch.tensor([[False, False, False, True, True, True]])
    m = head_metrics(heads, verifier, ids, k_top=3, draft_ids=draft, target_mask=target)
    assert int(m["n_0"]) == int(m["top1_0"]) == 3  # targets 3, 4, 5: rows 1, 2, 3
    # usable starts: rows 2 and 3 (their next tokens, 3 and 4, are targets); head 0 right at both
    assert int(m["positions"]) == 2 and int(m["run"]) == 2


def test_unpack_turns_the_loss_rows_into_target_tokens():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
        "loss_mask": torch.tensor([[False, True, True, False, False]]),  # rows 1, 2 predict tokens 2, 3
    }
    ids, mask, target = unpack(batch)
    assert target.tolist() == [[False, False, True, True, False]] and mask is batch["attention_mask"]
    assert unpack({"input_ids": ids})[1:] == (None, None)


# ------------------------------------------------------------------------------- answers: config and fit


def _answers(tokenizer, n: int, seed: int) -> list[Answer]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 40, (6,), generator=g).tolist()
        answer = (torch.arange(8) % 5 + 10).tolist() + [tokenizer.eos_token_id]
        out.append(
            Answer(prompt, answer, torch.zeros(len(answer), 1, dtype=torch.long), torch.zeros(len(answer), 1))
        )
    return out


class _Pair:
    def __init__(self) -> None:
        self.tokenizer = make_tokenizer()
        self.verifier = tiny_llama(hidden=32, seed=0)
        self.drafter = None


def _spec(tmp_path, answers_folder):
    return OmegaConf.create(
        {
            "seed": 0,
            "model": {"smollm2": {"out_dir": str(answers_folder.parent)}},
            "data": {},
            "trainer": {"accelerator": "cpu"},
            "paths": {"checkpoints_dir": str(tmp_path / "checkpoints")},
        }
    )


def test_config_builds_heads_over_the_answers_frequent_tokens_and_answer_batches(tmp_path, monkeypatch):
    """``answers: pair`` reads the real pair's answers (train.training.pair_answers: generated on first
    need and cached; here given as they would be read back)."""
    import train.training.answer_sources as answer_data

    pair = _Pair()
    folder = tmp_path / "pair" / "answers"
    folder.mkdir(parents=True)
    saved = {"train": _answers(pair.tokenizer, 16, 0), "validation": _answers(pair.tokenizer, 4, 1)}
    for split, answers in saved.items():
        save_answers(answers, str(folder / f"{split}.pt"))
    monkeypatch.setattr(
        answer_data, "pair_answers", lambda model, v, t, **_: saved if model.smollm2 else None
    )
    cfg = MedusaConfig(
        optimizer=ADAMW, num_heads=3, answers="pair", batch_size=4, max_len=32, draft_vocab_size=8, tree_top=4
    )
    spec = _spec(tmp_path, folder)
    assert pair_answers_folder(spec.model) == str(folder)
    module, data = build_method(cfg, pair, spec)
    assert isinstance(data, AnswerDataModule)
    # the answers hold 10..14 and eos: all of them, then the lowest unseen ids fill the 8 rows
    assert set(range(10, 15)) | {pair.tokenizer.eos_token_id} <= set(module.heads.draft_vocab)
    assert len(module.heads.draft_vocab) == 8
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        val_check_interval=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    # the answers are a fixed cycle: head 0 learns it within a few steps
    assert float(metrics["val/head0_top1"]) > 0.5
    with pytest.raises(ConfigError, match="method.answers"):
        build_method(MedusaConfig(optimizer=ADAMW, answers=str(tmp_path / "missing")), pair, spec)


def test_answer_settings_are_checked():
    with pytest.raises(ConfigError, match="method.draft_vocab_size"):
        MedusaConfig(optimizer=ADAMW, draft_vocab_size=4, tree_top=10)
    with pytest.raises(ConfigError, match="method.answer_tokens"):
        MedusaConfig(optimizer=ADAMW, num_heads=4, answer_tokens=5)


def test_the_heads_loss_matches_cross_entropy_on_full_heads_restricted_by_hand():
    """Over the draft rows the loss is F.cross_entropy of the restricted logits: same as full heads whose
    other rows are -inf (the exact reduction)."""
    ids = torch.tensor([[0, 2, 3, 5, 8, 9, 2]])
    logits = torch.randn(1, 1, 7, len(DRAFT))
    full = torch.full((1, 1, 7, 11), float("-inf"))
    full[..., DRAFT] = logits
    _, (reduced,) = medusa_loss(logits, ids, draft_ids=torch.tensor(DRAFT))
    _, (by_full,) = medusa_loss(full, ids)
    torch.testing.assert_close(reduced, by_full)
    assert torch.isfinite(reduced)
    torch.testing.assert_close(reduced, F.cross_entropy(full[0, 0, :5], ids[0, 2:]))


def test_init_heads_auto_takes_the_newest_medusa_run_of_this_verifier(tmp_path, caplog):
    verifier = tiny_llama(hidden=32, seed=0)
    spec = OmegaConf.create({"paths": {"checkpoints_dir": str(tmp_path)}, "model": {"verifier": "/pair/v"}})
    cfg = MedusaConfig(optimizer=ADAMW, num_heads=2, init_heads="auto")
    with caplog.at_level("WARNING"):
        assert initial_heads(cfg, spec) is None  # nothing trained yet: fresh heads, said so
    assert "no Medusa-1 run" in caplog.text
    for experiment, run, named in (
        ("medusa", "2026-01-01_00-00-00", "/pair/v"),
        ("medusa", "2026-01-02_00-00-00", "/pair/v"),
        ("medusa", "2026-01-03_00-00-00", "/other/v"),  # newer, another verifier's
    ):
        folder = tmp_path / experiment / run
        MedusaHeads.from_verifier(verifier, 2, 1).save_pretrained(folder / "heads")
        (folder / "config.yaml").write_text(f"model:\n  verifier: {named}\n")
    found = initial_heads(cfg, spec)
    assert found == str(tmp_path / "medusa" / "2026-01-02_00-00-00" / "heads")
    heads = build_heads(cfg, verifier, None, lambda: [], found)
    assert heads.num_heads == 2
    with pytest.raises(ConfigError, match="method.init_heads"):
        build_heads(MedusaConfig(optimizer=ADAMW, num_heads=3), verifier, None, lambda: [], found)
    assert initial_heads(MedusaConfig(optimizer=ADAMW, init_heads=found), spec) == found
