"""python -m ddtree.train [experiment=toy] [key=value ...]  — train a DFlash drafter for a target.

Configuration: conf/train.yaml (typed by ddtree.train.config.TrainConfig), with conf/train/experiment/
(`experiment=NAME`, as for python -m ddtree.run; its group's own name train/experiment=NAME works too)
and the tracking group shared with python -m ddtree.run (conf/tracking/). Rerunning with
the same out_dir resumes: finished stages are skipped, training continues from its last checkpoint.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ddtree.errors import ConfigError
from ddtree.train.config import REPO_ROOT, register, to_train_config

register()


@hydra.main(config_path=str(REPO_ROOT / "conf"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ddtree.train.pipeline import run

    try:
        run(to_train_config(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from ddtree.pipeline.console import TRAIN_ALIASES, spell_overrides
    from ddtree.pipeline.distributed import hydra_argv_for_rank, world_from_env

    sys.argv[1:] = hydra_argv_for_rank(spell_overrides(sys.argv[1:], TRAIN_ALIASES), world_from_env())  # torchrun ranks > 0: Hydra output to scratch
    main()
