"""Training stage `eval` and the whole pipeline's config: the acceptance curve in MLflow, the drafter in the run pipeline, one-line config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from train_support import _history, _pipeline_cfg, _target_dir

from ddtree.errors import ConfigError
from ddtree.train.config import to_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_acceptance_curve_in_mlflow_and_the_drafter_loads_in_the_run_pipeline(tmp_path: Path):
    """Every eval.every steps: DFlash and DDTree tau and tok/s in MLflow beside the loss; best checkpoint by tau."""
    from ddtree.train.pipeline import run

    run(to_train_config(_pipeline_cfg(tmp_path, "curve", features="online", **{"optim.log_every": 3})))
    assert [s for s, _ in _history(tmp_path, "curve", "train/loss")] == [3, 6]
    tau = _history(tmp_path, "curve", "curve/ddtree_4.tau")
    assert [s for s, _ in tau] == [3, 6] and [s for s, _ in _history(tmp_path, "curve", "curve/dflash.tau")] == [3, 6]
    assert len(_history(tmp_path, "curve", "curve/ddtree_4.tokens_per_s")) == 2
    best = json.loads((tmp_path / "curve" / "checkpoints" / "best.json").read_text())
    assert best["step"] == max(tau, key=lambda t: (t[1], -t[0]))[0]
    assert (tmp_path / "curve" / "checkpoints" / best["path"] / "model.safetensors").exists()

    # the drafter's config carries what the run pipeline needs: it loads with no drafter override
    from ddtree.pipeline.models import load_drafter, load_target
    from ddtree.pipeline.schema import to_run_config

    rc = to_run_config(OmegaConf.create({"model": {"name": "mine", "name_or_path": str(_target_dir(tmp_path))},
                                         "drafter": {"kind": "pretrained",
                                                     "name_or_path": str(tmp_path / "curve" / "drafter")}}))
    target, _ = load_target(rc, "cpu")
    drafter = load_drafter(rc, target, "cpu")
    assert (drafter.block_size, drafter.target_layer_ids, drafter.mask_token_id) == (4, [1, 3], 7)


def test_config_errors_name_the_setting(tmp_path: Path):
    with pytest.raises(ConfigError, match="target.name_or_path"):
        to_train_config({"out_dir": str(tmp_path)})
    base = {"out_dir": str(tmp_path), "target": {"name_or_path": "x"}, "data": {"source": "texts"}}
    with pytest.raises(ConfigError, match="data.texts"):
        to_train_config(base)
    with pytest.raises(ConfigError, match="stages"):
        to_train_config({**base, "stages": ["extract", "fly"]})
    with pytest.raises(ConfigError, match="optim.nope"):
        to_train_config({**base, "stages": ["train"], "optim": {"nope": 1}})
    cfg = to_train_config({**base, "stages": ["train"], "drafter": {"block_size": 8}})
    assert cfg.drafter.block_size == 8


def test_hydra_config_composes():
    from hydra import compose, initialize_config_dir

    from ddtree.train.config import REPO_ROOT, register

    register()
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        for overrides in (["target.name_or_path=x", "tracking=none"], ["train/experiment=toy"]):
            cfg = compose("train", overrides=overrides)
            tc = to_train_config({k: v for k, v in cfg.items() if k != "hydra"} | {"stages": ["train"]})
            assert tc.out_dir and tc.tracking.experiment == "ddtree-train"  # the shared group, train's experiment
