"""`python -m ddtree.report`: the paper's tables and plots from the runs in an MLflow store.

    python -m ddtree.report                                          # every run in runs/mlflow.db
    python -m ddtree.report tags.experiment=paper_qwen3_8b output_dir=reports/qwen3_8b
    python -m ddtree.report tracking.uri=sqlite:///elsewhere/mlflow.db sweep=2026-05-01/10-00-00
    python -m ddtree.report +tags.device_name="NVIDIA H200" +require.max_new_tokens=2048

A table cell is one dataset × model × temperature: DFlash, and DDTree at the budget with the best
speedup (the budget shown). Speedup and tau are each job's own (summary.json): speedup = the method's
tokens/s over the AR baseline's, run in the same job on the same prompts; tau = tokens committed per
round, bonus included. Writes into output_dir: report.md (tables, the runs used and skipped, and why),
table.tex, report.json (every number), speedup_vs_budget_*.png, tau_vs_budget_*.png and
acceptance_*.png (acceptance-length histograms, DFlash vs DDTree at its best budget). With `reference=`
(default docs/paper_reference.yaml), report.md and report.json also hold the paper's published figures
beside the cells of the models they cover.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from ddtree.engine.methods import BASELINE, METHODS, drafter_method
from ddtree.errors import ConfigError
from ddtree.pipeline.console import run_cli, tracebacks_wanted, user_error
from ddtree.pipeline.datasets import dataset_rank
from ddtree.pipeline.plotting import pyplot, save
from ddtree.pipeline.reference import comparison_rows, load_reference, reference_markdown, reference_model
from ddtree.pipeline.schema import CONF_DIR, REPO_ROOT, schema_node, structured  # noqa: F401  (REPO_ROOT: registers the repo_root resolver)
from ddtree.pipeline.sweep_table import method_cell, verdict_cell

REPORT_MD, REPORT_TEX, REPORT_JSON = "report.md", "table.tex", "report.json"
DRAFTING_METHODS = tuple(name for name, m in METHODS.items() if m.drafter_kind is not None)  # a column each
LABELS = {"dflash": "DFlash", "ddtree": "DDTree"}
DEFAULT_PROTOCOL = ["max_new_tokens", "block_size", "num_prompts", "seed", "dataset.max_samples",
                    "dataset.shuffle_seed", "dataset.path", "dataset.chat_template", "dataset.enable_thinking",
                    "model.name_or_path", "model.dtype", "drafter.name_or_path", "attention.target",
                    "attention.drafter", "device_name"]


# ---------------------------------------------------------------- config


@dataclass
class ReportTracking:
    uri: str | None = None  # null: sqlite:///<runs_dir>/mlflow.db
    experiment: str | None = None  # the MLflow experiment to read (null: all of them)


@dataclass
class ReportConfig:
    tracking: ReportTracking = field(default_factory=ReportTracking)
    runs_dir: str = "runs"
    output_dir: str = "report"
    sweep: str | None = None  # a sweep's parent run id, or its directory (or its tail, e.g. 2026-05-01/10-00-00)
    # only runs with these MLflow tags (null: any); tags.experiment=<name> picks what +experiment=<name> ran
    tags: dict[str, str | None] = field(default_factory=lambda: {"experiment": None})
    require: dict[str, str] = field(default_factory=dict)  # settings a run must have, else skipped
    protocol: list[str] = field(default_factory=lambda: list(DEFAULT_PROTOCOL))  # must agree within a cell
    plots: bool = True
    histograms: bool = True
    diagnosis: bool = True  # "Why is tau what it is?" per cell (ddtree.pipeline.diagnose; downloads samples.jsonl)
    # published figures to compare with (docs/paper_reference.yaml; conf/report.yaml sets it); null: none
    reference: str | None = None


ConfigStore.instance().store(name="report_schema", node=schema_node(ReportConfig))


# ---------------------------------------------------------------- reading the store


@dataclass
class Job:
    """One MLflow run of `python -m ddtree.run`, with its summary.json."""

    run_id: str
    name: str
    status: str
    start_time: int
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]
    summary: dict[str, Any] | None = None
    samples: list[dict[str, Any]] | None = None

    def value(self, key: str) -> Any:
        """A setting or result: summary.json first, then params, then tags ('None' strings are None)."""
        if self.summary is not None and key in self.summary:
            return self.summary[key]
        v = self.params.get(key, self.tags.get(key))
        return None if v in (None, "None", "null") else v

    @property
    def method(self) -> str | None:
        return self.value("method")

    @property
    def budget(self) -> int | None:
        b = self.value("budget") if self.method in METHODS and METHODS[self.method].reads_budget else None
        return None if b is None else int(b)

    @property
    def dataset(self) -> str:
        name = str(self.params.get("dataset.name", "?"))
        path = self.params.get("dataset.path")
        return Path(path).stem if name == "jsonl" and path not in (None, "None", "") else name  # as the job names it

    @property
    def title(self) -> str:
        t = self.params.get("dataset.title")
        return self.dataset if t in (None, "None", "null", "") else str(t)

    @property
    def model(self) -> str:
        return str(self.value("model") or self.params.get("model.name", "?"))

    @property
    def temperature(self) -> float:
        return float(self.value("temperature") or 0.0)

    @property
    def cell(self) -> tuple[str, str, float]:
        return self.dataset, self.model, self.temperature

    def number(self, key: str) -> float | None:
        v = self.value(key)
        if v is None:
            v = self.metrics.get(key)
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None

    def brief(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "name": self.name, "dataset": self.dataset, "model": self.model,
                "temperature": self.temperature, "method": self.method, "budget": self.budget}


def tracking_uri(rc: ReportConfig) -> str:
    if rc.tracking.uri:
        return rc.tracking.uri
    return "sqlite:///" + str(Path(rc.runs_dir).expanduser().resolve() / "mlflow.db")


def _all_runs(client, experiment_ids: list[str]) -> list:
    out, token = [], None
    while True:
        page = client.search_runs(experiment_ids, max_results=1000, page_token=token,
                                  order_by=["attributes.start_time ASC"])
        out.extend(page)
        token = page.token
        if not token:
            return out


def _download_json(client, run_id: str, path: str, tmp: Path, *, lines: bool = False):
    try:
        local = client.download_artifacts(run_id, path, str(tmp))
    except Exception:  # no such artifact (an old or unfinished run): fall back to the store's metrics
        return None
    text = Path(local).read_text(encoding="utf-8")
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()] if lines else json.loads(text)


class Store:
    def __init__(self, uri: str, tmp: Path):
        db = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
        if db is not None and not Path(db).is_file():
            raise ConfigError("tracking.uri", f"no MLflow store at {db}",
                              "pass tracking.uri=sqlite:///<path>/mlflow.db (where ddtree.run recorded the runs)")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from ddtree.pipeline.tracking import open_store

        self.uri, self.tmp, self.client = uri, tmp, open_store(uri)

    def experiment_ids(self, name: str | None) -> list[str]:
        if name is None:
            return [e.experiment_id for e in self.client.search_experiments()]
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            have = ", ".join(sorted(e.name for e in self.client.search_experiments())) or "none"
            raise ConfigError("tracking.experiment", f"no MLflow experiment '{name}' in {self.uri} (it has: {have})",
                              "pass tracking.experiment=<one of those>, or tracking.experiment=null for all")
        return [exp.experiment_id]

    def runs(self, experiment_ids: list[str]) -> list:
        return _all_runs(self.client, experiment_ids) if experiment_ids else []

    def job(self, run) -> Job:
        return Job(run.info.run_id, run.info.run_name or run.info.run_id, run.info.status, run.info.start_time or 0,
                   dict(run.data.params), dict(run.data.tags), dict(run.data.metrics))

    def load_summary(self, job: Job) -> None:
        job.summary = _download_json(self.client, job.run_id, "summary.json", self.tmp / job.run_id)

    def load_samples(self, job: Job) -> None:
        if job.samples is None:
            job.samples = _download_json(self.client, job.run_id, "samples.jsonl", self.tmp / job.run_id, lines=True)


# ---------------------------------------------------------------- selection


@dataclass
class Selection:
    used: list[Job] = field(default_factory=list)
    skipped: list[tuple[Job, str]] = field(default_factory=list)
    filtered_out: int = 0


def _sweep_matches(sweep: str, job: Job, sweep_dirs: dict[str, str]) -> bool:
    parent = job.tags.get("mlflow.parentRunId")
    if parent is None:
        return False
    if parent == sweep:
        return True
    d = sweep_dirs.get(parent, "")
    want = sweep.rstrip("/")
    return bool(d) and (d == str(Path(want).expanduser().resolve()) or d.endswith("/" + want.lstrip("/")))


def _fmt_setting(v: Any) -> str:
    return "null" if v is None else str(v)


def _same(a: Any, b: Any) -> bool:
    """Settings compare as text, numbers as numbers (a param '8' equals a summary 8)."""
    if a is None or b is None:
        return a is b
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def select(store: Store, rc: ReportConfig) -> Selection:
    """The runs the report uses, and every run it leaves out with the reason."""
    sel = Selection()
    runs = store.runs(store.experiment_ids(rc.tracking.experiment))
    sweep_dirs = {r.info.run_id: r.data.tags.get("ddtree.sweep_dir", "") for r in runs
                  if r.data.tags.get("ddtree.role") == "sweep"}
    candidates: list[Job] = []
    for r in runs:
        job = store.job(r)
        role = job.tags.get("ddtree.role")
        if role not in ("job", "run"):  # sweep parents, and runs not made by ddtree.run
            continue
        if rc.sweep is not None and not _sweep_matches(rc.sweep, job, sweep_dirs):
            sel.filtered_out += 1
            continue
        if any(job.tags.get(k, job.params.get(f"tags.{k}")) != str(v) for k, v in rc.tags.items() if v is not None):
            sel.filtered_out += 1
            continue
        candidates.append(job)

    ok: list[Job] = []
    for job in candidates:
        if job.status != "FINISHED":
            sel.skipped.append((job, f"unfinished (status {job.status})"))
            continue
        store.load_summary(job)
        if job.method == BASELINE:
            sel.skipped.append((job, f"method={BASELINE}: AR is the baseline inside every job, not a table entry"))
            continue
        if job.method not in DRAFTING_METHODS:
            sel.skipped.append((job, f"unknown method {job.method!r}"))
            continue
        if job.number("speedup") is None or job.number("tau") is None:
            sel.skipped.append((job, "no speedup or tau: the job ran without its AR baseline (baseline=false)"))
            continue
        bad = [f"{k}={_fmt_setting(job.value(k))} (required {v})" for k, v in rc.require.items()
               if not _same(job.value(k), v)]
        if bad:
            sel.skipped.append((job, "mismatched settings: " + ", ".join(bad)))
            continue
        ok.append(job)

    by_cell: dict[tuple, list[Job]] = defaultdict(list)
    for job in ok:
        by_cell[job.cell].append(job)
    for jobs in by_cell.values():
        protocol = {id(j): tuple(_fmt_setting(j.value(k)) for k in rc.protocol) for j in jobs}
        counts = Counter(protocol.values())
        latest = {p: max(j.start_time for j in jobs if protocol[id(j)] == p) for p in counts}
        keep = max(counts, key=lambda p: (counts[p], latest[p]))  # the most runs; ties: the newest
        newest: dict[tuple, Job] = {}
        for j in sorted(jobs, key=lambda j: j.start_time, reverse=True):
            if protocol[id(j)] != keep:
                diff = [f"{k}={a} (the cell's other runs: {b})" for k, a, b in zip(rc.protocol, protocol[id(j)], keep,
                                                                                   strict=True) if a != b]
                sel.skipped.append((j, "mismatched settings within its dataset x model x temperature: " + ", ".join(diff)))
                continue
            group = METHODS[j.method].settings if j.method in METHODS else None
            slot = (j.method, j.budget, json.dumps(j.value(group) if group else None, sort_keys=True))  # its shape too
            if slot in newest:
                sel.skipped.append((j, f"superseded by the newer run {newest[slot].run_id} with the same settings"))
                continue
            newest[slot] = j
            sel.used.append(j)
    chain = drafter_method("chain")
    sel.used.sort(key=lambda j: (dataset_rank(j.dataset), j.model, j.temperature, j.method != chain,
                                 j.budget or 0))
    return sel


# ---------------------------------------------------------------- numbers


def _entry(job: Job) -> dict[str, Any]:
    e = {"run_id": job.run_id, "budget": job.budget}
    for k in ("speedup", "tau", "tokens_per_s", "baseline_tokens_per_s", "match_rate"):
        e[k] = job.number(k)
    e["verdicts"] = verdict_cell(job_verdicts(job))
    return e


def job_verdicts(job: Job) -> dict[str, Any] | None:
    """The job's verdict counts: summary.json's `validation`, else its MLflow metrics validation.*."""
    v = job.value("validation")
    if isinstance(v, dict):
        return v
    counts = {k: job.metrics.get(f"validation.{k}") for k in ("checked", "exact", "tie", "ok", "suspect")}
    return {k: int(x) for k, x in counts.items() if x is not None} if counts["checked"] is not None else None


def per_generation(job: Job) -> dict[str, float | None] | None:
    """The DDTree/DFlash scripts' aggregation, from samples.jsonl: tau = the mean over generations of
    each one's mean acceptance length; speedup = mean AR time per token / mean method time per token."""
    if not job.samples:
        return None

    def tpot(r):
        return r["total_s"] / r["num_new_tokens"] if r.get("num_new_tokens") else None

    meth = [r for r in job.samples if r.get("role") == "method" and r.get("acceptance_lengths")]
    base = [t for t in (tpot(r) for r in job.samples if r.get("role") == "baseline") if t]
    mt = [t for t in (tpot(r) for r in meth) if t]
    taus = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]) for r in meth]
    return {"tau": sum(taus) / len(taus) if taus else None,
            "speedup": (sum(base) / len(base)) / (sum(mt) / len(mt)) if base and mt else None}


