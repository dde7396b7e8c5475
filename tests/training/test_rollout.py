"""Batched training rollouts: left padding and KV cache vs Hugging Face generation, EOS masking, no grad."""

from __future__ import annotations

import pytest
import torch

from tests.decoding.decoding_helpers import BOS, VOCAB, build, tiny_config
from train.data.lm import collate_left_pad
from train.decoding.sampling import SamplingParams
from train.training.rollout import position_ids_from_mask, rollout

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """2 layers, hidden 32, random weights."""
    return build(tiny_config("llama", 32), 3)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=BOS,
        min_new_tokens=n,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_batched_left_padded_equals_hf_generate_per_prompt(model):
    prompts = _prompts()
    batch = collate_left_pad(prompts, pad_id=BOS)
    ro = rollout(
        model, batch["input_ids"], batch["attention_mask"], 8, GREEDY, eos_token_id=None, pad_token_id=BOS
    )
    assert ro.sequences.shape == (3, 9 + 8)
    assert ro.prompt_width == 9
    for i, p in enumerate(prompts):
        assert ro.sequences[i, 9:].tolist() == _hf_greedy(model, p, 8)
    assert ro.continuation_mask[:, :9].sum() == 0
    assert ro.continuation_mask[:, 9:].all()
    assert torch.equal(ro.attention_mask[:, :9], batch["attention_mask"])
    assert int(ro.continuation_mask.sum()) == 24


def test_eos_masks_and_pads_the_rest_and_stops_early(model):
    prompts = _prompts()
    batch = collate_left_pad(prompts, pad_id=BOS)
    free = rollout(model, batch["input_ids"], batch["attention_mask"], 6, GREEDY, pad_token_id=BOS)
    eos = int(free.sequences[0, 9 + 2])  # row 0's third token becomes "EOS"
    ro = rollout(
        model, batch["input_ids"], batch["attention_mask"], 6, GREEDY, eos_token_id=eos, pad_token_id=BOS
    )
    for i in range(3):
        cont = ro.sequences[i, 9:].tolist()
        mask = ro.continuation_mask[i, 9:].tolist()
        ref = free.sequences[i, 9:].tolist()
        if eos in ref:
            k = ref.index(eos)
            assert cont[: k + 1] == ref[: k + 1]
            assert mask == [True] * (k + 1) + [False] * (len(cont) - k - 1)
            assert all(t == BOS for t in cont[k + 1 :])
        else:
            assert cont == ref[: len(cont)]
            assert all(mask)
    assert ro.continuation_mask[0, 9:].sum() == 3
    assert torch.equal(ro.attention_mask.bool()[:, 9:], ro.continuation_mask[:, 9:])


def test_stops_when_every_row_finished():
    class Always:  # a model that always says EOS (id 1)
        training = False

        def eval(self):
            return self

        def train(self, mode=True):
            return self

        def forward(self, input_ids, **kw):
            logits = torch.full((input_ids.shape[0], input_ids.shape[1], 8), -10.0)
            logits[..., 1] = 10.0
            return type("Out", (), {"logits": logits, "past_key_values": None})()

        __call__ = forward

        def get_output_embeddings(self):
            return None

        config = type("C", (), {"vocab_size": 8})()

    ro = rollout(
        Always(),  # type: ignore[arg-type]
        torch.tensor([[0, 3], [0, 4]]),
        None,
        10,
        GREEDY,
        eos_token_id=1,
    )
    assert ro.sequences.shape == (2, 3)
    assert ro.continuation_mask[:, 2].all()


def test_sampling_is_seeded_no_grad_and_restores_train_mode(model):
    prompts = _prompts()
    batch = collate_left_pad(prompts, pad_id=BOS)
    model.train()
    params = SamplingParams(temperature=1.0)
    a = rollout(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        7,
        params,
        generator=torch.Generator().manual_seed(5),
        vocab_size=50,
    )
    b = rollout(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        7,
        params,
        generator=torch.Generator().manual_seed(5),
        vocab_size=50,
    )
    assert model.training
    model.eval()
    assert torch.equal(a.sequences, b.sequences)
    assert not a.sequences.requires_grad
    assert int(a.sequences[:, 9:].max()) < 50


def test_sampled_rows_follow_the_unpadded_distribution(model):
    """Left padding does not change a row's next-token distribution (positions come from the mask)."""
    prompts = _prompts()
    batch = collate_left_pad(prompts, pad_id=BOS)
    pos = position_ids_from_mask(batch["attention_mask"])
    with torch.no_grad():
        padded = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos
        ).logits
        for i, p in enumerate(prompts):
            alone = model(input_ids=torch.tensor([p])).logits
            torch.testing.assert_close(padded[i, -1], alone[0, -1], atol=1e-5, rtol=1e-4)


def test_zero_new_tokens_and_bad_input(model):
    ids = torch.tensor([[0, 5, 6]])
    ro = rollout(model, ids, None, 0, GREEDY)
    assert torch.equal(ro.sequences, ids) and int(ro.continuation_mask.sum()) == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        rollout(model, ids, None, -1, GREEDY)
    with pytest.raises(ValueError, match=r"\(B, P\)"):
        rollout(model, ids[0], None, 2, GREEDY)


def test_last_prompt_tokens_keeps_the_continuation_and_the_prompts_tail():
    """The drafter's view of a batch with ``method.drafter_context``: each prompt's last tokens (a shorter
    prompt keeps its padding), every continuation column and the scores unchanged; positions from the
    mask restart at 0."""
    from train.training.rollout import Rollout, last_prompt_tokens

    seqs = torch.tensor([[0, 0, 5, 6, 7, 1, 2], [3, 4, 5, 6, 7, 8, 9]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    cont = torch.zeros_like(seqs, dtype=torch.bool)
    cont[:, 5:] = True
    scores = torch.randn(2, 2, 11)
    ro = Rollout(seqs, attn, cont, prompt_width=5, scores=scores)
    cut = last_prompt_tokens(ro, 3)
    assert cut.prompt_width == 3 and cut.scores is scores
    assert cut.sequences.tolist() == [[5, 6, 7, 1, 2], [5, 6, 7, 8, 9]]
    assert torch.equal(cut.continuation_mask[:, 3:], cont[:, 5:]) and not cut.continuation_mask[:, :3].any()
    assert position_ids_from_mask(cut.attention_mask).tolist() == [[0, 1, 2, 3, 4]] * 2
    short = last_prompt_tokens(ro, 4)  # the first row's prompt (3 tokens) keeps one padding column
    assert short.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 1]
    assert (
        last_prompt_tokens(ro, None) is ro
        and last_prompt_tokens(ro, 5) is ro
        and last_prompt_tokens(ro, 9) is ro
    )
