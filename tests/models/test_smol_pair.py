"""The real pair's build parts: the verifier's answers, the answer-distillation loss over a draft
vocabulary, the drafter's start, the cache rule and the dtype choice (the whole build runs in the slow
main-job test on the real verifier)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.conftest import tiny_llama
from train.config import ConfigError
from train.hardware import best_dtype
from train.models.answers import answer_length, generate_answers, load_answers, save_answers
from train.pairs.smollm2_pair import (
    SmolDrafterRecipe,
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


def test_answers_are_the_verifiers_greedy_continuations_with_their_top_logprobs(tmp_path: Path) -> None:
    model = _llama()
    prompts = [[1, 5, 9, 11], [1, 7], [1, 3, 3]]
    answers = generate_answers(model, prompts, eos_ids=[2], max_new_tokens=6, batch_size=2, top_logprobs=4)
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


def test_answers_keep_the_top_k_of_the_raw_logits_without_holding_them(monkeypatch) -> None:
    """The recorder's top-k equals the top-k of the logits ``generate`` returns with ``output_logits``
    (greedy and sampled), and ``generate`` is no longer asked to keep every step's logits."""
    model = _llama()
    prompts = [[1, 5, 9, 11], [1, 7]]
    seen: list[dict] = []
    generate = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    for temperature in (0.0, 1.0):
        answers = generate_answers(
            model,
            prompts,
            eos_ids=[2],
            max_new_tokens=5,
            batch_size=2,
            top_logprobs=3,
            temperature=temperature,
        )
        assert not seen[-1].get("output_logits") and not seen[-1].get("return_dict_in_generate")
        for a in answers:
            sequence = torch.tensor([a.prompt + a.answer])
            logits = model(sequence).logits[0, len(a.prompt) - 1 : -1]
            top = torch.log_softmax(logits.float(), -1).topk(3, -1)
            assert a.top_ids.tolist() == top.indices.tolist()
            torch.testing.assert_close(a.top_logprobs.float(), top.values, atol=2e-3, rtol=0)


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
    spec = SmolDrafterRecipe(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    drafter = new_drafter(verifier, spec, [2, 4, 9], seed=0)
    assert drafter.config.vocab_size == 260 and drafter.config.draft_vocab == [2, 4, 9]
    assert (
        drafter.get_output_embeddings().weight.data_ptr() == drafter.get_input_embeddings().weight.data_ptr()
    )
    assert coverage(Counter([4, 4, 9, 7]), [2, 4, 9]) == 0.75


def test_the_cache_is_reused_only_for_the_same_recipe(tmp_path: Path, monkeypatch) -> None:
    """The drafter's spec and seed make the recipe; the answers' settings (generated when a run needs
    them, cached apart) do not rebuild the drafter."""
    import train.pairs.smollm2_pair as smol

    monkeypatch.setattr(smol, "chat_set_fingerprint", lambda: "set-a")
    cfg = SmolPairConfig(out_dir=str(tmp_path), drafter=SmolDrafterRecipe())
    assert "no SmolLM2 pair" in str(stale_reason(cfg))
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash(), "chat_set": "set-a"}))
    for role in ("verifier", "drafter"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    assert stale_reason(cfg) is None
    other = replace(cfg, drafter=replace(cfg.drafter, num_layers=3))
    assert "another recipe" in str(stale_reason(other))
    assert "another recipe" in str(stale_reason(replace(cfg, seed=1)))
    assert stale_reason(replace(cfg, train_prompts=10, top_logprobs=4, sampled_answers=0)) is None


def test_pretraining_over_a_draft_vocabulary_counts_only_the_targets_inside_it() -> None:
    """Plain next-token cross-entropy over the head's draft rows; a next token outside them is no target."""
    from train.methods.pretrain.module import PretrainModule
    from train.pairs.smollm2_pair import pretrain_config

    model = _llama()
    draft = torch.tensor([3, 5, 9, 11])
    module = PretrainModule(model, pretrain_config(SmolDrafterRecipe(max_steps=10)), draft_ids=draft)
    ids = torch.tensor([[1, 3, 5, 200, 9, 11, 3]])  # 200 is outside: the position before it is no target
    loss, hits, n = module._loss_and_correct({"input_ids": ids})
    logits = model(ids).logits[0, :-1][:, draft]
    rows = torch.tensor([0, 1, -1, 2, 3, 0])
    keep = rows >= 0
    expected = torch.nn.functional.cross_entropy(logits[keep], rows[keep])
    assert n == 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert int(hits) == int((logits[keep].argmax(-1) == rows[keep]).sum())


def test_a_bad_drafter_recipe_names_its_key() -> None:
    with pytest.raises(ConfigError, match="model.smollm2.drafter.num_heads"):
        SmolDrafterRecipe(hidden_size=250, num_heads=4)


def test_best_dtype_is_one_the_machine_computes_natively() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    if not torch.cuda.is_available():
        assert best_dtype() == expected


def test_a_pair_built_on_another_chat_prompt_set_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    """The drafter read the chat set's training requests: a changed prompt set (another split of sources,
    new records) makes the cached pair stale, and so does a manifest without the fingerprint."""
    import train.pairs.smollm2_pair as smol

    monkeypatch.setattr(smol, "chat_set_fingerprint", lambda: "set-a")
    cfg = SmolPairConfig(out_dir=str(tmp_path), drafter=SmolDrafterRecipe())
    for role in ("verifier", "drafter"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash(), "chat_set": "set-a"}))
    assert stale_reason(cfg) is None
    monkeypatch.setattr(smol, "chat_set_fingerprint", lambda: "set-b")
    assert "another version of the chat prompt set" in str(stale_reason(cfg))
    (tmp_path / "pair.json").write_text(json.dumps({"recipe_hash": cfg.recipe_hash()}))
    assert "another version of the chat prompt set" in str(stale_reason(cfg))


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
