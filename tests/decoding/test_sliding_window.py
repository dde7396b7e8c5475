"""Sliding-window models (Qwen3 with ``use_sliding_window``, Mistral) decoded past their window.

Hugging Face's sliding-window cache layers drop what leaves the window, so the first rollback past it
used to raise in ``crop``. The engine gives such models full-length cache layers and applies the
window through the attention mask (``decoding_cache``, ``sliding_window_mask``): tree logits equal a
fresh forward along each path, and every decoder's greedy output equals HF ``generate`` well past a
window of 8.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen3Config

from train.decoding import (
    AutoregressiveDecoder,
    HeadsDecoder,
    SpeculativeDecoder,
    TimedModel,
    TreeSpeculativeDecoder,
    cache_length,
    crop_cache,
    keep_positions,
)
from train.decoding.cache import decoding_cache, sliding_layout
from train.decoding.cache_layer import BufferedLayer
from train.decoding.tree_attention import tree_attention_mask
from train.models.heads import MedusaHeads

from .decoding_helpers import BOS, EOS, VOCAB, build, hf_greedy, overlapped, tiny_config

WINDOW = 8


def sliding_config(arch: str, hidden: int):
    """Two layers, window 8: Qwen3 with layer 0 full and layer 1 sliding; Mistral with both sliding."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 256,
        "sliding_window": WINDOW,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": BOS,
    }
    if arch == "qwen3":
        return Qwen3Config(use_sliding_window=True, max_window_layers=1, **common)
    return MistralConfig(**common)


@pytest.fixture(scope="module", params=["qwen3", "mistral"])
def sliding_pair(request):
    return build(sliding_config(request.param, 64), 1), build(sliding_config(request.param, 32), 2)


def test_the_models_really_slide(sliding_pair):
    verifier, _ = sliding_pair
    assert verifier.config.sliding_window == WINDOW
    layout = sliding_layout(verifier)
    assert layout is not None and layout.window == WINDOW
    assert layout.mixed == (verifier.config.model_type == "qwen3")
    # the window matters: the last logits of a long sequence differ from those of a full-attention twin
    tokens = torch.tensor([list(range(2, 40))])
    with torch.no_grad():
        slid = verifier(tokens).logits[0, -1]
        verifier.config.sliding_window = 10_000
        try:
            full = verifier(tokens).logits[0, -1]
        finally:
            verifier.config.sliding_window = WINDOW
    assert not torch.allclose(slid, full)
    for arch in ("llama", "qwen3", "gpt2"):  # no window (Qwen3's sliding_window is unused by default)
        plain = build(tiny_config(arch, 32), 0)
        assert sliding_layout(plain) is None
        assert all(type(layer) is BufferedLayer for layer in decoding_cache(plain).layers)


@torch.no_grad()
def test_the_cache_can_be_cropped_past_the_window(sliding_pair):
    verifier, _ = sliding_pair
    timed = TimedModel(verifier)
    out = timed(list(range(2, 30)), None)
    assert cache_length(out.cache) == 28
    crop_cache(out.cache, 20)
    nxt = timed([50], out.cache, logits_to_keep=1)
    torch.testing.assert_close(nxt.logits[0], verifier(torch.tensor([[*range(2, 22), 50]])).logits[0, -1])


@torch.no_grad()
def test_tree_forward_past_the_window_equals_sequential_paths():
    model = build(sliding_config("qwen3", 64), 1).double()
    prefix = list(range(2, 16))  # 14 > the window
    tokens, parents = [40, 41, 42, 43, 44, 45], [-1, -1, 0, 2, 3, 4]  # a 5-deep path and a leaf
    timed = TimedModel(model)
    pre = timed(prefix, None)
    n0 = len(prefix)
    depths = [1, 1, 2, 3, 4, 5]
    out = timed(
        tokens,
        pre.cache,
        position_ids=torch.tensor([[n0 - 1 + d for d in depths]]),
        attention_mask=tree_attention_mask(n0, 0, parents, torch.float64),
        logits_to_keep=None,
    )
    paths = {0: [40], 1: [41], 2: [40, 42], 3: [40, 42, 43], 4: [40, 42, 43, 44], 5: [40, 42, 43, 44, 45]}
    for node, path in paths.items():
        fresh = model(torch.tensor([prefix + path])).logits[0, -1]
        torch.testing.assert_close(out.logits[node], fresh, atol=1e-10, rtol=0)
    assert keep_positions(out.cache, [*range(n0), n0, n0 + 2, n0 + 3]) == n0 + 3
    nxt = timed([50], out.cache)
    fresh = model(torch.tensor([[*prefix, 40, 42, 43, 50]])).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0], fresh, atol=1e-10, rtol=0)


def decoders(verifier, drafter):
    heads = MedusaHeads.from_verifier(verifier, 3, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {
        "ar": AutoregressiveDecoder(verifier),
        "sd": SpeculativeDecoder(verifier, drafter, gamma=4),
        "specinfer": TreeSpeculativeDecoder(verifier, drafter, method="specinfer", branching=(2, 2, 1)),
        "rsd_c": TreeSpeculativeDecoder(verifier, drafter, method="rsd_c", branching=(2, 2, 1)),
        "rsd_s": TreeSpeculativeDecoder(verifier, drafter, method="rsd_s", depth=3, beam_width=3),
        "async": overlapped(verifier, drafter, gamma=4),
        "medusa": HeadsDecoder(verifier, heads),
    }


def test_greedy_equals_hf_generate_well_past_the_window(sliding_pair):
    verifier, drafter = sliding_pair
    for prompt, n in (([0, 5, 9, 17, 3], 40), (list(range(20, 32)), 30)):
        ids = torch.tensor([prompt])
        reference = hf_greedy(verifier, ids, n)
        for name, decoder in decoders(verifier, drafter).items():
            result = decoder.generate(ids, n)
            assert result.tokens.tolist() == reference, name
            if name in ("sd", "specinfer", "rsd_c", "rsd_s"):
                assert result.stats.rollbacks > 0, name  # the path that used to raise was taken
