"""The SD^2 steering module: layer choice, zero-initialised equality, injection on the MLP up branch,
removal, mismatched pairs refused with both sizes named, save / load."""

from __future__ import annotations

import pytest
import torch

from tests.decoding.decoding_helpers import build, tiny_config
from train.models.steering import SteeringModule, default_verifier_layers, stale_guide_states, swiglu_mlps


def test_default_layers_scale_the_authors_choice():
    assert default_verifier_layers(32) == [3, 16, 29]
    assert default_verifier_layers(4) == [0, 2, 3]
    assert default_verifier_layers(1) == [0]


@pytest.fixture(scope="module")
def pair():
    return build(tiny_config("llama", 64), 1), build(tiny_config("llama", 32), 2)


def _states(module: SteeringModule, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(module.verifier_layers), module.verifier_hidden_size, generator=g)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_zero_initialised_steering_changes_nothing(arch):
    verifier, drafter = build(tiny_config(arch, 64), 1), build(tiny_config(arch, 32), 2)
    module = SteeringModule.for_pair(verifier, drafter)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    with torch.no_grad():
        plain = drafter(ids).logits
        deltas = module(_states(module))
        assert deltas.shape == (module.drafter_layers, module.drafter_intermediate_size)
        assert float(deltas.abs().max()) == 0.0
        with module.attach(drafter) as handle:
            handle.set(deltas)
            steered = drafter(ids).logits
    assert torch.equal(plain, steered)


def test_the_bias_goes_to_the_up_branch_and_is_removable(pair):
    verifier, drafter = pair
    module = SteeringModule.for_pair(verifier, drafter)
    with torch.no_grad():
        module.project.weight.normal_(0, 0.5)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    mlp = swiglu_mlps(drafter)[0]
    x = torch.randn(1, 3, drafter.config.hidden_size)
    with torch.no_grad():
        deltas = module(_states(module))
        plain_logits = drafter(ids).logits
        handle = module.attach(drafter)
        handle.set(deltas)
        # down(act(gate(x)) * (up(x) + delta)) by hand
        by_hand = mlp.down_proj(
            mlp.act_fn(mlp.gate_proj(x)) * (torch.nn.functional.linear(x, mlp.up_proj.weight) + deltas[0])
        )
        torch.testing.assert_close(mlp(x), by_hand)
        assert not torch.allclose(drafter(ids).logits, plain_logits)
        handle.remove()
        assert torch.equal(drafter(ids).logits, plain_logits)


def test_mismatched_pairs_are_refused_naming_both_sizes(pair):
    verifier, drafter = pair
    module = SteeringModule.for_pair(verifier, drafter)
    wide = build(tiny_config("llama", 96), 3)
    with pytest.raises(ValueError, match="width 64.*hidden size is 96"):
        module.check_pair(wide, drafter)
    other_drafter = build(tiny_config("llama", 48), 4)
    with pytest.raises(ValueError, match=f"width {module.drafter_intermediate_size}.*this drafter has"):
        module.check_pair(verifier, other_drafter)
    gpt2 = build(tiny_config("gpt2", 32), 5)
    with pytest.raises(ValueError, match="no SwiGLU MLP"):
        SteeringModule.for_pair(verifier, gpt2)


def test_save_and_load_keep_the_layers_and_weights(pair, tmp_path):
    verifier, drafter = pair
    module = SteeringModule.for_pair(verifier, drafter, layers=[0, 1])
    with torch.no_grad():
        module.project.weight.normal_()
    module.save_pretrained(tmp_path / "steering")
    loaded = SteeringModule.from_pretrained(tmp_path / "steering")
    assert loaded.verifier_layers == [0, 1]
    states = _states(module)
    torch.testing.assert_close(loaded(states), module(states))


def test_stale_guides_by_hand():
    # one row, 6 positions, response from position 2; states numbered by position
    states = torch.arange(6, dtype=torch.float32).view(1, 6, 1, 1).expand(1, 6, 2, 3).clone()
    out, has_guide = stale_guide_states(states, 2, torch.tensor([2]))
    # positions 0, 1 (prompt): zeros and no guide; t >= 2 takes max(t - 2, 1), 1 = the last prompt position
    assert out[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 3.0]
    assert has_guide[0].tolist() == [False, False, True, True, True, True]
    out, has_guide = stale_guide_states(states, 1, torch.tensor([0]))
    # no prompt: position 0 has no earlier state to be steered by
    assert out[0, :, 1, 2].tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert has_guide[0].tolist() == [False, True, True, True, True, True]
    with pytest.raises(ValueError):
        stale_guide_states(states, 0, torch.tensor([0]))


@pytest.mark.parametrize("offset", [1, 2, 4, 7])
def test_stale_guides_never_come_from_the_position_itself_or_later(offset):
    # The drafter at t predicts t + 1; the verifier's state at t already encodes that token's distribution,
    # so a guide from t or later would leak the target (decoding never has one).
    batch, length = 3, 12
    states = torch.arange(length, dtype=torch.float32).view(1, length, 1, 1).expand(batch, length, 1, 2) + 1
    start = torch.tensor([1, 4, 9])
    out, has_guide = stale_guide_states(states, offset, start)
    source = out[..., 0, 0] - 1  # the position each guide came from (-1: none)
    t = torch.arange(length).expand(batch, length)
    assert bool((source[has_guide] < t[has_guide]).all())
    assert bool((source[has_guide] >= (start.view(-1, 1) - 1).expand(batch, length)[has_guide]).all())
    assert bool((source[has_guide] >= (t - offset)[has_guide]).all())
    assert has_guide.tolist() == (t >= start.view(-1, 1)).tolist()


def test_per_position_guides_match_one_guide_for_every_position(pair):
    verifier, drafter = pair
    module = SteeringModule.for_pair(verifier, drafter)
    with torch.no_grad():
        module.project.weight.normal_(0, 0.5)
        ids = torch.tensor([[0, 5, 9, 3, 7]])
        deltas = module(_states(module))
        with module.attach(drafter) as handle:
            handle.set(deltas)
            shared = drafter(ids).logits
            handle.set(deltas.expand(1, 5, *deltas.shape))  # (B, T, L, d_ff)
            per_position = drafter(ids).logits
            # a guide at the last position only changes the last position's logits
            only_last = torch.zeros(1, 5, *deltas.shape)
            only_last[0, -1] = deltas
            handle.set(only_last)
            partial = drafter(ids).logits
        plain = drafter(ids).logits
    torch.testing.assert_close(per_position, shared)
    torch.testing.assert_close(partial[:, :-1], plain[:, :-1])
    assert not torch.allclose(partial[:, -1], plain[:, -1])
