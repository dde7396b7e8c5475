"""Every drafter and decoder in one table: ``python scripts/leaderboard.py`` (docs/leaderboard.md).

A thin Hydra app over conf/leaderboard.yaml; the work is :func:`train.cli.leaderboard_command.main`.
Trains what is missing first (the newest finished run of each experiment is reused), then evaluates on
one prompt set.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base="1.3", config_path="../conf", config_name="leaderboard")
def main(cfg: DictConfig) -> None:
    # the package (torch, transformers) loads only after Hydra has composed the config: typos fail fast
    from train.cli.console import run_command
    from train.cli.leaderboard_command import main as leaderboard_main

    run_command(leaderboard_main, cfg)


if __name__ == "__main__":
    # checking overrides needs no model code: a typo is reported before torch loads
    from train.cli.console import check_overrides

    sys.argv[1:] = check_overrides(CONF_DIR, "leaderboard", sys.argv[1:])
    main()
