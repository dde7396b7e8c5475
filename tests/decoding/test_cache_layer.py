"""The decoders' cache layer (train/decoding/cache_layer.py): in-place appends into a growing buffer,
rollback by a length, compaction of chosen positions; the same logits as Hugging Face's DynamicLayer,
bit for bit, through any sequence of appends, crops and compactions."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from train.decoding import SamplingParams, SpeculativeDecoder, cache_layer
from train.decoding.cache import crop_cache, decoding_cache, keep_positions
from train.decoding.cache_layer import BufferedLayer
from train.models.introspect import cache_keyword, returned_cache

from .decoding_helpers import hf_greedy


def _script(seed: int, steps: int) -> list[tuple[list[int], str, list[int]]]:
    """Random blocks: (tokens to feed, then "crop" or "keep", the positions kept relative to the block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(steps):
        k = int(torch.randint(1, 6, (1,), generator=gen))
        tokens = torch.randint(2, 128, (k,), generator=gen).tolist()
        if k > 1 and bool(torch.rand(1, generator=gen) < 0.3):  # a scattered subset, as a tree's path
            chosen = sorted(torch.randperm(k, generator=gen)[: int(torch.randint(1, k, (1,), generator=gen))])
            blocks.append((tokens, "keep", [int(i) for i in chosen]))
        else:
            blocks.append((tokens, "crop", list(range(int(torch.randint(0, k + 1, (1,), generator=gen))))))
    return blocks


@torch.no_grad()
def _replay(model: torch.nn.Module, cache: DynamicCache, script) -> list[torch.Tensor]:
    """Prefill, then every block of ``script``; the logits of every forward."""
    kw = cache_keyword(model)
    out = model(input_ids=torch.arange(2, 11)[None], use_cache=True, **{kw: cache})
    logits = [out.logits[0]]
    held = 9
    for tokens, how, kept in script:
        out = model(input_ids=torch.tensor([tokens]), use_cache=True, **{kw: cache})
        assert returned_cache(out) is cache
        logits.append(out.logits[0])
        if how == "keep":
            held = keep_positions(cache, [*range(held), *(held + i for i in kept)], held + len(tokens))
        else:
            crop_cache(cache, held + len(kept), held + len(tokens))
            held += len(kept)
        assert cache.get_seq_length() == held
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_the_buffered_cache_gives_dynamic_layers_logits_bit_for_bit(tiny_pairs, arch, monkeypatch):
    monkeypatch.setattr(cache_layer, "HEADROOM", 1)  # grow often: every reallocation is exercised
    verifier, _ = tiny_pairs[arch]
    script = _script(seed=3, steps=40)
    reference = _replay(verifier, DynamicCache(config=verifier.config), script)
    cache = decoding_cache(verifier)
    assert all(type(layer) is BufferedLayer for layer in cache.layers)
    buffered = _replay(verifier, cache, script)
    assert len(buffered) == len(reference)
    for i, (a, b) in enumerate(zip(buffered, reference, strict=True)):
        assert torch.equal(a, b), f"forward {i}: logits differ by {float((a - b).abs().max())}"


def test_a_rollback_is_a_length_and_appends_write_in_place(llama_pair):
    verifier, _ = llama_pair
    cache = decoding_cache(verifier)
    kw = cache_keyword(verifier)
    with torch.no_grad():
        verifier(input_ids=torch.arange(2, 14)[None], use_cache=True, **{kw: cache})
        layer = cache.layers[0]
        buffer, capacity = layer._key_buffer.data_ptr(), layer.capacity
        assert capacity == 12 + cache_layer.HEADROOM
        crop_cache(cache, 7)
        assert layer.get_seq_length() == 7 and layer.keys.shape[-2] == 7 and layer.values.shape[-2] == 7
        verifier(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True, **{kw: cache})
    assert layer._key_buffer.data_ptr() == buffer and layer.capacity == capacity  # no reallocation
    assert cache.get_seq_length() == 10


def test_the_layer_checks_its_arguments_and_serves_transformers_own_calls():
    layer = BufferedLayer()
    assert layer.get_seq_length() == 0 and layer.keys is None and layer.capacity == 0
    keys = torch.randn(2, 3, 4, 8)
    values = torch.randn(2, 3, 4, 8)
    k, v = layer.update(keys, values)
    assert torch.equal(k, keys) and torch.equal(v, values)
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(2)
    layer.crop(-1)
    assert torch.equal(layer.keys, keys[..., :3, :])
    layer.keep(torch.tensor([0, 2]))
    assert torch.equal(layer.values, values[..., [0, 2], :])
    layer.batch_select_indices(torch.tensor([1]))  # transformers assigns keys / values: the buffer follows
    assert torch.equal(layer.keys, keys[1:, :, [0, 2], :]) and layer.get_seq_length() == 2
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape == (2, 3, 2, 8)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None and not layer.is_initialized


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_decoders_on_the_buffered_cache_equal_hf_greedy(tiny_pairs, arch, monkeypatch):
    monkeypatch.setattr(cache_layer, "HEADROOM", 1)
    verifier, drafter = tiny_pairs[arch]
    ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    res = SpeculativeDecoder(verifier, drafter, gamma=4).generate(ids, 30, SamplingParams())
    assert res.stats.rollbacks > 0  # crops happened
    assert res.tokens.tolist() == hf_greedy(verifier, ids, 30)
