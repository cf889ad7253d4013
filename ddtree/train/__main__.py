"""python -m ddtree.train [experiment=toy] [key=value ...]  — train a DFlash drafter for a target.

Configuration: conf_train/train.yaml (typed by ddtree.train.config.TrainConfig). Rerunning with
the same out_dir resumes: finished stages are skipped, training continues from its last checkpoint.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ddtree.errors import ConfigError
from ddtree.train.config import REPO_ROOT, register, to_train_config

register()


@hydra.main(config_path=str(REPO_ROOT / "conf_train"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ddtree.train.pipeline import run

    try:
        run(to_train_config(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
