"""The two evaluation plots: block efficiency vs gamma, and per-position acceptance."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from train.evaluation.results import temperature_key

__all__ = ["plot_results"]


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


def _family(run: Mapping[str, Any]) -> tuple[str, str]:
    """Runs whose decoder configs differ only in gamma share a curve: (drafter, settings without gamma)."""
    settings = {k: v for k, v in run["decoder_config"].items() if k != "gamma"}
    return run["drafter"], repr(sorted(settings.items(), key=lambda kv: kv[0]))


def plot_results(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> list[str]:
    """Two PNGs in ``out_dir``; returns their paths.

    ``block_efficiency_vs_gamma.png``: tau against gamma with the gamma + 1 ceiling, one curve per
    drafter and decoder family (configs equal but for gamma, e.g. an ``eval.gammas`` sweep or
    ``sd`` and ``sd_g2``) and temperature. ``per_position_acceptance.png``: one panel per
    temperature, a line per drafter and decoder. Error bars are the std over seeds.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = list(results["runs"])
    temps = sorted({float(r["temperature"]) for r in runs})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    paths = []

    families: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("gamma") is not None:
            families.setdefault(_family(r), []).append(r)
    gammas = sorted({int(r["gamma"]) for r in runs if r.get("gamma") is not None})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if gammas:
        ax.plot(
            gammas,
            [g + 1 for g in gammas],
            color="0.5",
            ls="--",
            marker="_",
            ms=18,
            lw=1,
            label="ceiling gamma + 1",
        )
    for fi, (fam, members) in enumerate(families.items()):
        names = "+".join(dict.fromkeys(m["decoder"].split("@", 1)[0] for m in members))
        for ti, t in enumerate(temps):
            pts = sorted(
                (
                    int(r["gamma"]),
                    _nan(r["metrics"]["block_efficiency"]["mean"]),
                    _nan(r["metrics"]["block_efficiency"]["std"]),
                )
                for r in members
                if float(r["temperature"]) == t
            )
            if pts:
                ax.errorbar(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    yerr=[p[2] for p in pts],
                    color=f"C{fi % 10}",
                    ls=styles[ti % len(styles)],
                    marker=markers[ti % len(markers)],
                    capsize=3,
                    label=f"{fam[0]} ({names}) T={temperature_key(t)}",
                )
    ax.set_xlabel("gamma (draft tokens per block)")
    ax.set_ylabel("block efficiency tau")
    if gammas:
        ax.set_xticks(gammas)
    ax.set_ylim(bottom=0.9)
    ax.set_title("Block efficiency vs gamma (mean ± std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "block_efficiency_vs_gamma.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    labels = list(dict.fromkeys((r["drafter"], r["decoder"]) for r in runs))
    colour = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps) + 0.8, 4.0), sharey=True, squeeze=False)
    depth = 1
    for ax, t in zip(axes[0], temps, strict=True):
        for r in runs:
            pp = r["metrics"].get("per_position_acceptance")
            if float(r["temperature"]) != t or not pp or not pp["mean"]:
                continue
            lab = (r["drafter"], r["decoder"])
            ys = [_nan(v) for v in pp["mean"]]
            depth = max(depth, len(ys))
            ax.errorbar(
                range(1, len(ys) + 1),
                ys,
                yerr=[_nan(v) for v in pp["std"]],
                color=colour[lab],
                marker=markers[labels.index(lab) % len(markers)],
                capsize=3,
                label=f"{lab[0]} ({lab[1]})",
            )
        ax.set_title(f"T = {temperature_key(t)}")
        ax.set_xlabel("draft position i")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    for ax in axes[0]:
        ax.set_xticks(range(1, depth + 1))
    axes[0][0].set_ylabel("P(position i accepted | earlier accepted)")
    fig.suptitle("Per-position acceptance (mean ± std over seeds)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "per_position_acceptance.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
