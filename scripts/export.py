"""Push an exported drafter to the Hub: ``python scripts/export.py run=PATH hub.repo_id=me/my-drafter``.

A thin Hydra app over conf/export.yaml; the work is :func:`train.export.main`. ``hub.dry_run=true``
validates and lists the files without network access. The token comes from ``$HF_TOKEN`` only.
"""

import hydra
from omegaconf import DictConfig

from train.export import main as export_main


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    export_main(cfg)


if __name__ == "__main__":
    main()
