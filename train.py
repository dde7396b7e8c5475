"""Hydra entry point: ``python train.py experiment=<name> [overrides]``. See README.md."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from train.run import main as run_main

    run_main(cfg)


if __name__ == "__main__":
    main()
