"""Hydra entry point: ``python train.py experiment=<name> [overrides]``. See README.md.

Errors a user can fix print as one line (``HYDRA_FULL_ERROR=1`` shows the traceback): train/cli/console.py.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    # the package (torch, transformers) loads only after Hydra has composed the config: typos fail fast
    from train.cli.console import run_command
    from train.cli.train_command import main as run_main

    run_command(run_main, cfg)


if __name__ == "__main__":
    # checking overrides needs no model code: a typo is reported before torch loads
    from train.cli.console import check_overrides

    sys.argv[1:] = check_overrides(CONF_DIR, "train", sys.argv[1:])
    main()
