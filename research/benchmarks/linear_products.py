"""The verifier's linear products alone, per row count, computed each way a check could compute them.

    python scripts/bench.py linear-products                               # the real pair, float32
    python scripts/bench.py linear-products --rows 1 2 4 8 --rounds 7     # choose the row counts
    python scripts/bench.py linear-products --pair random --rows 1 2      # the random-weight pair

A check of k drafted tokens feeds the verifier k + 1 rows, and in float32 on a CPU its cost is the
linear layers' (docs/decoding.md, "What a check costs"). This times one forward's worth of them, every
decoder layer's projections in order and the output head over every row, with nothing else around
them, for each way of computing a product:

- ``library``: ``F.linear``, as torch ships it;
- ``streamed``: ``weight @ rows.T`` (:func:`train.models.streamed_linear.streamed_linear`);
- ``fused``: ``F.linear`` with q/k/v and gate/up concatenated (4 products a layer where there were 7:
  fewer, larger calls, the same bytes);
- ``transposed``: ``rows @ weight_t``, the weight stored transposed once (MKL's other operand layout);
- ``vectors``: one matrix-vector product per row (each row reads the weight again, from cache if it fits);
- ``chunked``: the weight in blocks of 512 output rows, each block multiplied by the rows in groups of
  at most 3 (the counts the library is fast at) while it is still in cache.

Rounds interleave the variants; the figure is the median over rounds after one warm-up round. Weights
are the model's own (``fused`` and ``transposed`` hold a copy of theirs for the run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from research.pairs import load_pair, pair_setup, random_pair
from train.models.streamed_linear import streamed_linear
from train.tables import markdown_table

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows (n, in), weight (out, in)) -> (n, out)."""

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections that read the same input, fused by ``fused``."""
CHUNK_ROWS, GROUP_ROWS = 512, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", default="checkpoints/smollm2", help="a pair folder, or 'random'")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8], help="row counts")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=2)


def _vectors(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.mv(w, row) for row in x])


def _chunked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= GROUP_ROWS:
        return F.linear(x, w)
    groups = torch.split(x, GROUP_ROWS)
    blocks = [torch.cat([F.linear(g, block) for g in groups]) for block in torch.split(w, CHUNK_ROWS)]
    return torch.cat(blocks, dim=1)


def layer_weights(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """Per decoder layer, its linear layers' (name, weight) in the order the forward calls them."""
    layers = model.get_decoder().layers  # type: ignore[operator]
    return [
        [
            (name.rsplit(".", 1)[-1], m.weight.detach())
            for name, m in layer.named_modules()
            if type(m) is torch.nn.Linear
        ]
        for layer in layers
    ]


def fuse(layer: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The layer's products with each group of :data:`FUSED_GROUPS` it has concatenated into one."""
    weights = dict(layer)
    out: list[tuple[str, torch.Tensor]] = []
    done: set[str] = set()
    for name, w in layer:
        if name in done:
            continue
        group = next((g for g in FUSED_GROUPS if name in g and all(n in weights for n in g)), None)
        if group is None:
            out.append((name, w))
            continue
        out.append(("+".join(group), torch.cat([weights[n] for n in group])))
        done.update(group)
    return out


@dataclass(frozen=True)
class Variant:
    """One way of computing a forward's products: its weights (copies where it needs another layout or
    fused weights), its product, and which weight dimension is the input's width."""

    layers: list[list[tuple[str, torch.Tensor]]]
    head: torch.Tensor
    product: Product
    input_dim: int = 1

    def seconds(self, rows: int) -> float:
        """Every layer's products and the head over ``rows`` rows (the inputs made outside the timing)."""
        dim = self.input_dim
        widths = {w.shape[dim] for layer in self.layers for _, w in layer} | {self.head.shape[dim]}
        inputs = {n: torch.randn(rows, n, dtype=self.head.dtype) for n in widths}
        start = time.perf_counter()
        for layer in self.layers:
            for _, w in layer:
                self.product(inputs[w.shape[dim]], w)
        self.product(inputs[self.head.shape[dim]], self.head)
        return time.perf_counter() - start


def variants(layers: list[list[tuple[str, torch.Tensor]]], head: torch.Tensor) -> dict[str, Variant]:
    """Every variant of the module docstring over the model's weights."""
    transposed = [[(n, w.t().contiguous()) for n, w in layer] for layer in layers]
    return {
        "library": Variant(layers, head, F.linear),
        "streamed": Variant(layers, head, lambda x, w: streamed_linear(x, w, None)),
        "fused": Variant([fuse(layer) for layer in layers], head, F.linear),
        # the weight stored (in, out): the product is rows @ weight_t
        "transposed": Variant(transposed, head.t().contiguous(), torch.mm, input_dim=0),
        "vectors": Variant(layers, head, _vectors),
        "chunked": Variant(layers, head, _chunked),
    }


def _verifier(args: argparse.Namespace) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.pair == "random":
        return random_pair()[0].to(dtype)
    setup = pair_setup(args.pair)
    setup = type(setup)(**{**setup.__dict__, "dtype": args.dtype})
    return load_pair(setup, with_drafter=False).verifier


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    verifier = _verifier(args)
    layers = layer_weights(verifier)
    head = verifier.get_output_embeddings().weight.detach()  # type: ignore[operator]
    table = variants(layers, head)
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):
            for rows in args.rows:
                for name, variant in table.items():
                    if name == "vectors" and rows > 4:
                        continue  # one pass over the weights per row: past 4 it only grows
                    seconds = variant.seconds(rows)
                    if round_:
                        times.setdefault((name, rows), []).append(seconds)
    one = statistics.median(times[("library", 1)])
    result = {
        name: {rows: statistics.median(times[(name, rows)]) for rows in args.rows if (name, rows) in times}
        for name in table
    }
    products = sum(len(layer) for layer in layers) + 1
    print(
        f"\nOne forward's linear products ({products} a forward: {len(layers)} layers and the head), "
        f"{args.dtype}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"ms, and per the library's one-row forward, median of {args.rounds} rounds:\n"
    )
    header = ["variant", *(f"n = {rows}" for rows in args.rows)]
    cells = [
        [name, *(f"{1000 * t[rows]:.1f} ({t[rows] / one:.2f})" if rows in t else "-" for rows in args.rows)]
        for name, t in result.items()
    ]
    print(markdown_table(header, cells))
    return {name: {str(rows): t for rows, t in per.items()} for name, per in result.items()}
