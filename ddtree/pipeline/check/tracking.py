"""ddtree.check's MLflow run and result files: config_resolved.yaml and the run started; summary.json, the table, the
run's metrics and artifacts at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddtree.errors import ConfigError
from ddtree.pipeline.check.config import CHECK_FILE, SUMMARY, CheckConfig
from ddtree.pipeline.check.gather import Gathered, Source
from ddtree.pipeline.check.verdicts import summary_line
from ddtree.pipeline.schema import REPO_ROOT, flatten


def start_tracking(cc: CheckConfig, tracker, chash: str, job_dir: Path, env: dict[str, Any]):
    """config_resolved.yaml written (no api key) and the tracked run started; the run (None: tracking=none)."""
    from ddtree.pipeline.job import job_dirs
    from ddtree.pipeline.tracking import git_commit

    _, sweep_dir, overrides, _ = job_dirs()
    resolved = OmegaConf.to_container(OmegaConf.structured(cc), resolve=True)
    resolved["endpoint"].pop("api_key", None)
    (job_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    tags = {"mlflow.source.name": "ddtree.check", "ddtree.role": "check", "job_dir": str(job_dir),
            "git_commit": git_commit(REPO_ROOT), "overrides": " ".join(overrides), "ddtree.check.source": cc.source,
            "ddtree.check.from": cc.endpoint.url if cc.source == "endpoint" else cc.file.path,
            "ddtree.model": cc.model.name, "torch_version": env["versions"]["torch"],
            "transformers_version": env["versions"]["transformers"], **cc.tags}
    return tracker.start(run_name=f"check-{cc.model.name}-{cc.source}", params=flatten(resolved), tags=tags,
                         config_hash=chash, sweep_dir=sweep_dir,
                         sweep_name=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}" if sweep_dir else None)


def finish(cc: CheckConfig, summary: dict[str, Any], g: Gathered, src: Source, run, job_dir: Path) -> None:
    """summary.json, the table and its line, the run's metrics and files; the run ends (FAILED: the server failed
    mid-dataset, raised as one line after everything gathered was judged and written)."""
    from ddtree.pipeline.output_verdicts import SuspectOutputs
    from ddtree.pipeline.sweep_table import format_table
    from ddtree.pipeline.tracking import numeric_metrics

    (job_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary), flush=True)
    print(summary_line(summary), flush=True)
    print(f"results: {job_dir}", flush=True)
    if run is not None:
        keys = ("validation", "tokens_per_s", "tau", "latency_s_mean", "match_rate", "outputs", "server_acceptance",
                "sampling")
        run.log_metrics(numeric_metrics({k: summary[k] for k in keys if summary.get(k) is not None}))
        run.log_artifacts([job_dir / "config_resolved.yaml", job_dir / CHECK_FILE, job_dir / SUMMARY])
    if g.error is not None:  # the server failed mid-dataset: what was checked is kept; a rerun resumes
        raise ConfigError(g.error.setting, f"{g.error.problem} (after {len({r['id'] for r in g.records})} of "
                          f"{len(src.outputs)} outputs; they are kept in {job_dir / CHECK_FILE}, and a rerun of the "
                          "same check resumes)", g.error.fix)
    if run is not None:
        run.end("FINISHED")
    v = summary["validation"]
    if v["first_suspects"]:
        s = v["first_suspects"][0]
        print(f"first suspect: prompt {s['id']} turn {s['turn']}: {s['reason']}", flush=True)
    if v["suspect"] and cc.validation.strict:
        raise SuspectOutputs(f"validation.strict: {v['suspect']} of {v['checked']} outputs are suspect — "
                             "see check.jsonl")
