"""Cache correctness: after every crop, cached logits equal a fresh forward over the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from train.decoding import SamplingParams, SpeculativeDecoder
from train.decoding.cache import crop_cache
from train.models.introspect import cache_keyword, returned_cache


class CheckedLM(torch.nn.Module):
    """Wraps a HF causal LM; on every cached call, compares the returned logits with a fresh
    (cache-free) forward over the tokens the cache should hold plus the new ones. It takes the cache
    by its pre-5.24 name, as a model written for older transformers does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.mirror: list[int] = []
        self.checked = 0
        self.max_err = 0.0

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        held = 0 if past_key_values is None else past_key_values.get_seq_length()
        assert held <= len(self.mirror)
        self.mirror = self.mirror[:held] + input_ids[0].tolist()
        out = self.model(
            input_ids=input_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{cache_keyword(self.model): past_key_values},
        )
        assert returned_cache(out).get_seq_length() == len(self.mirror)
        fresh = self.model(input_ids=torch.tensor([self.mirror]), use_cache=False).logits
        k = out.logits.shape[1]
        err = float((out.logits[0] - fresh[0, -k:]).abs().max())
        self.max_err = max(self.max_err, err)
        torch.testing.assert_close(out.logits[0], fresh[0, -k:], atol=1e-4, rtol=1e-4)
        self.checked += 1
        return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.3)], ids=["greedy", "T=0.3"]
)
def test_cached_logits_equal_fresh_forward(tiny_pairs, arch, params):
    verifier, drafter = tiny_pairs[arch]
    cv, cd = CheckedLM(verifier), CheckedLM(drafter)
    ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    res = SpeculativeDecoder(cv, cd, gamma=3).generate(
        ids, 20, params, generator=torch.Generator().manual_seed(0)
    )
    s = res.stats
    assert s.new_tokens == 20
    assert s.accepted < s.drafted  # rejections (and hence crops) happened
    assert cv.checked == s.verifier_calls and cd.checked == s.drafter_calls
    # the committed sequence is what the verifier mirror holds (up to the uncached last token)
    committed = ids[0].tolist() + res.tokens.tolist()
    assert committed[: len(cv.mirror)] == cv.mirror[: len(committed)]


def test_crop_then_extend_equals_fresh(llama_pair):
    verifier, _ = llama_pair
    tokens = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = verifier(input_ids=tokens, use_cache=True)
        cache = returned_cache(out)
        assert isinstance(cache, DynamicCache)
        crop_cache(cache, 8)  # reject the last 4 positions
        assert cache.get_seq_length() == 8
        alt = torch.tensor([[5, 6]])
        cached = verifier(input_ids=alt, use_cache=True, **{cache_keyword(verifier): cache}).logits
        fresh = verifier(input_ids=torch.cat([tokens[:, :8], alt], 1)).logits[:, -2:]
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
