"""Evaluation runs on any drafter: ``python scripts/evaluate.py drafter=PATH decoding=sd gamma=4``.

A thin Hydra app over conf/eval.yaml; the work is :func:`train.cli.evaluate_command.main`.
``python scripts/evaluate.py eval.decoders=[sd,sd_g2]`` compares several decoder configs in one table.
Errors a user can fix print as one line (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    # the package (torch, transformers) loads only after Hydra has composed the config: typos fail fast
    from train.cli.console import run_command
    from train.cli.evaluate_command import main as evaluate_main

    run_command(evaluate_main, cfg)


if __name__ == "__main__":
    # checking overrides needs no model code: a typo is reported before torch loads
    from train.cli.console import check_overrides

    sys.argv[1:] = check_overrides(CONF_DIR, "eval", sys.argv[1:])
    main()
