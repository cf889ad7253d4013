"""docs/paper_reference.yaml (the paper's published figures): its format checks, and docs/paper.md
showing exactly the table `python -m ddtree.reference` renders from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline.reference import DEFAULT_REFERENCE, load_reference, reference_markdown
from ddtree.pipeline.schema import REPO_ROOT

DATASETS = {"math500", "gsm8k", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe_bench_lite",
            "mt_bench", "alpaca"}


def test_shipped_reference_covers_the_qwen3_8b_grid_and_docs_show_it():
    ref = load_reference(DEFAULT_REFERENCE)
    keys = set(ref["entries"])
    assert {(m, d, t) for m, d, t in keys if m == "qwen3_8b"} == {("qwen3_8b", d, t) for d in DATASETS
                                                                 for t in (0.0, 1.0)}
    for e in ref["entries"].values():  # nothing is claimed verified that was not read from the paper
        has_value = any(v is not None for m in ("dflash", "ddtree") for v in e[m].values())
        assert e["verified"] is False or has_value
    table = reference_markdown(ref, "qwen3_8b")
    assert table in (REPO_ROOT / "docs" / "paper.md").read_text(), \
        "docs/paper.md is out of date: paste the output of `python -m ddtree.reference` into it"
    printed = subprocess.run([sys.executable, "-m", "ddtree.reference"], capture_output=True, text=True,
                             check=True, cwd=REPO_ROOT).stdout
    assert printed == table


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
