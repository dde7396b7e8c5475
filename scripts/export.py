"""Push an exported drafter to the Hub: ``python scripts/export.py run=PATH hub.repo_id=me/my-drafter``.

A thin Hydra app over conf/export.yaml; the work is :func:`train.cli.export_command.main`.
``hub.dry_run=true`` loads and checks the folder and lists the files without network access (a corrupt
file is an error naming it). The token comes from ``$HF_TOKEN`` only. Errors print as one line.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    # the package (torch, transformers) loads only after Hydra has composed the config: typos fail fast
    from train.cli.console import run_command
    from train.cli.export_command import main as export_main

    run_command(export_main, cfg)


if __name__ == "__main__":
    # checking overrides needs no model code: a typo is reported before torch loads
    from train.cli.console import check_overrides

    sys.argv[1:] = check_overrides(CONF_DIR, "export", sys.argv[1:])
    main()