def _compared_job(c: dict[str, Any], key: str):
    """The job behind a cell's "dflash" (the DFlash chain) or "ddtree_best" (the DDTree tree at its best budget)."""
    if key == "dflash":
        return c["_jobs"].get((drafter_method("chain"), None))
    return c["_jobs"].get((drafter_method("tree"), (c[key] or {}).get("budget")))


def build_cells(sel: Selection, store: Store | None = None, *, samples: bool = True) -> list[dict[str, Any]]:
    cells: dict[tuple, dict[str, Any]] = {}
    chain = drafter_method("chain")
    for job in sel.used:
        c = cells.setdefault(job.cell, {"dataset": job.dataset, "title": job.title, "model": job.model,
                                        "temperature": job.temperature, "dflash": None, "ddtree_best": None,
                                        "ddtree": [], "_jobs": {}})
        c["_jobs"][(job.method, job.budget)] = job
        if job.method == chain:
            c["dflash"] = _entry(job)
        elif METHODS[job.method].settings:  # a settings group of its own (Method.settings: steps, topk) names the best shape
            group = METHODS[job.method].settings
            c.setdefault("mtp", []).append({**_entry(job), "shape": method_cell(
                {"method": job.method, group: job.value(group)}) + (f" b{job.budget}" if job.budget else "")})
        else:
            c["ddtree"].append(_entry(job))
    out = []
    for c in cells.values():
        c["ddtree"].sort(key=lambda e: e["budget"])
        if c["ddtree"]:
            c["ddtree_best"] = dict(max(c["ddtree"], key=lambda e: (e["speedup"], -e["budget"])))
        if c.get("mtp"):
            c["mtp_best"] = dict(max(c["mtp"], key=lambda e: e["speedup"]))
        d, t = c["dflash"], c["ddtree_best"]
        c["gain"] = t["speedup"] / d["speedup"] if d and t and d["speedup"] else None
        for key in ("dflash", "ddtree_best"):
            e = c[key]
            if e is None:
                continue
            job = _compared_job(c, key)
            if samples and store is not None:
                store.load_samples(job)
            e["per_generation"] = per_generation(job)
        out.append(c)
    out.sort(key=lambda c: (c["temperature"], c["model"], dataset_rank(c["dataset"])))
    return out


