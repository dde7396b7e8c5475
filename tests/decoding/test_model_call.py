"""The timed model call: explicit positions, a 4-D (tree) mask, logits_to_keep, hidden states; and
``keep_positions`` compacting a tree's accepted path into a contiguous cache."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from train.decoding import (
    AutoregressiveDecoder,
    HeadsDecoder,
    SamplingParams,
    SpeculativeDecoder,
    TimedModel,
    TreeSpeculativeDecoder,
    cache_length,
    keep_positions,
)
from train.decoding.tree_attention import tree_attention_mask
from train.models.heads import MedusaHeads
from train.models.introspect import cache_keyword
from train.training.rollout import rollout

from .decoding_helpers import build, overlapped, tiny_config

PREFIX = [3, 4, 5, 6, 7]
# a small tree after the prefix: a and b continue the prefix, c continues a
TREE_TOKENS, TREE_PARENTS = [10, 11, 12], [-1, -1, 0]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2"])
def model64(request):
    return build(tiny_config(request.param, 64), 1).double()


def fresh_last(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1]


@torch.no_grad()
def test_tree_forward_equals_sequential_paths_and_kept_path_equals_fresh(model64):
    timed = TimedModel(model64)
    pre = timed(PREFIX, None, logits_to_keep=1)
    n0 = len(PREFIX)
    depths = [1, 1, 2]
    pos = torch.tensor([[n0 - 1 + d for d in depths]])
    out = timed(
        TREE_TOKENS,
        pre.cache,
        position_ids=pos,
        attention_mask=tree_attention_mask(n0, 0, TREE_PARENTS, torch.float64),
        logits_to_keep=None,
    )
    assert out.logits.shape[0] == 3
    for node, path in ((0, [10]), (1, [11]), (2, [10, 12])):
        torch.testing.assert_close(out.logits[node], fresh_last(model64, PREFIX + path), atol=1e-10, rtol=0)
    # accept the path prefix -> b: keep its cache entry, compacted after the prefix
    assert keep_positions(out.cache, [*range(n0), n0 + 1]) == n0 + 1
    assert cache_length(out.cache) == n0 + 1
    nxt = timed([13], out.cache, logits_to_keep=1)
    torch.testing.assert_close(nxt.logits[0], fresh_last(model64, PREFIX + [11, 13]), atol=1e-10, rtol=0)


@torch.no_grad()
def test_logits_to_keep_and_hidden_states(model64):
    timed = TimedModel(model64)
    out = timed(PREFIX, None, logits_to_keep=2, hidden_layers=[0, 2])
    full = model64(torch.tensor([PREFIX]), output_hidden_states=True)
    torch.testing.assert_close(out.logits, full.logits[0, -2:])
    assert set(out.hidden) == {0, 2}
    torch.testing.assert_close(out.hidden[2], full.hidden_states[2][0])
    assert out.seconds > 0
    assert timed(PREFIX, None, logits_to_keep=None).logits.shape[0] == len(PREFIX)


def test_vocab_sizes_and_device(model64):
    timed = TimedModel(model64)
    assert timed.vocab_size == timed.embed_size == 128
    assert timed.device == torch.device("cpu")


@torch.no_grad()
def test_keep_positions_validates():
    model = build(tiny_config("llama", 32), 0)
    cache = TimedModel(model)(PREFIX, None).cache
    with pytest.raises(ValueError, match="strictly increasing"):
        keep_positions(cache, [0, 2, 1])
    with pytest.raises(ValueError, match="lie in"):
        keep_positions(cache, [0, 9])
    assert keep_positions(cache, [0, 1, 2]) == 3 and cache_length(cache) == 3
    assert keep_positions(cache, []) == 0 and cache_length(cache) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_models_are_called_the_way_the_installed_transformers_wants(arch, tiny_pairs, monkeypatch):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old keyword warns with a
    FutureWarning, reading ``out.past_key_values`` logs a deprecation): no decoder and no rollout may
    trigger either."""
    verifier, drafter = tiny_pairs[arch]
    logged: list[str] = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, msg, *a, **k: logged.append(str(msg)))
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    decoders = [
        AutoregressiveDecoder(verifier),
        SpeculativeDecoder(verifier, drafter, gamma=3),
        TreeSpeculativeDecoder(verifier, drafter, method="rsd_c", branching=(2, 2)),
        TreeSpeculativeDecoder(verifier, drafter, method="rsd_s", depth=2, beam_width=2),
        overlapped(verifier, drafter, gamma=3),
        HeadsDecoder(verifier, MedusaHeads.from_verifier(verifier, 2, 1)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for decoder in decoders:
            for params in (SamplingParams(), SamplingParams(temperature=1.0)):
                decoder.generate(ids, 8, params, generator=torch.Generator().manual_seed(0))
        padded = torch.tensor([[0, 0, 5, 9], [3, 4, 5, 6]])
        rollout(verifier, padded, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 4, SamplingParams())
    assert not [m for m in logged if "past_key_values" in m], logged


def test_the_cache_keyword_follows_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None): ...

    class Wrapper(torch.nn.Module):  # a peft-style wrapper: the installed transformers decides
        def forward(self, *args, **kwargs): ...

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Wrapper()) in ("cache", "past_key_values")


def test_a_kwargs_wrapper_speaks_its_wrapped_models_cache_keyword():
    """A timing/logging wrapper (or peft's PeftModel -> LoraModel chain) passes ``**kwargs`` on: the name
    must be the wrapped model's, or the cache is silently dropped (the async law test caught that)."""

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args, **kwargs): ...

    class Peftish(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.base_model = Wrapper(model)

        def forward(self, **kwargs): ...

    assert cache_keyword(Wrapper(Old())) == "past_key_values"
    assert cache_keyword(Peftish(Old())) == "past_key_values"
