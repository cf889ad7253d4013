"""docs/paper_reference.yaml (the paper's published figures): its format checks, and docs/paper.md
showing exactly the table `python -m ddtree.reference` renders from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline.reference import (
    DEFAULT_REFERENCE,
    comparison_rows,
    load_reference,
    reference_markdown,
    reference_model,
)
from ddtree.pipeline.schema import REPO_ROOT

DATASETS = {"math500", "gsm8k", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe_bench_lite",
            "mt_bench", "alpaca"}


MODELS = {"qwen3_4b", "qwen3_8b", "qwen3_coder_30b_a3b"}


def test_shipped_reference_covers_the_paper_grid_and_docs_show_it():
    ref = load_reference(DEFAULT_REFERENCE)
    assert set(ref["entries"]) == {(m, d, t) for m in MODELS for d in DATASETS for t in (0.0, 1.0)}
    assert "results.tex" in ref["source"]
    for e in ref["entries"].values():  # Table 1 has both numbers of both methods in every cell
        assert e["verified"] is True
        assert all(e[m][k] is not None for m in ("dflash", "ddtree") for k in ("speedup", "tau"))
        assert e["ddtree"]["speedup"] > e["dflash"]["speedup"]  # the paper: DDTree ahead in all 60 entries
    # spot checks against Table 1 (liranringel/ddtree, branch site, src/data/results.tex)
    e = ref["entries"][("qwen3_8b", "gsm8k", 0.0)]
    assert (e["dflash"]["speedup"], e["dflash"]["tau"], e["ddtree"]["speedup"], e["ddtree"]["tau"]) == \
        (4.78, 6.57, 6.75, 9.54)
    e = ref["entries"][("qwen3_coder_30b_a3b", "alpaca", 1.0)]
    assert (e["dflash"]["speedup"], e["ddtree"]["tau"]) == (1.51, 3.51)
    page = (REPO_ROOT / "docs" / "paper.md").read_text()
    printed = subprocess.run([sys.executable, "-m", "ddtree.reference"], capture_output=True, text=True,
                             check=True, cwd=REPO_ROOT).stdout
    assert printed in page, "docs/paper.md is out of date: paste the output of `python -m ddtree.reference` into it"
    for m in MODELS:
        assert f"### {m}" in printed and reference_markdown(ref, m) in printed


def test_a_cell_of_a_hub_id_model_meets_its_reference_entry():
    ref = load_reference(DEFAULT_REFERENCE)
    assert reference_model(ref, "Qwen/Qwen3-8B") == "qwen3_8b"
    assert reference_model(ref, "Qwen3-Coder-30B-A3B-Instruct") == "qwen3_coder_30b_a3b"
    assert reference_model(ref, "toy") == "toy"
    cell = {"model": "Qwen/Qwen3-8B", "dataset": "gsm8k", "temperature": 0.0,
            "dflash": {"speedup": 2.39, "tau": 3.0}, "ddtree_best": None}
    row = next(r for r in comparison_rows(ref, [cell], ["qwen3_8b"]) if r["dataset"] == "gsm8k"
               and r["temperature"] == 0.0)
    assert row["yours_over_paper"]["dflash_speedup"] == pytest.approx(2.39 / 4.78)


@pytest.mark.parametrize("text, msg", [
    ("figures: [", "not valid YAML"),
    ("source: x\n", "no 'figures' list"),
    ("figures:\n  - {model: m, dataset: d}\n", "needs model, temperature and dataset"),
    ("figures:\n  - {model: m, temperature: 0, dataset: d, speedup: 2}\n", "unknown keys"),
    ("figures:\n  - {model: m, temperature: 0, dataset: d, dflash: {speedup: 2, budget: 4}}\n", "takes only"),
    ("figures:\n  - {model: m, temperature: 0, dataset: d, ddtree: {tau: 0}}\n", "positive number"),
    ("figures:\n  - {model: m, temperature: 0, dataset: d}\n  - {model: m, temperature: 0.0, dataset: d}\n",
     "repeats"),
])
def test_bad_reference_files_are_refused(tmp_path, text, msg):
    f = tmp_path / "ref.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=msg) as e:
        load_reference(f)
    assert e.value.setting == "reference"
