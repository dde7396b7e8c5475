"""The SD^2 steering module: layer choice, zero-initialised equality, injection on the MLP up branch,
removal, mismatched pairs refused with both sizes named, save / load."""

from __future__ import annotations

import pytest
import torch

from tests.decoding.decoding_helpers import build, tiny_config
from train.models.steering_module import (
    SteeringModule,
    default_verifier_layers,
    guide_for,
    guide_positions,
    simulated_guides,
    stale_guide_states,
    swiglu_mlps,
)


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


def test_weights_gathered_as_views_of_one_flat_tensor_still_save(pair, tmp_path):
    """Under FSDP the gathered weights are views into one flat parameter (the H200 smoke run's
    ``steering FSDP`` stage failed exactly so): safetensors refuses to save such a module, its
    ``standalone_copy`` saves and reloads the same weights."""
    verifier, drafter = pair
    module = SteeringModule.for_pair(verifier, drafter, layers=[0, 1])
    with torch.no_grad():
        module.project.weight.normal_()
    flat = torch.cat([p.detach().flatten() for p in module.parameters()] + [torch.zeros(7)])
    offset = 0
    for p in module.parameters():
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    with pytest.raises(RuntimeError, match="shared"):
        module.save_pretrained(tmp_path / "views")
    copy = module.standalone_copy()
    copy.save_pretrained(tmp_path / "steering")
    loaded = SteeringModule.from_pretrained(tmp_path / "steering")
    assert loaded.verifier_layers == [0, 1] and loaded.verifier_name == module.verifier_name
    states = _states(module)
    torch.testing.assert_close(loaded(states), module(states))


def test_guide_rule_by_hand():
    # a 5-token prompt (positions 0..4); verifications commit 1, 4, 2 tokens: the last committed tokens sit
    # at 5, 9, 11 and were produced by the verifier at 4, 8, 10
    guides = guide_positions(5, [1, 4, 2])
    assert guides == [4, 8, 10]
    # the latest guide strictly before the position: the first block (0..4) has none; the last draft of
    # the fully accepted second block (position 8) keeps the guide of 4, the bonus token at 9 gets 8's
    assert [guide_for(t, guides) for t in range(13)] == [-1] * 5 + [4, 4, 4, 4, 8, 8, 10, 10]
    with pytest.raises(ValueError):
        guide_positions(5, [1, 0])


def test_simulated_guides_by_hand():
    # answer from position 3, blocks of 2: the first block (drafter positions 2, 3) is unsteered, then
    # staleness 1, 2, 1, 2, ...
    assert simulated_guides(3, 2, 10) == [3, 5, 7]
    assert simulated_guides(3, 2, 10) == guide_positions(3, [2, 2, 2])
    # blocks of one: every answer position t is steered by t - 1, from the last prompt position on
    assert simulated_guides(3, 1, 6) == [2, 3, 4]
    states = torch.arange(1, 11, dtype=torch.float32).view(1, 10, 1, 1).expand(2, 10, 2, 3).clone()
    out, has_guide = stale_guide_states(states, simulated_guides(3, 2, 10))
    assert out[1, :, 1, 2].tolist() == [0.0] * 4 + [4.0, 4.0, 6.0, 6.0, 8.0, 8.0]  # state t + 1 = position t
    assert has_guide.tolist() == [[False] * 4 + [True] * 6] * 2
    for bad in ((3, 0, 10), (0, 1, 10)):
        with pytest.raises(ValueError):
            simulated_guides(*bad)


@pytest.mark.parametrize("offset", [1, 2, 4, 7])
def test_simulated_guides_are_one_to_offset_stale_and_never_the_position_itself(offset):
    # The drafter at t predicts t + 1; the verifier's state at t already encodes that token's distribution,
    # so a guide from t or later would leak the target (decoding never has one).
    start, length = 5, 40
    guides = simulated_guides(start, offset, length)
    sources = [guide_for(t, guides) for t in range(length)]
    # the prompt and the first block (drafter positions start - 1 .. start + offset - 2) have no guide
    assert sources[: start - 1 + offset] == [-1] * (start - 1 + offset)
    assert sorted({t - g for t, g in enumerate(sources) if g >= 0}) == list(range(1, offset + 1))
    assert min(g for g in sources if g >= 0) == start - 2 + offset


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
