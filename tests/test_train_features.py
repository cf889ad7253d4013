"""Training stage `extract`: the target's context features on disk, and the disk plan that refuses what cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_support import _direct_features, _pipeline_cfg, _records, _target, _target_dir

from ddtree.errors import ConfigError
from ddtree.train.config import to_train_config
from ddtree.train.features import FeatureShards, extract_features, shard_name

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_extraction_round_trip(tmp_path: Path, model_type: str):
    target = _target(model_type)
    records = _records(7, seed=1)
    layer_ids = [0, 2, 3]
    manifest = extract_features(target, records, layer_ids, tmp_path, shard_size=3, batch_size=2,
                                dtype=torch.float32, log=lambda _: None)
    assert manifest["num_shards"] == 3 and manifest["num_sequences"] == 7
    shards = FeatureShards(tmp_path)
    samples = list(shards)
    assert len(samples) == 7 and shards.target_layer_ids == layer_ids
    assert [s.id for s in samples] != [r["id"] for r in records]  # dealt into shards in a seeded order
    by_id = {s.id: s for s in samples}
    for rec in records:
        s = by_id[rec["id"]]
        assert s.input_ids.tolist() == rec["input_ids"]
        assert [list(x) for x in s.spans] == rec["spans"]
        torch.testing.assert_close(s.features, _direct_features(target, rec["input_ids"], layer_ids),
                                   atol=1e-5, rtol=1e-5)

    # restartable: a missing shard is redone, finished shards are left alone
    kept = (tmp_path / shard_name(0)).stat().st_mtime_ns
    (tmp_path / shard_name(1)).unlink()
    extract_features(target, records, layer_ids, tmp_path, shard_size=3, batch_size=2, dtype=torch.float32,
                     log=lambda _: None)
    assert (tmp_path / shard_name(0)).stat().st_mtime_ns == kept
    torch.testing.assert_close(FeatureShards(tmp_path).load(1)[0].features, samples[3].features)


def test_disk_plan_refuses_an_extraction_that_does_not_fit(tmp_path: Path, capsys):
    """Offline extraction that would not fit is refused before writing, naming features=online."""
    from ddtree.train.pipeline import run

    cfg = _pipeline_cfg(tmp_path, "big", stages=["data", "extract"], **{"tracking.backend": "none",
                                                                         "extract.keep_free_gb": 1e9})
    with pytest.raises(ConfigError, match=r"^features: offline extraction needs .* use features=online"):
        run(to_train_config(cfg))
    assert "B/token" in capsys.readouterr().out  # the plan: bytes per token, total, free space
    assert not list((tmp_path / "big" / "features").glob("shard_*"))
    cfg["features"] = "online"
    run(to_train_config(cfg))  # the suggested fix works: nothing to extract


@pytest.mark.slow
def test_disk_plan_refusal_is_one_line_from_the_cli(tmp_path: Path):
    """python -m ddtree.train: the refusal is one line on stderr, exit 2, no traceback."""
    import subprocess
    import sys

    _pipeline_cfg(tmp_path, "x")  # writes the texts
    out = tmp_path / "big"
    args = [f"out_dir={out}", f"target.name_or_path={_target_dir(tmp_path)}", "data.source=texts",
            f"data.texts={tmp_path / 'texts.jsonl'}", "stages=[data,extract]", "tracking=none", "device=cpu",
            "drafter.target_layer_ids=[1,3]", "extract.keep_free_gb=1e9"]
    p = subprocess.run([sys.executable, "-m", "ddtree.train", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors[0].startswith("error: features: offline extraction needs") and "features=online" in errors[0]
    assert "B/token" in p.stdout and "free" in p.stdout  # the plan, printed before the refusal
    assert not list((out / "features").glob("shard_*"))
