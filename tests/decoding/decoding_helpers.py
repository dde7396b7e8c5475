"""Shared helpers for tests/decoding: tiny HF configs and table-driven fake models."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config

VOCAB = 128
BOS, EOS = 0, 1


def tiny_config(arch: str, hidden: int = 64, vocab: int = VOCAB, layers: int = 2, max_pos: int = 256):
    common = {"vocab_size": vocab, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": BOS}
    if arch == "llama":
        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_pos,
            **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=max_pos,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_pos, **common)
    raise ValueError(arch)


def hf_greedy(model, ids: torch.Tensor, n: int, eos=None) -> list[int]:
    """Hugging Face ``generate(do_sample=False)``: the reference greedy continuation (new tokens only)."""
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return out[0, ids.shape[1] :].tolist()


def build(config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


# ---------------------------------------------------------------- fake models with fixed logits


class FakeCache:
    """DynamicCache-compatible stand-in: remembers the tokens it holds; ``crop(-n)`` drops the last n."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def crop(self, n: int) -> None:
        del self.tokens[n if n < 0 else n :]


class TableLM(torch.nn.Module):
    """Fake causal LM: logits at position t = table[token_t] + pos_bias[t % P].

    table: (V, V) logits indexed by the current token; pos_bias: (P, V). The next-token distribution
    depends on the last token and its absolute position, so a wrong cache length changes the output.
    """

    def __init__(self, table: torch.Tensor, pos_bias: torch.Tensor | None = None, max_pos: int = 512) -> None:
        super().__init__()
        self.table = table.float()
        self.pos_bias = torch.zeros(1, table.shape[1]) if pos_bias is None else pos_bias.float()
        self.config = SimpleNamespace(vocab_size=table.shape[1], max_position_embeddings=max_pos)
        self.calls = 0

    def forward(self, input_ids, past_key_values=None, use_cache=True, **kwargs):
        cache = FakeCache() if past_key_values is None else past_key_values
        start = cache.get_seq_length()
        ids = input_ids[0].tolist()
        cache.tokens.extend(ids)
        pos = torch.arange(start, start + len(ids)) % self.pos_bias.shape[0]
        logits = self.table[input_ids[0]] + self.pos_bias[pos]
        self.calls += 1
        return SimpleNamespace(logits=logits[None], past_key_values=cache)

    def next_logits(self, prefix: list[int]) -> torch.Tensor:
        """Logits for the token after ``prefix`` (reference, no cache)."""
        t = len(prefix) - 1
        return self.table[prefix[-1]] + self.pos_bias[t % self.pos_bias.shape[0]]


def random_table_lm(vocab: int, seed: int, scale: float = 1.5, positions: int = 3) -> TableLM:
    g = torch.Generator().manual_seed(seed)
    return TableLM(
        torch.randn(vocab, vocab, generator=g) * scale, torch.randn(positions, vocab, generator=g) * scale
    )


def overlapped(verifier: torch.nn.Module, drafter: torch.nn.Module, **kwargs):
    """The asynchronous decoder with its schedule always on (``overlap="always"``): the schedule these
    tests test, whatever the machine's costs would choose."""
    from train.decoding import AsyncSpeculativeDecoder

    return AsyncSpeculativeDecoder(verifier, drafter, overlap="always", **kwargs)


def count_shapes(monkeypatch, proposer: type) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Count ``proposer``'s shapes (``propose``: its tree) and its fallback chains (``propose_chain``,
    drafted or not) from here on, for a decoder built after this call (it binds the chain's propose)."""
    counts = {"tree": 0, "chain": 0, "chain_drafted": 0}
    tree, chain = proposer.propose, proposer.propose_chain

    def count_tree(self, *args):  # type: ignore[no-untyped-def]
        counts["tree"] += 1
        return tree(self, *args)

    def count_chain(self, *args):  # type: ignore[no-untyped-def]
        draft = chain(self, *args)
        counts["chain"] += 1
        counts["chain_drafted"] += bool(draft.tokens)
        return draft

    monkeypatch.setattr(proposer, "propose", count_tree)
    monkeypatch.setattr(proposer, "propose_chain", count_chain)
    return counts
