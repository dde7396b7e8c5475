"""Turn a DistillSpec multirun directory into the divergence x data source table.

    python train.py -m experiment=distillspec method.divergence=fkl,rkl,jsd,tvd \\
        method.data_source=fixed,verifier,drafter,mixed_verifier
    python scripts/sweep_table.py checkpoints/distillspec/multirun_<timestamp> [--out DIR]

Every run directory below the multirun directory that holds a ``config.yaml`` counts. From each run it
reads the method's divergence and data source (``config.yaml``; a run written before issue 53's names,
``teacher`` / ``student`` / ``mixed_teacher``, under the new ones), the finish step's report
(``report.json``, train/report.py) and the last ``val/expected_acceptance`` (``csv/metrics.csv``). It
prints one Markdown table per figure -- block efficiency after distillation at each evaluated
temperature, the after/before ratio, and the validation expected acceptance -- rows = divergence,
columns = data source, and writes ``sweep_table.md`` and ``sweep_table.json`` (``--out``, default the
multirun dir). Block efficiencies are read at one decoder per run and temperature: ``--decoder LABEL``
(e.g. ``sd@g4``), by default the decoder with the best measured speedup of the distilled drafter.
A run that did not finish shows ``n/a``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from typing import Any

from train.config import RENAMED_VALUES
from train.tables import markdown_table

DIVERGENCE_ORDER = ("fkl", "rkl", "jsd", "tvd")
SOURCE_ORDER = ("fixed", "verifier", "drafter", "mixed_fixed", "mixed_verifier")
#: data source names of runs written before issue 53 -> their names now
OLD_SOURCES = RENAMED_VALUES["train.methods.distillspec.config.DistillSpecConfig"]["data_source"]


def _load_yaml(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # type: ignore[return-value]


def _last_metric(csv_path: str, key: str) -> float | None:
    if not os.path.isfile(csv_path):
        return None
    value = None
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key):
                value = float(row[key])
    return value


def _mean(entry: Any) -> float | None:
    if isinstance(entry, dict):
        entry = entry.get("mean")
    return float(entry) if isinstance(entry, int | float) else None


def block_efficiency(report: dict[str, Any], decoder: str | None = None) -> dict[str, dict[str, Any]]:
    """{temperature: {"before", "after", "decoder"}} from a report: the trained drafter (the first one
    that is not the reference) and the reference, at ``decoder`` or the trained one's best decoder."""
    drafters = report.get("drafters") or {}
    reference = report.get("reference")
    trained = next((name for name in drafters if name != reference), None)
    if trained is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    temps = dict.fromkeys(t for per_t in drafters[trained].values() for t in per_t)
    for t in temps:
        label = decoder or (report.get("best", {}).get(trained, {}).get(t) or {}).get("decoder")
        if label is None or label not in drafters[trained]:
            continue
        out[t] = {
            "decoder": label,
            "after": _mean(drafters[trained][label].get(t, {}).get("block_efficiency")),
            "before": _mean(drafters.get(reference, {}).get(label, {}).get(t, {}).get("block_efficiency")),
        }
    return out


def collect(multirun_dir: str, decoder: str | None = None) -> list[dict[str, Any]]:
    """One record per run directory: divergence, data_source, run_dir and its figures."""
    runs = []
    for root, _dirs, files in sorted(os.walk(multirun_dir)):
        if "config.yaml" not in files or os.path.basename(root) == ".hydra":
            continue
        method = _load_yaml(os.path.join(root, "config.yaml")).get("method", {})
        record: dict[str, Any] = {
            "run_dir": os.path.relpath(root, multirun_dir),
            "divergence": method.get("divergence"),
            "data_source": OLD_SOURCES.get(method.get("data_source"), method.get("data_source")),
            "lmbda": method.get("lmbda"),
            "val_expected_acceptance": _last_metric(
                os.path.join(root, "csv", "metrics.csv"), "val/expected_acceptance"
            ),
            "finished": False,
            "block_efficiency": {},
        }
        report_path = os.path.join(root, "report.json")
        if os.path.isfile(report_path):
            with open(report_path) as f:
                report = json.load(f)
            record["finished"] = "drafters" in report
            record["block_efficiency"] = block_efficiency(report, decoder)
        runs.append(record)
    return runs


