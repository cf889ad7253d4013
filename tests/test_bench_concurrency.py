"""bench/bench_concurrency.py --quick: a smoke test of the script's record (its shape, and that the docs render it),
not of its numbers (docs/concurrency.md: the measured ones come from a quiet machine). About 8 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddtree import docs

ROOT = docs.ROOT
COUNTS = ROOT / "docs" / "bench" / "bench_launches_concurrency.json"


def test_quick_run_writes_a_record_the_docs_render(tmp_path):
    out = tmp_path / "bench_concurrency.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "bench/bench_concurrency.py", "--quick", "--methods", "ar,ddtree:16,ddtree:auto",
                        "--json", str(out), "--counts", str(COUNTS)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["bench"] == "bench_concurrency" and rec["commit"] and rec["machine"] and rec["date"]
    auto = rec["params"]["skipped"] == []  # ddtree:auto runs where ddtree.engine.adaptive exists
    methods = ["ar", "ddtree:16"] + (["ddtree:auto"] if auto else [])
    cs = rec["params"]["concurrency"]
    assert cs == [1, 2]
    got = {(m["method"], m["concurrency"]): m for m in rec["measured"]}
    assert set(got) == {(m, c) for m in methods for c in cs}
    for m in got.values():
        assert m["tok_s"]["median"] > 0 and m["tau"] >= 1.0 and m["prompts"] >= m["concurrency"]
        assert m["latency_median_s"]["median"] <= m["latency_p90_s"]["median"] + 1e-9
    assert got["ar", 1]["tau"] == pytest.approx(1.0, abs=0.2)  # the prefill's token is not a round
    if auto:  # the rule's choices: rounds by option, all runs together
        for c in cs:
            assert sum(got["ddtree:auto", c]["choices"].values()) > 0 and "choices" not in got["ar", c]
    # at c=1: the batched round with one slot and Engine.generate
    assert {g["method"] for g in rec["measured_single"]} == {"ar", "ddtree:16"}
    assert all(g["tok_s"]["median"] > 0 and g["batched_tok_s"]["median"] > 0 for g in rec["measured_single"])
    # the targets: ratios within each run (here one), from every call's own tok/s
    assert all(len(m["tok_s_runs"]) == rec["params"]["runs"] for m in got.values())
    [targets] = [t for t in rec["tables"] if t["title"].startswith("Measured: the issue's targets")]
    cell = {row[0]: row[1] for row in targets["rows"]}
    if auto:
        ratio = got["ddtree:auto", 2]["tok_s_runs"][0] / got["ar", 2]["tok_s_runs"][0]
        assert cell["c=2: auto / AR"]["median"] == pytest.approx(ratio, rel=2e-3)
    g = {g["method"]: g for g in rec["measured_single"]}["ddtree:16"]
    assert cell["c=1: the batched round (one slot) / Engine.generate (DDTree-16)"]["median"] == pytest.approx(
        g["batched_tok_s"]["median"] / g["tok_s"]["median"], rel=2e-3)
    titles = [t["title"] for t in rec["tables"]]
    assert titles[0].startswith("Measured") and any(t.startswith("Predicted") for t in titles)
    pred = rec["predicted"]
    assert {"gpu", "assumptions", "context", "tau", "rows", "counts_from"} <= set(pred)
    assert pred["gpu"]["bandwidth_bytes_s"] > 0 and len(pred["assumptions"]) >= 5
    ns = rec["params"]["predict"]
    for n in ns:  # auto: the best fixed method at each N
        rows = [p for p in pred["rows"] if p["streams"] == n]
        fixed = [p for p in rows if p["method"] != "auto"]
        assert {p["method"] for p in fixed} == {"ar", "ddtree:16"}
        [best] = [p for p in rows if p["method"] == "auto"]
        assert best["tok_s"] == max(p["tok_s"] for p in fixed) and best["chosen"] in {p["label"] for p in fixed}
        for p in fixed:  # N x tau / round
            assert p["tok_s"] == pytest.approx(n * p["tau"] / p["round_ms"] * 1e3, rel=0.01)
    rec["_file"] = out.name
    page = docs.benchmarks_markdown([rec])
    for table in rec["tables"]:
        assert docs.render_table(table) in page
    for block in docs.CONCURRENCY_BLOCKS:
        assert "| method |" in docs.concurrency_markdown(rec, block)


def test_the_plot_is_stale_when_its_record_changes(tmp_path):
    """docs/concurrency.png carries the key of the data it draws: `make docs` redraws it, and --check (the docs test)
    fails, when the record's measured or predicted rows change; nothing is drawn to know."""
    rec = json.loads((ROOT / "docs" / "bench" / docs.CONCURRENCY_RECORD).read_text())
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / docs.CONCURRENCY_PLOT).write_bytes((ROOT / "docs" / docs.CONCURRENCY_PLOT).read_bytes())
    record = tmp_path / "docs" / "bench" / docs.CONCURRENCY_RECORD
    record.write_text(json.dumps(rec))
    assert docs.stale_plots(tmp_path) == []
    rec["measured"][0]["tok_s"]["median"] += 1.0
    record.write_text(json.dumps(rec))
    assert docs.stale_plots(tmp_path) == [tmp_path / "docs" / docs.CONCURRENCY_PLOT]
    (tmp_path / "docs" / docs.CONCURRENCY_PLOT).unlink()
    assert docs.stale_plots(tmp_path) == [tmp_path / "docs" / docs.CONCURRENCY_PLOT]
