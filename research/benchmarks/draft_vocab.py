"""The cost of a drafter's output head: the full vocabulary against a reduced draft vocabulary.

    python scripts/bench.py draft-vocab     # the SmolLM2 drafter's shape, CPU, 1 thread

A random-weight Llama (hidden 256, 4 layers, intermediate 768, vocabulary 49,152, tied head: the
default drafter of the SmolLM2 pair) decodes one token after a cached 64-token prefix; the cache is
cropped back after every call. Variants, interleaved call by call in a shuffled order, per dtype:

- ``full``: the plain model (``logits_to_keep=1``), the whole head;
- ``draft``: :class:`~train.models.draft_vocab.DraftVocabModel` over ``--draft-vocab`` ids (a random
  sorted subset), full-size logits with ``-inf`` outside (what the decoders get);
- ``draft-reduced``: the same returning the ``(1, 1, N)`` logits only (no scatter into the vocabulary);
- ``sliced-per-call``: the decoder, then the head's rows sliced (``index_select``) at every call, as
  while training (the wrapper keeps the slice between calls when no gradient reaches the weight);
- ``decoder``: the decoder alone, no head.

Reported: the median milliseconds of ``--repeats`` calls and the ratio to ``full``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from train.decoding.cache import crop_cache
from train.models.draft_vocab import DraftVocabModel
from train.models.introspect import cache_keyword, returned_cache
from train.tables import markdown_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="ids in the draft vocabulary")
    parser.add_argument("--prefix", type=int, default=64, help="cached tokens before the timed one")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per variant (median)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def build_drafter(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4 * args.prefix + 64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def variants(model: LlamaForCausalLM, draft_ids: torch.Tensor) -> dict[str, Callable[..., Any]]:
    """{name: call(input_ids, **cache) -> its output} for one model."""
    draft = DraftVocabModel(model, draft_ids)
    reduced = DraftVocabModel(model, draft_ids, full_logits=False)
    weight = model.get_output_embeddings().weight
    decoder = model.get_decoder()

    def sliced_per_call(input_ids: torch.Tensor, **kw: Any) -> Any:
        out = decoder(input_ids=input_ids, use_cache=True, **kw)
        F.linear(out.last_hidden_state[:, -1:], weight.index_select(0, draft_ids))
        return out

    return {
        "full": lambda ids, **kw: model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw),
        "draft": lambda ids, **kw: draft(input_ids=ids, use_cache=True, logits_to_keep=1, **kw),
        "draft-reduced": lambda ids, **kw: reduced(input_ids=ids, use_cache=True, logits_to_keep=1, **kw),
        "sliced-per-call": sliced_per_call,
        "decoder": lambda ids, **kw: decoder(input_ids=ids, use_cache=True, **kw),
    }


@torch.inference_mode()
def head_costs(
    model: LlamaForCausalLM, draft_ids: torch.Tensor, prefix: int, repeats: int, seed: int = 0
) -> dict[str, float]:
    """{variant: median seconds of a one-token forward after a cached ``prefix``}, interleaved."""
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prefix + 1), generator=gen).to(device)
    kw_name = cache_keyword(model)
    calls = variants(model, draft_ids.to(device))
    caches = {name: returned_cache(model(input_ids=prompt[:, :prefix], use_cache=True)) for name in calls}
    times: dict[str, list[float]] = {name: [] for name in calls}
    names, order = list(calls), random.Random(seed)
    for i in range(repeats + 5):  # 5 warm-up rounds; a new order every round, as a call runs in the
        order.shuffle(names)  # CPU caches the previous call left
        for name in names:
            call, cache = calls[name], caches[name]
            start = time.perf_counter()
            call(prompt[:, prefix:], **{kw_name: cache})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 5:
                times[name].append(time.perf_counter() - start)
            crop_cache(cache, prefix, prefix + 1)
    return {name: statistics.median(t) for name, t in times.items()}


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    model = build_drafter(args).to(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    draft_ids = torch.randperm(args.vocab, generator=gen)[: args.draft_vocab].sort().values
    rows: list[dict[str, Any]] = []
    for name in args.dtypes:
        costs = head_costs(model.to(DTYPES[name]), draft_ids, args.prefix, args.repeats, args.seed)
        rows += [
            {"dtype": name, "variant": v, "ms": 1e3 * s, "ratio_to_full": s / costs["full"]}
            for v, s in costs.items()
        ]
    print(
        f"hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab:,}, draft vocabulary "
        f"{args.draft_vocab:,}; one token after {args.prefix} cached, median of {args.repeats}, "
        f"{args.threads} thread(s), {args.device}"
    )
    print(
        markdown_table(
            ["dtype", "variant", "ms / token", "vs full"],
            [[r["dtype"], r["variant"], f"{r['ms']:.3f}", f"{r['ratio_to_full']:.2f}"] for r in rows],
            "llrr",
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            settings = {k: v for k, v in vars(args).items() if not callable(v)}
            json.dump({"args": settings, "rows": rows}, f, indent=2)
    return rows
