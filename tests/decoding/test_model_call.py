"""The timed model call: explicit positions, a 4-D (tree) mask, logits_to_keep, hidden states; and
``keep_positions`` compacting a tree's accepted path into a contiguous cache."""

from __future__ import annotations

import pytest
import torch

from train.decoding import TimedModel, cache_length, keep_positions
from train.decoding.tree import tree_attention_mask

from .decoding_helpers import build, tiny_config

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