# ---------------------------------------------------------------- tables


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown_table(cells: list[dict[str, Any]]) -> str:
    lines = []
    mtp = any(c.get("mtp") for c in cells)  # a method with its own draft shape ran (Method.settings): columns too
    shaped = "/".join(sorted({e["shape"].split()[0] for c in cells for e in (*(c.get("mtp") or ()), c.get("mtp_best"))
                              if e and e.get("shape")})).upper()
    for temp in sorted({c["temperature"] for c in cells}):
        lines += [f"### Temperature {temp:g}", "",
                  "| dataset | model | DFlash speedup | DFlash tau | DDTree speedup | DDTree tau | best budget | "
                  "DDTree / DFlash | budgets run | verdicts (DFlash; DDTree) |"
                  + (f" {shaped} speedup | {shaped} tau | {shaped} shape | {shaped} verdicts |" if mtp else ""),
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
                  + (" ---: | ---: | --- | --- |" if mtp else "")]
        for c in (c for c in cells if c["temperature"] == temp):
            d, t, m = c["dflash"] or {}, c["ddtree_best"] or {}, c.get("mtp_best") or {}
            budgets = ", ".join(str(e["budget"]) for e in c["ddtree"]) or "-"
            lines.append(f"| {c['title']} | {c['model']} | {_x(d.get('speedup'))} | {_n(d.get('tau'))} | "
                         f"{_x(t.get('speedup'))} | {_n(t.get('tau'))} | {t.get('budget', '-')} | "
                         f"{_x(c['gain'])} | {budgets} | {d.get('verdicts', '-')}; {t.get('verdicts', '-')} |"
                         + (f" {_x(m.get('speedup'))} | {_n(m.get('tau'))} | {m.get('shape', '-')} | "
                            f"{m.get('verdicts', '-')} |" if mtp else ""))
        lines.append("")
    return "\n".join(lines)