def _order(values: set[Any], preferred: tuple[str, ...]) -> list[Any]:
    known = [v for v in preferred if v in values]
    return known + sorted(v for v in values if v not in preferred and v is not None)


def grid(
    runs: list[dict[str, Any]], value: Any
) -> tuple[list[str], list[str], dict[tuple[str, str], float | None]]:
    """(rows, columns, {(divergence, data_source): value(run)})."""
    rows = _order({r["divergence"] for r in runs}, DIVERGENCE_ORDER)
    cols = _order({r["data_source"] for r in runs}, SOURCE_ORDER)
    cells = {(r["divergence"], r["data_source"]): value(r) for r in runs}
    return rows, cols, cells


def markdown(
    title: str,
    rows: list[str],
    cols: list[str],
    cells: dict[tuple[str, str], float | None],
) -> str:
    body = [[r, *(cells.get((r, c)) for c in cols)] for r in rows]
    table = markdown_table(["divergence \\ data source", *cols], body, align="l" + "r" * len(cols))
    return f"**{title}**\n\n{table.rstrip()}"


def tables(runs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The Markdown tables and their JSON form."""
    temps = sorted({t for r in runs for t in r["block_efficiency"]}, key=float)
    figures: list[tuple[str, str, Any]] = []
    for t in temps:
        figures.append(
            (
                f"block_efficiency_after_T{t}",
                f"Block efficiency after distillation, T={t}",
                lambda r, t=t: r["block_efficiency"].get(t, {}).get("after"),
            )
        )
        figures.append(
            (
                f"block_efficiency_ratio_T{t}",
                f"Block efficiency after / before, T={t}",
                lambda r, t=t: _ratio(r["block_efficiency"].get(t, {})),
            )
        )
    figures.append(
        (
            "val_expected_acceptance",
            "Validation expected acceptance (last)",
            lambda r: r["val_expected_acceptance"],
        )
    )
    parts: list[str] = []
    payload: dict[str, Any] = {"runs": runs, "tables": {}}
    for key, title, value in figures:
        rows, cols, cells = grid(runs, value)
        parts.append(markdown(title, rows, cols, cells))
        payload["tables"][key] = {
            "rows": rows,
            "columns": cols,
            "values": [[cells.get((r, c)) for c in cols] for r in rows],
        }
    return "\n\n".join(parts) + "\n", payload


def _ratio(entry: dict[str, Any]) -> float | None:
    a, b = entry.get("after"), entry.get("before")
    return a / b if a is not None and b else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("multirun_dir")
    parser.add_argument(
        "--decoder", default=None, help="decoder label to read (default: each run's best-speedup decoder)"
    )
    parser.add_argument(
        "--out", default=None, help="where sweep_table.md/.json go (default: the multirun dir)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.multirun_dir):
        parser.error(f"no such directory: {args.multirun_dir}")
    found = collect(args.multirun_dir, args.decoder)
    if not found:
        parser.error(f"no run directories (with config.yaml) under {args.multirun_dir}")
    runs = [r for r in found if r["divergence"] is not None and r["data_source"] is not None]
    if not runs:
        parser.error(
            f"{args.multirun_dir} is not a DistillSpec sweep: none of its {len(found)} run directories "
            "has method.divergence and method.data_source (point it at the multirun_<timestamp> folder "
            "of `python train.py -m experiment=distillspec ...`); nothing was written"
        )
    for other in sorted(set(r["run_dir"] for r in found) - set(r["run_dir"] for r in runs)):
        print(f"skipped {other}: not a DistillSpec run", file=sys.stderr)
    text, payload = tables(runs)
    out = args.out or args.multirun_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep_table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "sweep_table.json"), "w") as f:
        json.dump(payload, f, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
