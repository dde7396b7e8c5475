"""The Medusa section of a run report: per-head top-k accuracy and the tree built from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from train.tables import format_value, markdown_table


def heads_section(
    metrics: Mapping[str, float],
    tree: Sequence[Sequence[int]] | None,
    rank_accuracy: Sequence[Sequence[float]] = (),
    note: str | None = None,
) -> str:
    """The Markdown section of a prediction-heads run (Medusa): each head's last validation figures,
    the simulated block efficiency and the tree built from the measured per-rank accuracies."""
    heads = sorted({int(k.split("/head")[1].split("_")[0]) for k in metrics if k.startswith("val/head")})
    rows = [
        [
            str(k),
            f"t+{k + 2}",
            format_value(metrics.get(f"val/head{k}_top1"), 3),
            format_value(metrics.get(f"val/head{k}_top5"), 3),
            format_value(metrics.get(f"val/head{k}_agree"), 3),
            ", ".join(format_value(a, 2) for a in rank_accuracy[k][:5]) if k < len(rank_accuracy) else "",
        ]
        for k in heads
    ]
    table = markdown_table(
        ["head", "predicts", "top1", "top5", "agrees with verifier", "rank 0..4 = verifier"], rows, "llrrrl"
    )
    tau = metrics.get("val/simulated_block_efficiency")
    parts = [
        "## Heads (last validation)",
        table.rstrip(),
        "top1 / top5: the head's top guesses against the corpus token it predicts; agrees: its top-1 equals "
        "the verifier's argmax for that token; rank r = verifier: how often its r-th guess is. Simulated "
        "block efficiency of the blockwise top-1 chain (1 + leading heads agreeing, teacher-forced on "
        f"corpus prefixes): {format_value(tau, 2)}.",
    ]
    if tree:
        parts.append(
            f"Tree saved with the heads ({len(tree)} nodes, depth {max(len(p) for p in tree)}; "
            "built from the per-rank accuracies, the largest expected accepted length of its size): "
            f"`{[list(p) for p in tree]}`"
        )
    if note:
        parts.append(note)
    return "\n\n".join(parts)
