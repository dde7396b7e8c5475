"""Evaluation runs on any drafter: ``python scripts/evaluate.py drafter=PATH decoding=sd gamma=4``.

A thin Hydra app over conf/eval.yaml; the work is :func:`train.evaluation.cli.main`.
``python scripts/evaluate.py eval.decoders=[sd,sd_g2]`` compares several decoder configs in one table.
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    from train.evaluation.cli import main as evaluate_main

    evaluate_main(cfg)


if __name__ == "__main__":
    main()
