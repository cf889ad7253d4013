"""The diagnosis's files: diagnosis.md, diagnosis.json and the plots of a job or sweep dir, and the report's section
per table cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddtree.pipeline.diagnose.analysis import diagnose
from ddtree.pipeline.diagnose.plots import write_plots
from ddtree.pipeline.diagnose.records import JobData
from ddtree.pipeline.diagnose.text import markdown_section

DIAGNOSIS_MD, DIAGNOSIS_JSON = "diagnosis.md", "diagnosis.json"


def write_diagnosis(doc: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = write_plots(doc, out) if plots else []
    doc["plots"] = [p.name for p in paths]
    (out / DIAGNOSIS_JSON).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / DIAGNOSIS_MD).write_text("\n".join(["# Why is tau what it is?", ""] + markdown_section(doc, doc["plots"])))
    return paths


def report_diagnoses(cells: list[dict[str, Any]], load_samples, out: Path, plots: bool = True
                     ) -> tuple[list[str], list[dict[str, Any]]]:
    """`python -m ddtree.report`'s "Why is tau what it is?": a diagnosis per table cell from its jobs (MLflow runs with
    .summary, .samples, .method, .budget, .name), samples fetched by `load_samples(job)`; (markdown lines, docs)."""
    lines, docs = ["## Why is tau what it is?", "",
                   "Per cell, from the per-round records of its DFlash and DDTree runs (`python -m ddtree.diagnose` on a "
                   "job or sweep dir says the same; docs/diagnosis.md explains it).", ""], []
    for c in cells:
        jobs = []
        for job in c["_jobs"].values():
            load_samples(job)
            recs = job.samples or []
            jobs.append(JobData(job.name, job.method, job.budget, job.summary or {},
                                [r for r in recs if r.get("role") == "method"],
                                [r for r in recs if r.get("role") == "baseline"]))
        doc = diagnose(jobs)
        slug = "_".join(str(x) for x in (c["dataset"], c["model"], f"T{c['temperature']:g}"))
        slug = "".join(ch if ch.isalnum() or ch in "._" else "-" for ch in slug)
        doc["plots"] = [p.name for p in write_plots(doc, out, f"diagnosis_{slug}")] if plots else []
        docs.append({"dataset": c["dataset"], "model": c["model"], "temperature": c["temperature"], **doc})
        lines += [f"### {c['title']}, {c['model']}, temperature {c['temperature']:g}", ""]
        lines += markdown_section(doc, doc["plots"], level=4)
    return lines, docs
