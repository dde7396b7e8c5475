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

    ``block_efficiency_vs_gamma.png`` (runs at two or more gammas): tau against gamma with the
    gamma + 1 ceiling, one curve per drafter and decoder family (configs equal but for gamma, e.g. an
    ``eval.gammas`` sweep or ``sd`` and ``sd_g2``) and temperature; with a single gamma, bars instead
    (``block_efficiency.png``, see :func:`_block_efficiency_bars`). ``per_position_acceptance.png``: one
    panel per temperature, a line per drafter and decoder. Error bars are the std over seeds.
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
    if len(gammas) < 2:  # one gamma: a curve over gamma would be a column of dots
        paths.append(_block_efficiency_bars(plt, runs, temps, out_dir))
        paths.append(_per_position_plot(plt, runs, temps, markers, out_dir))
        return paths
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

    paths.append(_per_position_plot(plt, runs, temps, markers, out_dir))
    return paths


def _block_efficiency_bars(plt: Any, runs: list[dict[str, Any]], temps: list[float], out_dir: Any) -> str:
    """``block_efficiency.png``: one bar per drafter and decoder at each temperature, with the std over
    seeds and the gamma + 1 ceiling of each decoder (for runs that all share one gamma or have none)."""
    labels = list(dict.fromkeys((r["drafter"], r["decoder"]) for r in runs))
    width = 0.8 / max(len(temps), 1)
    fig, ax = plt.subplots(figsize=(max(4.8, 1.1 * len(labels) + 2.0), 4.2))
    for ti, t in enumerate(temps):
        for li, lab in enumerate(labels):
            match = [r for r in runs if (r["drafter"], r["decoder"]) == lab and float(r["temperature"]) == t]
            if not match:
                continue
            tau = match[0]["metrics"]["block_efficiency"]
            x = li + (ti - (len(temps) - 1) / 2) * width
            ax.bar(
                x,
                _nan(tau["mean"]),
                width,
                yerr=_nan(tau["std"]),
                capsize=3,
                color=f"C{ti % 10}",
                label=f"T={temperature_key(t)}" if li == 0 else None,
            )
            if match[0].get("gamma") is not None:
                ax.hlines(
                    int(match[0]["gamma"]) + 1, x - width / 2, x + width / 2, colors="0.4", linestyles="--"
                )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{d}\n{dec}" for d, dec in labels], fontsize=8)
    ax.set_ylabel("block efficiency tau (dashed: ceiling gamma + 1)")
    ax.set_title("Block efficiency (mean ± std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "block_efficiency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_position_plot(
    plt: Any, runs: list[dict[str, Any]], temps: list[float], markers: list[str], out_dir: Any
) -> str:
    """``per_position_acceptance.png``: one panel per temperature, a line per drafter and decoder."""
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
    path = os.path.join(out_dir, "per_position_acceptance.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
