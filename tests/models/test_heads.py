"""Medusa heads: initialisation from the verifier, distinct residual blocks, the label shift, the
decayed loss, and save / load through the Hub mixin with vLLM's parameter names."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from tests.conftest import tiny_llama
from train.models.heads import MedusaHeads, medusa_loss, shifted_targets


@pytest.mark.parametrize("tied", [False, True])
def test_fresh_heads_equal_the_verifiers_next_token_head(tied):
    if tied:
        torch.manual_seed(0)
        verifier = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2))
    else:
        verifier = tiny_llama(hidden=32, seed=0)
    heads = MedusaHeads.from_verifier(verifier, num_heads=3, num_layers=2)
    ids = torch.tensor([[1, 5, 9, 7, 3]])
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        logits = heads(hidden)
    assert logits.shape == (3, 1, 5, out.logits.shape[-1])
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, atol=1e-5, rtol=1e-5)


def test_blocks_are_distinct_and_named_as_vllm_reads_them():
    heads = MedusaHeads(hidden_size=8, vocab_size=11, num_heads=2, num_layers=3)
    names = set(heads.state_dict())
    expected = {f"blocks.{h}.layers.{i}.{p}" for h in range(2) for i in range(3) for p in ("weight", "bias")}
    assert names == expected | {"lm_heads.0.weight", "lm_heads.1.weight"}
    params = [heads.blocks[0].layers[i].weight for i in range(3)] + [heads.blocks[1].layers[0].weight]
    assert len({p.data_ptr() for p in params}) == 4  # not one block object repeated
    with torch.no_grad():
        heads.blocks[0].layers[1].weight.add_(1.0)
    assert (
        heads.blocks[0].layers[0].weight.abs().sum() == 0
        and heads.blocks[0].layers[2].weight.abs().sum() == 0
    )


def test_label_shift_on_a_hand_made_sequence():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    targets, valid = shifted_targets(ids, 0)  # head 0 at position t predicts token t + 2
    assert targets[0, :3].tolist() == [12, 13, 14] and valid[0].tolist() == [True, True, True, False, False]
    targets, valid = shifted_targets(ids, 1)
    assert targets[0, :2].tolist() == [13, 14] and valid[0].tolist() == [True, True, False, False, False]


def test_loss_is_decayed_cross_entropy_and_zero_on_perfect_heads():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    vocab = 8
    perfect = torch.full((2, 1, 6, vocab), -1e4)
    for k in range(2):
        targets, valid = shifted_targets(ids, k)
        for t in range(6):
            if valid[0, t]:
                perfect[k, 0, t, targets[0, t]] = 1e4
    loss, per_head = medusa_loss(perfect, ids)
    assert float(loss) < 1e-6 and all(float(x) < 1e-6 for x in per_head)
    uniform = torch.zeros(2, 1, 6, vocab)
    loss, per_head = medusa_loss(uniform, ids, decay=0.5)
    ln_v = torch.log(torch.tensor(float(vocab)))
    torch.testing.assert_close(loss, ln_v * (1 + 0.5))
    # padding: a target that is padding does not count
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    _, per_head = medusa_loss(perfect, ids, mask=mask)
    assert all(float(x) < 1e-6 for x in per_head)


def test_save_and_load_round_trip(tmp_path):
    heads = MedusaHeads(hidden_size=8, vocab_size=11, num_heads=2, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.save_pretrained(tmp_path / "heads")
    assert (tmp_path / "heads" / "model.safetensors").is_file()
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert (loaded.hidden_size, loaded.vocab_size, loaded.num_heads, loaded.num_layers) == (8, 11, 2, 1)
    for name, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_bad_sizes_are_rejected():
    for kw in (
        dict(hidden_size=0, vocab_size=3),
        dict(hidden_size=4, vocab_size=3, num_heads=0),
        dict(hidden_size=4, vocab_size=3, num_layers=-1),
    ):
        with pytest.raises(ValueError):
            MedusaHeads(**kw)
