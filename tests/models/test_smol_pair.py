"""The real pair's build parts: the verifier's answers, the answer-distillation loss over a draft
vocabulary, the drafter's start, the cache rule and the dtype choice (the whole build runs in the slow
main-job test on the real verifier)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.conftest import tiny_llama
from train.config import ConfigError
from train.hardware import best_dtype
from train.methods.answer_distill.module import (
    answer_example,
    collate_right_pad,
    restricted_teacher_cross_entropy,
)
from train.models.answers import Answer, answer_length, generate_answers, load_answers, save_answers
from train.models.draft_vocab import vocab_index
from train.pairs.smollm2_pair import (
    SmolDrafterSpec,
    SmolPairConfig,
    coverage,
    new_drafter,
    projected_embeddings,
    stale_reason,
)


def _llama(vocab: int = 260, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(vocab_size=vocab, hidden=hidden, layers=1, seed=seed)


def test_answer_length() -> None:
    assert answer_length(torch.tensor([4, 2, 9, 2]), [2]) == 2  # up to and including the first eos
    assert answer_length(torch.tensor([4, 5]), [2]) == 2


def test_answers_are_the_verifiers_greedy_continuations_with_their_top_k(tmp_path: Path) -> None:
    model = _llama()
    prompts = [[1, 5, 9, 11], [1, 7], [1, 3, 3]]
    answers = generate_answers(model, prompts, eos_ids=[2], max_new_tokens=6, batch_size=2, top_k=4)
    # (id 2 is an ordinary token of this model; as the eos given here it ends an answer)
    assert [a.prompt for a in answers] == prompts  # the prompts' order, whatever the batching
    for a in answers:
        ref = model.generate(torch.tensor([a.prompt]), max_new_tokens=6, do_sample=False, eos_token_id=2)
        assert a.answer == ref[0, len(a.prompt) :].tolist()[: len(a.answer)]
        assert a.top_ids.shape == (len(a.answer), 4) and a.top_ids[:, 0].tolist() == a.answer
        assert (a.top_logprobs[:, :-1] >= a.top_logprobs[:, 1:]).all()  # descending
    save_answers(answers, str(tmp_path / "a.pt"))
    again = load_answers(str(tmp_path / "a.pt"))
    assert [a.answer for a in again] == [a.answer for a in answers]


def test_restricted_cross_entropy_renormalises_the_teacher_over_the_draft_vocabulary() -> None:
    draft = torch.tensor([0, 3, 5])  # rows 0, 1, 2 of the draft vocabulary
    index = vocab_index(draft, 8)
    answer = Answer(
        prompt=[1, 4],
        answer=[3],
        top_ids=torch.tensor([[3, 6, 5]], dtype=torch.int32),  # 6 is outside the draft vocabulary
        top_logprobs=torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]], dtype=torch.float16),
    )
    row = answer_example(answer, index, max_len=16)
    assert row is not None
    batch = collate_right_pad([row], pad_id=0)
    assert batch["targets"][0, 0].tolist() == [-1, -1, -1]  # the prompt's first token predicts nothing
    assert batch["targets"][0, 1].tolist() == [1, -1, 2]  # predicts the answer: ids 3, 6, 5 as rows
    logits = torch.zeros(1, 3, 3)
    logits[0, 1] = torch.tensor([0.0, 2.0, 1.0])
    loss, agreement = restricted_teacher_cross_entropy(logits, batch["targets"], batch["target_logprobs"])
    log_q = torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), -1)
    teacher = torch.tensor([0.5, 0.2]) / 0.7  # 0.3 on the outside token dropped, the rest renormalised
    expected = -(teacher[0] * log_q[1] + teacher[1] * log_q[2])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-3)
    assert agreement.item() == 1.0  # the drafter's argmax (row 1 = id 3) is the greedy token


def test_projected_embeddings_keep_the_verifiers_geometry() -> None:
    torch.manual_seed(0)
    low_rank = torch.randn(500, 4) @ torch.randn(4, 40)
    projected = projected_embeddings(low_rank, 8)
    assert projected.shape == (500, 8)
    assert projected.pow(2).mean().sqrt().item() == pytest.approx(8**-0.5, rel=1e-4)
    gram = (low_rank - low_rank.mean(0)) @ (low_rank - low_rank.mean(0)).T
    pgram = projected @ projected.T
    corr = torch.corrcoef(torch.stack([gram.flatten(), pgram.flatten()]))[0, 1]
    assert corr > 0.999  # rank 4 fits in 8 directions: inner products kept up to scale


def test_new_drafter_has_the_verifiers_vocabulary_and_its_draft_vocabulary() -> None:
    verifier = _llama(hidden=48)
    spec = SmolDrafterSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    drafter = new_drafter(verifier, spec, [2, 4, 9], seed=0)
    assert drafter.config.vocab_size == 260 and drafter.config.draft_vocab == [2, 4, 9]
    assert (
        drafter.get_output_embeddings().weight.data_ptr() == drafter.get_input_embeddings().weight.data_ptr()
    )
    answers = [Answer([1], [4, 4, 9, 7], torch.zeros(4, 1, dtype=torch.int32), torch.zeros(4, 1))]
    assert coverage(answers, [2, 4, 9]) == 0.75


def test_the_cache_is_reused_only_for_the_same_recipe(tmp_path: Path) -> None:
    cfg = SmolPairConfig(out_dir=str(tmp_path), drafter=SmolDrafterSpec())
    assert "no SmolLM2 pair" in str(stale_reason(cfg))
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash()}))
    for role in ("verifier", "drafter"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    assert stale_reason(cfg) is None
    other = replace(cfg, drafter=replace(cfg.drafter, num_layers=3))
    assert "another recipe" in str(stale_reason(other))


def test_a_bad_drafter_recipe_names_its_key() -> None:
    with pytest.raises(ConfigError, match="model.smollm2.drafter.num_heads"):
        SmolDrafterSpec(hidden_size=250, num_heads=4)


def test_best_dtype_is_one_the_machine_computes_natively() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    if not torch.cuda.is_available():
        assert best_dtype() == expected


def test_a_pair_built_on_another_chat_prompt_set_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    """Answers and drafter derive from the chat prompts: a changed prompt set (another split of sources,
    new records) makes the cached pair stale; a manifest from before the fingerprint is reused."""
    import train.pairs.smollm2_pair as smol

    monkeypatch.setattr(smol, "chat_set_fingerprint", lambda: "set-a")
    cfg = SmolPairConfig(out_dir=str(tmp_path), drafter=SmolDrafterSpec())
    for role in ("verifier", "drafter"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash(), "chat_set": "set-a"}))
    assert stale_reason(cfg) is None
    monkeypatch.setattr(smol, "chat_set_fingerprint", lambda: "set-b")
    assert "another version of the chat prompt set" in str(stale_reason(cfg))
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash()}))
    assert stale_reason(cfg) is None


def test_the_chat_set_fingerprint_follows_its_records(monkeypatch) -> None:
    import train.data.chat as chat

    first = chat.chat_set_fingerprint()
    assert first == chat.chat_set_fingerprint() and len(first) == 16
    monkeypatch.setattr(chat, "_cached_records", lambda: '[{"source": "x"}]')
    assert chat.chat_set_fingerprint() != first


def test_one_run_builds_a_pair_while_another_waits_for_it(tmp_path, caplog):
    """Two runs starting at once: the second waits on the first's lock, then reuses what it built."""
    import threading
    import time

    from train.pairs.built import alone

    out_dir = str(tmp_path / "checkpoints" / "smollm2")
    built: list[str] = []
    inside = threading.Event()
    overlap: list[int] = []
    active = [0]

    def ensure(name: str) -> str:
        active[0] += 1
        overlap.append(active[0])
        inside.set()
        if not built:  # the first to get here builds, slowly
            time.sleep(0.3)
            built.append(name)
        active[0] -= 1
        return built[0]

    first = threading.Thread(target=lambda: alone(out_dir, lambda: ensure("first")))
    first.start()
    inside.wait(5)
    with caplog.at_level("WARNING"):
        second = alone(out_dir, lambda: ensure("second"))
    first.join()
    assert built == ["first"] and second == "first"
    assert max(overlap) == 1  # never both inside
    assert "waiting for it" in caplog.text
