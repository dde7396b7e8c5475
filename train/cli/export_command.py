"""``python scripts/export.py run=RUN hub.repo_id=ORG/NAME``: push a run's exported drafter to the Hub
(conf/export.yaml); the work is :func:`train.export.hub.push_to_hub`."""

from __future__ import annotations

from typing import Any

from train.config import instantiate_group, require
from train.export.drafter import drafter_folder
from train.export.hub import HubConfig, push_to_hub


def main(cfg: Any) -> dict[str, Any]:
    """``scripts/export.py``: push a run's exported ``drafter/`` (or any export folder) to the Hub."""
    from omegaconf import OmegaConf

    run = OmegaConf.select(cfg, "run", throw_on_missing=False)
    require(
        isinstance(run, str) and bool(run), "run", "a run directory (with drafter/) or an export folder", run
    )
    hub: HubConfig = instantiate_group(cfg, "hub")
    folder = drafter_folder(run)
    report = push_to_hub(
        folder,
        hub.repo_id,
        private=hub.private,
        dry_run=hub.dry_run,
        commit_message=hub.commit_message,
        revision=hub.revision,
    )
    verb = "Would upload" if hub.dry_run else "Uploaded"
    print(f"{verb} {len(report['files'])} files from {folder} to {hub.repo_id}:")
    for f in report["files"]:
        print(f"  {f}")
    if report["url"]:
        print(report["url"])
    return report
