"""Where a gated DFlash decoder's blocks go: the shape, its fallback, a plain step or a copy, block by block.

    python scripts/bench.py gate-blocks                                   # the newest DSpark drafter, T = 1
    python scripts/bench.py gate-blocks --dtype float32 --temperature 0   # another regime
    python scripts/bench.py gate-blocks --decoders dflash dflash_lookup   # conf/decoding/<name>.yaml

Each decoder of ``--decoders`` (built from its ``conf/decoding`` file, as the evaluator builds it) and
plain decoding generate ``--tokens`` tokens for each held-out chat prompt, the order alternating per
prompt; the table gives each decoder's speedup over plain decoding in this run (tokens/s over the same
prompts), its block efficiency, the tokens a verifier call checked, the drafter forwards, and how its
plain-step gate chose (:meth:`~train.decoding.draft_gate.DraftGate.choose`): S the shape, f the fallback
(``fallback_cut``), ``.`` a plain step, c a prompt-lookup copy. The sequence of letters shows the
warm-up, the probes and the stretches between them (docs/dflash.md). The step costs come from the cache
of measured costs (measured first, outside the timing, where missing). Set the regime with the
environment as for any float32 measurement (``MKL_ENABLE_INSTRUCTIONS=AVX2 ...``, docs/real_pair.md).
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from research.pairs import checkpoints, load_pair, pair_setup
from train.decoding import AutoregressiveDecoder, SamplingParams
from train.decoding.draft import Draft
from train.decoding.draft_gate import FALLBACK, SHAPE, DraftGate
from train.decoding.proposers.lookup_proposer import PromptLookupProposer
from train.models.dflash_drafter import DFlashDrafter
from train.paths import PROJECT_ROOT
from train.rundir import newest_artifact
from train.tables import markdown_table

LETTERS = {SHAPE: "S", FALLBACK: "f", None: "."}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", default="checkpoints/smollm2", help="the real pair's folder")
    parser.add_argument(
        "--dflash",
        default=None,
        help="a DFlash drafter folder (default: the newest DSpark); 'random': a fresh one (a dry run)",
    )
    parser.add_argument(
        "--decoders", nargs="+", default=["dflash", "dflash_sampled_tree_lookup"], help="conf/decoding names"
    )
    parser.add_argument("--dtype", default="float32", help="the pair's dtype")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=8, help="held-out chat prompts (test split)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)


@contextmanager
def recorded(letters: list[str]) -> Iterator[None]:
    """Every gate decision and every copy appended to ``letters`` while inside."""
    choose, copy = DraftGate.choose, PromptLookupProposer.propose

    def choose_logged(self: DraftGate, regime: object, has_fallback: bool) -> str | None:
        choice = choose(self, regime, has_fallback)
        letters.append(LETTERS[choice])
        return choice

    def copy_logged(self: PromptLookupProposer, *args: Any) -> Draft:
        draft = copy(self, *args)
        if len(draft):
            letters.append("c")
        return draft

    setattr(DraftGate, "choose", choose_logged)  # noqa: B010 (a method replaced while recording)
    setattr(PromptLookupProposer, "propose", copy_logged)  # noqa: B010
    try:
        yield
    finally:
        setattr(DraftGate, "choose", choose)  # noqa: B010
        setattr(PromptLookupProposer, "propose", copy)  # noqa: B010


def build(name: str, verifier: torch.nn.Module, drafter: DFlashDrafter) -> Any:
    """``conf/decoding/<name>.yaml``'s decoder for the pair."""
    return instantiate(OmegaConf.load(PROJECT_ROOT / "conf" / "decoding" / f"{name}.yaml"))(verifier, drafter)


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    setup = replace(pair_setup(args.pair), dtype=args.dtype)
    pair = load_pair(setup, with_drafter=False)
    folder = args.dflash or newest_artifact(checkpoints(), "dspark", None, "dflash")
    if folder is None:
        raise SystemExit("no finished experiment=dspark run under checkpoints/dspark/: pass --dflash")
    if folder == "random":
        drafter = DFlashDrafter.from_verifier(pair.verifier, block_size=4).eval()
    else:
        drafter = DFlashDrafter.from_pretrained(folder).to(pair.dtype).eval()
    decoders = {"plain": AutoregressiveDecoder(pair.verifier)}
    decoders.update({name: build(name, pair.verifier, drafter) for name in args.decoders})
    prompts = setup.prompts(pair.tokenizer, args.prompts, split="test")
    params = SamplingParams(args.temperature)
    for name in args.decoders:  # the costs, measured outside the timing where the cache has none
        decoders[name].generate(prompts[0].reshape(1, -1), 2, params=params)
    seconds = dict.fromkeys(decoders, 0.0)
    totals: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in decoders}
    letters: dict[str, list[str]] = {name: [] for name in decoders}
    for i, prompt in enumerate(prompts):
        for name in list(decoders) if i % 2 == 0 else list(decoders)[::-1]:
            generator = torch.Generator().manual_seed(i)
            with recorded(letters[name]):
                start = time.perf_counter()
                ids = prompt.reshape(1, -1)
                result = decoders[name].generate(ids, args.tokens, params, generator=generator)
                seconds[name] += time.perf_counter() - start
            stats = result.stats
            totals[name].update(
                tokens=len(result.tokens),
                calls=stats.verifier_calls,
                checked=stats.verifier_tokens,
                forwards=stats.drafter_calls,
            )
    plain_rate = totals["plain"]["tokens"] / seconds["plain"]
    rows = []
    for name in args.decoders:
        total, made = totals[name], letters[name]
        rows.append(
            {
                "decoder": name,
                "speedup": round(total["tokens"] / seconds[name] / plain_rate, 3),
                "block_efficiency": round(total["tokens"] / total["calls"], 3),
                "checked_per_call": round(total["checked"] / total["calls"], 2),
                "drafter_forwards": str(total["forwards"]),
                **{f"blocks_{letter}": str(made.count(letter)) for letter in "Sf.c"},
            }
        )
    print(
        f"\n{args.dtype}, T = {args.temperature}, {args.prompts} prompts x {args.tokens} tokens, "
        f"{args.threads} threads; drafter {folder}\n"
    )
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows], "l" + "r" * (len(rows[0]) - 1)))
    for name in args.decoders:
        print(f"\n{name}: {''.join(letters[name])}")
    return rows
