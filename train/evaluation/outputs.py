"""Writing an evaluation's outputs: ``results.json``, the markdown table and the plots."""

from __future__ import annotations

import json
import os
from typing import Any

from train.evaluation.plots import plot_results
from train.evaluation.results import to_jsonable
from train.evaluation.results_table import results_table


def write_outputs(
    results: dict[str, Any], out_dir: str | os.PathLike[str], plots: bool = True
) -> dict[str, Any]:
    """Write results.md, the plots and results.json into ``out_dir``;
    record the file names in ``results["files"]``."""
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, Any] = {"json": "results.json", "table": "results.md", "plots": []}
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(results_table(results))
    if plots:
        files["plots"] = [os.path.basename(p) for p in plot_results(results, out_dir)]
    results["files"] = files
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(to_jsonable(results), f, indent=2, allow_nan=False)
        f.write("\n")
    return files