def _tex(s: str) -> str:
    s = s.replace("\\", "\0")
    for a in "&%$#_{}":
        s = s.replace(a, "\\" + a)
    return s.replace("\0", r"\textbackslash{}")


def latex_table(cells: list[dict[str, Any]]) -> str:
    """The paper's layout: a column pair (speedup, tau) per method per model, a block per temperature."""
    models = sorted({c["model"] for c in cells})
    datasets = sorted({(c["dataset"], c["title"]) for c in cells}, key=lambda d: dataset_rank(d[0]))
    look = {(c["temperature"], c["dataset"], c["model"]): c for c in cells}
    ncols = 1 + 4 * len(models)
    lines = [r"% needs \usepackage{booktabs,graphicx}", r"\begin{table*}[t]", r"\centering", r"\small",
             r"\caption{Speedup over autoregressive decoding and mean acceptance length ($\tau$). "
             r"DDTree at its best node budget (in parentheses).}",
             r"\label{tab:ddtree-report}", r"\resizebox{\textwidth}{!}{",
             r"\begin{tabular}{l" + "rrrr" * len(models) + "}", r"\toprule",
             " & " + " & ".join(rf"\multicolumn{{4}}{{c}}{{\textbf{{{_tex(m)}}}}}" for m in models) + r" \\",
             " ".join(rf"\cmidrule(lr){{{2 + 4 * i}-{5 + 4 * i}}}" for i in range(len(models))),
             r"\textbf{Dataset} & " + " & ".join(r"\multicolumn{2}{c}{DFlash} & \multicolumn{2}{c}{DDTree}"
                                                 for _ in models) + r" \\",
             " & " + " & ".join(r"Speedup & $\tau$ & Speedup & $\tau$" for _ in models) + r" \\"]
    for temp in sorted({c["temperature"] for c in cells}):
        lines += [r"\midrule", rf"\multicolumn{{{ncols}}}{{l}}{{\textit{{Temperature = {temp:g}}}}} \\"]
        for name, title in datasets:
            row = [_tex(title)]
            for m in models:
                c = look.get((temp, name, m))
                d = (c or {}).get("dflash") or {}
                t = (c or {}).get("ddtree_best") or {}
                row.append("--" if d.get("speedup") is None else f"{d['speedup']:.2f}$\\times$")
                row.append("--" if d.get("tau") is None else f"{d['tau']:.2f}")
                row.append("--" if t.get("speedup") is None else f"{t['speedup']:.2f}$\\times$ ({t['budget']})")
                row.append("--" if t.get("tau") is None else f"{t['tau']:.2f}")
            lines.append(" & ".join(row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", "}", r"\end{table*}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def _slug(*parts: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", "_".join(str(p) for p in parts)).strip("-")


def budget_plots(cells: list[dict[str, Any]], out: Path) -> list[Path]:
    """Per model and temperature: speedup and tau against the DDTree budget, one line per dataset,
    DFlash as a dotted level in the same colour."""
    plt = pyplot()
    paths = []
    groups: dict[tuple, list] = defaultdict(list)
    for c in cells:
        groups[(c["model"], c["temperature"])].append(c)
    for (model, temp), cs in sorted(groups.items()):
        for metric, label in (("speedup", "speedup over AR (x)"), ("tau", "tau (tokens per round)")):
            fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
            budgets = sorted({e["budget"] for c in cs for e in c["ddtree"]})
            for i, c in enumerate(sorted(cs, key=lambda c: dataset_rank(c["dataset"]))):
                color = f"C{i % 10}"
                pts = [(e["budget"], e[metric]) for e in c["ddtree"] if e[metric] is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=c["title"])
                if c["dflash"] and c["dflash"][metric] is not None:
                    ax.axhline(c["dflash"][metric], color=color, linestyle=":", linewidth=1)
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("DDTree node budget (dotted: DFlash)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}, temperature {temp:g}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            paths.append(save(plt, fig, out / f"{metric}_vs_budget_{_slug(model, f'T{temp:g}')}.png"))
    return paths


def acceptance_histograms(cells: list[dict[str, Any]], out: Path) -> list[Path]:
    """Per cell: the share of rounds committing k tokens, DFlash vs DDTree at its best budget."""
    plt = pyplot()
    paths = []
    for c in cells:
        series = []
        for key, label in (("dflash", "DFlash"), ("ddtree_best", "DDTree")):
            job = _compared_job(c, key)
            if c[key] is None or job is None or not job.samples:
                continue
            lengths = [a for r in job.samples if r.get("role") == "method" for a in r.get("acceptance_lengths", [])]
            if lengths:
                name = label if key == "dflash" else f"{label} (budget {c[key]['budget']})"
                series.append((name, lengths))
        if not series:
            continue
        hi = max(max(v) for _, v in series)
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        width = 0.8 / len(series)
        for i, (name, v) in enumerate(series):
            share = [v.count(k) / len(v) for k in range(1, hi + 1)]
            ax.bar([k - 0.4 + width * (i + 0.5) for k in range(1, hi + 1)], share, width=width, label=name)
        ax.set_xticks(range(1, hi + 1))
        ax.set_xlabel("tokens committed per round (bonus included)")
        ax.set_ylabel("share of rounds")
        ax.set_title(f"{c['title']}, {c['model']}, temperature {c['temperature']:g}", fontsize=10)
        ax.legend(fontsize=8)
        name = _slug(c["dataset"], c["model"], "T" + format(c["temperature"], "g"))
        paths.append(save(plt, fig, out / f"acceptance_{name}.png"))
    return paths


# ---------------------------------------------------------------- the report


def _filters(rc: ReportConfig, uri: str) -> dict[str, Any]:
    return {"tracking_uri": uri, "mlflow_experiment": rc.tracking.experiment, "sweep": rc.sweep,
            "tags": {k: v for k, v in rc.tags.items() if v is not None}, "require": dict(rc.require),
            "protocol": list(rc.protocol)}


def reference_section(ref: dict[str, Any] | None, cells: list[dict[str, Any]]) -> list[str]:
    """report.md's "Against the paper": the reference's figures for each reported model beside yours."""
    if ref is None:
        return []
    covered = sorted({k[0] for k in ref["entries"]})
    models = [m for m in sorted({reference_model(ref, c["model"]) for c in cells}) if m in covered]
    lines = ["## Against the paper", "",
             f"Reference: {ref['source'] or ref['path']} ({ref['path']}). An empty paper cell was not found in "
             "the paper (it is not a zero); `(unverified)` marks numbers not checked against the paper itself. "
             "report.json (`reference`) has yours / paper for every entry.", ""]
    if not models:
        lines += [f"No run here is of a model the reference covers ({', '.join(covered) or 'none'}).", ""]
    for m in models:
        lines += [f"### {m}", "", reference_markdown(ref, m, cells)]
    return lines


def render_markdown(cells, sel: Selection, filters: dict[str, Any], plots: list[Path],
                    ref: dict[str, Any] | None = None, diagnosis: list[str] | None = None) -> str:
    f = {k: v for k, v in filters.items() if v not in (None, {}, []) and k != "protocol"}
    lines = ["# DDTree report", "",
             "Filters: " + ", ".join(f"{k}={v}" for k, v in f.items()) + ".",
             f"Runs used: {len(sel.used)}; skipped: {len(sel.skipped)}; left out by the filters: {sel.filtered_out}.",
             "",
             "Speedup: the method's tokens/s over the AR baseline's, measured in the same job on the same prompts. "
             "tau: tokens committed per verification round, bonus token included. DDTree is shown at the budget "
             "with the best speedup in its cell; `per_generation` numbers in report.json use the authors' "
             "aggregation (means over generations).", "",
             "## Speedup and tau", "", markdown_table(cells)]
    lines += reference_section(ref, cells)
    lines += diagnosis or []
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["## Runs used", "", "| run | name | dataset | model | T | method | budget | speedup | tau |",
              "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for j in sel.used:
        lines.append(f"| {j.run_id} | {j.name} | {j.title} | {j.model} | {j.temperature:g} | {j.method} | "
                     f"{j.budget if j.budget is not None else '-'} | {_x(j.number('speedup'))} | "
                     f"{_n(j.number('tau'))} |")
    lines += ["", "## Runs skipped", ""]
    if sel.skipped:
        lines += ["| run | name | reason |", "| --- | --- | --- |"]
        lines += [f"| {j.run_id} | {j.name} | {why} |" for j, why in sel.skipped]
    else:
        lines.append("None.")
    return "\n".join(lines) + "\n"


def make_report(rc: ReportConfig) -> dict[str, Any]:
    """Read the store, write every output into rc.output_dir, return the JSON document."""
    uri = tracking_uri(rc)
    out = Path(rc.output_dir).expanduser().resolve()
    ref = load_reference(rc.reference) if rc.reference else None  # a bad file stops before the store is read
    with tempfile.TemporaryDirectory(prefix="ddtree-report-") as tmp:
        store = Store(uri, Path(tmp))
        sel = select(store, rc)
        cells = build_cells(sel, store, samples=rc.histograms)
        out.mkdir(parents=True, exist_ok=True)
        plots = budget_plots(cells, out) if rc.plots and cells else []
        if rc.histograms and cells:
            plots += acceptance_histograms(cells, out)
        diag_lines, diag_docs = [], []
        if rc.diagnosis and cells:
            from ddtree.pipeline.diagnose import report_diagnoses

            diag_lines, diag_docs = report_diagnoses(cells, store.load_samples, out, plots=rc.plots)
    filters = _filters(rc, uri)
    doc = {"filters": filters,
           "cells": [{k: v for k, v in c.items() if not k.startswith("_")} for c in cells],
           "plots": [p.name for p in plots],
           "runs_used": [j.brief() for j in sel.used],
           "runs_skipped": [{**j.brief(), "status": j.status, "reason": why} for j, why in sel.skipped],
           "runs_filtered_out": sel.filtered_out}
    if diag_docs:
        doc["diagnosis"] = diag_docs
    if ref is not None:
        doc["reference"] = {"path": ref["path"], "source": ref["source"],
                            "rows": comparison_rows(ref, cells, sorted({reference_model(ref, c["model"])
                                                                          for c in cells}))}
    (out / REPORT_JSON).write_text(json.dumps(doc, indent=2) + "\n")
    (out / REPORT_MD).write_text(render_markdown(cells, sel, filters, plots, ref, diag_lines))
    (out / REPORT_TEX).write_text(latex_table(cells))
    return doc


def to_report_config(cfg: DictConfig) -> ReportConfig:
    return structured(cfg, ReportConfig, refuse_unknown=False)


@hydra.main(config_path=str(CONF_DIR), config_name="report", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        rc = to_report_config(cfg)
        doc = make_report(rc)
    except ConfigError as e:
        if tracebacks_wanted():
            raise
        user_error(str(e))
    out = Path(rc.output_dir).expanduser().resolve()
    print(f"{len(doc['runs_used'])} runs used, {len(doc['runs_skipped'])} skipped, "
          f"{doc['runs_filtered_out']} left out by the filters; {len(doc['cells'])} table cells")
    for s in doc["runs_skipped"]:
        print(f"  skipped {s['run_id']} ({s['name']}): {s['reason']}")
    if not doc["cells"]:
        print("warning: no run fits the table (see the reasons above)", file=sys.stderr)
    print(f"report: {out / REPORT_MD}")


def main() -> None:
    run_cli(_hydra_main, "ddtree.report")


if __name__ == "__main__":
    main()
