"""`python -m ddtree.report` end to end on one small sweep made by the real CLI (tiny Qwen3, built-in
prompts, a temporary SQLite store): table numbers against each job's summary.json, non-empty PNGs,
and the runs it used and skipped (unfinished, mismatched settings) or left out by the filters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline.report import ReportConfig, ReportTracking, make_report
from ddtree.pipeline.sweep_table import verdict_cell

SWEEP = ("model=tiny_qwen3", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "warmup=false",
         "temperature=0,1", "method=dflash,ddtree", "budget=4,8", "+tags.experiment=tiny_grid")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": ""}


def _py(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _clone(client, run, *, status: str, params: dict | None = None, tags: dict | None = None,
           summary: dict | None = None, tmp: Path) -> str:
    """A copy of a real job's run with some settings changed (what a crashed or differently-set job leaves)."""
    from mlflow.entities import Param

    p = {**run.data.params, **(params or {})}
    t = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.") or k == "mlflow.parentRunId"}
    new = client.create_run(run.info.experiment_id, run_name=run.info.run_name, tags={**t, **(tags or {})})
    client.log_batch(new.info.run_id, params=[Param(k, v) for k, v in p.items()])
    for k, v in run.data.metrics.items():
        client.log_metric(new.info.run_id, k, v)
    if summary is not None:
        f = tmp / new.info.run_id / "summary.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(summary))
        client.log_artifact(new.info.run_id, str(f))
    if status != "RUNNING":
        client.set_terminated(new.info.run_id, status)
    return new.info.run_id


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """One sweep: T in {0, 1} x {DFlash, DDTree at budgets 4 and 8} (DFlash runs once per temperature),
    plus an unfinished run, a run with other settings, and a run of another experiment."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("grid")
    uri = f"sqlite:///{root}/store/mlflow.db"
    sweep = root / "multirun" / "2026-01-02" / "03-04-05"
    out = _py("ddtree.run", *SWEEP, f"runs_dir={root}/runs", f"tracking.uri={uri}", f"hydra.sweep.dir={sweep}", "-m",
              cwd=root).stdout
    # DFlash at budget 8: the same job as at budget 4 (the job's line; the sweep table notes it too)
    assert sum(ln.startswith("skipped: same job as") for ln in out.splitlines()) == 2
    summaries = {}
    for f in sweep.glob("*/summary.json"):
        s = json.loads(f.read_text())
        summaries[(s["temperature"], s["method"], s["budget"])] = s
    assert len(summaries) == 6

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddtree")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    job = next(r for r in runs.values() if r.data.params.get("budget") == "4" and r.data.params["method"] == "ddtree"
               and r.data.params["temperature"] == "0.0")
    s = summaries[(0.0, "ddtree", 4)]
    extra = {
        "unfinished": _clone(client, job, status="RUNNING", tmp=root),
        "failed": _clone(client, job, status="FAILED", tmp=root),
        "mismatched": _clone(client, job, status="FINISHED", params={"max_new_tokens": "16"},
                             summary={**s, "speedup": 99.0}, tmp=root),
        "other_experiment": _clone(client, job, status="FINISHED", tags={"experiment": "other"},
                                   summary={**s, "speedup": 98.0}, tmp=root),
    }
    return {"root": root, "uri": uri, "sweep": sweep, "summaries": summaries, "extra": extra, "runs": runs}


def _md_rows(md: str) -> dict[tuple[float, str], list[str]]:
    """(temperature, dataset) -> cells of the speedup/tau table rows in report.md."""
    rows, temp = {}, None
    for line in md.split("## Runs used")[0].splitlines():
        m = re.match(r"### Temperature (\S+)", line)
        if m:
            temp = float(m.group(1))
        elif temp is not None and line.startswith("| tiny |"):
            rows[(temp, "tiny")] = [c.strip() for c in line.strip("|").split("|")]
    return rows


def test_report_tables_plots_and_run_lists(grid):
    out = grid["root"] / "report"
    proc = _py("ddtree.report", f"tracking.uri={grid['uri']}", f"output_dir={out}", "tags.experiment=tiny_grid",
               cwd=grid["root"])
    assert "6 runs used, 3 skipped, 1 left out by the filters; 2 table cells" in proc.stdout
    md, tex = (out / "report.md").read_text(), (out / "table.tex").read_text()
    doc = json.loads((out / "report.json").read_text())
    S = grid["summaries"]

    rows = _md_rows(md)
    assert set(rows) == {(0.0, "tiny"), (1.0, "tiny")}
    for temp in (0.0, 1.0):
        dflash = S[(temp, "dflash", None)]
        best = max((S[(temp, "ddtree", b)] for b in (4, 8)), key=lambda s: (s["speedup"], -s["budget"]))
        row = rows[(temp, "tiny")]
        assert row[:2] == ["tiny", "tiny_qwen3"]
        assert row[2:7] == [f"{dflash['speedup']:.2f}x", f"{dflash['tau']:.2f}", f"{best['speedup']:.2f}x",
                            f"{best['tau']:.2f}", str(best["budget"])]
        assert row[7] == f"{best['speedup'] / dflash['speedup']:.2f}x" and row[8] == "4, 8"
        assert row[9] == f"{verdict_cell(dflash['validation'])}; {verdict_cell(best['validation'])}"
        assert " ok" in row[9] and ("exact" in row[9]) == (temp == 0)  # T > 0: sampled outputs, no exact/tie
        assert f"{dflash['speedup']:.2f}$\\times$ & {dflash['tau']:.2f} & {best['speedup']:.2f}$\\times$ " \
               f"({best['budget']}) & {best['tau']:.2f}" in tex
        (cell,) = [c for c in doc["cells"] if c["temperature"] == temp]
        assert (cell["dflash"]["speedup"], cell["dflash"]["tau"]) == (dflash["speedup"], dflash["tau"])
        assert (cell["ddtree_best"]["budget"], cell["ddtree_best"]["speedup"]) == (best["budget"], best["speedup"])
        assert {e["budget"]: (e["speedup"], e["tau"]) for e in cell["ddtree"]} == {
            b: (S[(temp, "ddtree", b)]["speedup"], S[(temp, "ddtree", b)]["tau"]) for b in (4, 8)}
        assert cell["dflash"]["per_generation"]["tau"] >= 1.0  # from samples.jsonl
    assert "99.00x" not in md and "98.00x" not in md and "Temperature = 0" in tex
    # the default reference (docs/paper_reference.yaml) covers the paper's three models
    assert "No run here is of a model the reference covers (qwen3_4b, qwen3_8b, qwen3_coder_30b_a3b)" in md and doc["reference"]["rows"] == []

    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} == {f"{k}_tiny_qwen3_T{t}.png" for k in ("speedup_vs_budget", "tau_vs_budget")
                                      for t in (0, 1)} | {f"acceptance_tiny_tiny_qwen3_T{t}.png" for t in (0, 1)} | {
        f"diagnosis_tiny_tiny_qwen3_T{t}_{k}.png" for k in ("depth", "tau", "speedup") for t in (0, 1)}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000 for p in pngs)
    assert all(f"]({p.name})" in md for p in pngs)

    skipped = {s["run_id"]: s["reason"] for s in doc["runs_skipped"]}
    extra = grid["extra"]
    assert set(skipped) == {extra["unfinished"], extra["failed"], extra["mismatched"]}
    assert skipped[extra["unfinished"]] == "unfinished (status RUNNING)"
    assert skipped[extra["failed"]] == "unfinished (status FAILED)"
    assert "mismatched settings" in skipped[extra["mismatched"]] and "max_new_tokens=16" in skipped[extra["mismatched"]]
    assert all(f"| {rid} |" in md.split("## Runs skipped")[1] for rid in skipped)
    used = {u["run_id"] for u in doc["runs_used"]}
    assert len(used) == 6 and used <= set(grid["runs"]) and doc["runs_filtered_out"] == 1


def test_report_filters(grid, tmp_path):
    def report(**kw):
        kw.setdefault("tracking", ReportTracking(uri=grid["uri"]))
        return make_report(ReportConfig(output_dir=str(tmp_path / "r"), plots=False, histograms=False, **kw))

    everything = report()  # no filter: the other experiment's run is the newer duplicate of budget 4 at T=0
    assert everything["runs_filtered_out"] == 0 and len(everything["runs_used"]) == 6
    assert any("superseded" in s["reason"] for s in everything["runs_skipped"])

    sweep = grid["sweep"]
    by_dir = report(sweep=f"{sweep.parent.name}/{sweep.name}")  # the tail of the sweep directory
    parent = json.loads((sweep / "mlflow_parent.json").read_text())["run_id"]
    by_id = report(sweep=parent)
    assert by_dir["runs_used"] == by_id["runs_used"] and len(by_id["runs_used"]) == 6
    assert report(sweep="1999-01-01/00-00-00")["runs_used"] == []

    none = report(tags={"experiment": "tiny_grid", "ddtree.config_hash": "none"})
    assert none["cells"] == [] and none["runs_filtered_out"] == 10

    strict = report(tags={"experiment": "tiny_grid"}, require={"max_new_tokens": "16"})
    assert [s["run_id"] for s in strict["runs_used"]] == [grid["extra"]["mismatched"]]
    assert sum("(required 16)" in s["reason"] for s in strict["runs_skipped"]) == 6

    with pytest.raises(ConfigError, match="no MLflow experiment 'nope'"):
        report(tracking=ReportTracking(uri=grid["uri"], experiment="nope"))
    with pytest.raises(ConfigError, match="no MLflow store") as e:
        report(tracking=ReportTracking(uri=f"sqlite:///{tmp_path}/missing/mlflow.db"))
    assert e.value.setting == "tracking.uri"


def test_report_against_a_reference(grid, tmp_path):
    """reference=<yaml>: the published figures beside the report's own cells, yours / paper in report.json;
    a bad reference file stops before the store is read."""
    ref = tmp_path / "ref.yaml"
    ref.write_text("source: a test table\nfigures:\n"
                   "  - {model: tiny_qwen3, temperature: 0, dataset: tiny, dflash: {speedup: 2.0, tau: 4.0},\n"
                   "     ddtree: {speedup: 3.0, tau: null, budget: 256}, verified: true}\n"
                   "  - {model: tiny_qwen3, temperature: 1, dataset: tiny, dflash: {speedup: 1.5}, verified: false}\n"
                   "  - {model: other_model, temperature: 0, dataset: tiny, dflash: {speedup: 9.0}}\n")
    out = tmp_path / "r"
    doc = make_report(ReportConfig(tracking=ReportTracking(uri=grid["uri"]), output_dir=str(out), plots=False,
                                   histograms=False, tags={"experiment": "tiny_grid"}, reference=str(ref)))
    S = grid["summaries"]
    rows = {r["temperature"]: r for r in doc["reference"]["rows"]}
    assert set(rows) == {0.0, 1.0} and doc["reference"]["source"] == "a test table"  # other_model: no runs here
    d0 = S[(0.0, "dflash", None)]
    best0 = max((S[(0.0, "ddtree", b)] for b in (4, 8)), key=lambda s: (s["speedup"], -s["budget"]))
    r0 = rows[0.0]
    assert r0["paper"]["dflash"] == {"speedup": 2.0, "tau": 4.0}
    assert r0["yours"]["dflash"]["speedup"] == d0["speedup"] and r0["yours"]["ddtree"]["budget"] == best0["budget"]
    assert r0["yours_over_paper"]["dflash_speedup"] == pytest.approx(d0["speedup"] / 2.0)
    assert r0["yours_over_paper"]["dflash_tau"] == pytest.approx(d0["tau"] / 4.0)
    assert r0["yours_over_paper"]["ddtree_speedup"] == pytest.approx(best0["speedup"] / 3.0)
    assert r0["yours_over_paper"]["ddtree_tau"] is None  # the paper's value was not found

    md = (out / "report.md").read_text()
    section = md.split("## Against the paper")[1].split("## Runs used")[0]
    assert "### tiny_qwen3" in section and "other_model" not in section
    line0 = next(ln for ln in section.split("Temperature 1:")[0].splitlines() if ln.startswith("| tiny |"))
    assert line0.startswith(f"| tiny | 2.00x | 3.00x (256) | 4.00 / - | {d0['speedup']:.2f}x | "
                            f"{best0['speedup']:.2f}x ({best0['budget']}) | {d0['tau']:.2f} / {best0['tau']:.2f} |")
    line1 = next(ln for ln in section.split("Temperature 1:")[1].splitlines() if ln.startswith("| tiny |"))
    assert line1.startswith("| tiny | 1.50x (unverified) |  |  |")

    bad = tmp_path / "bad.yaml"
    bad.write_text("figures:\n  - {model: m, temperature: 0, dataset: d, dflash: {speedup: -1}}\n")
    for path, msg in ((bad, "positive number"), (tmp_path / "missing.yaml", "no reference file")):
        with pytest.raises(ConfigError, match=msg) as e:
            make_report(ReportConfig(tracking=ReportTracking(uri=f"sqlite:///{tmp_path}/none/mlflow.db"),
                                     output_dir=str(tmp_path / "x"), reference=str(path)))
        assert e.value.setting == "reference"  # not tracking.uri: the reference is checked first
