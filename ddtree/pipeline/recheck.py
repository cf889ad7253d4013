"""`python -m ddtree.validate <job dir>`: re-check a finished job's outputs against its target (loaded
from the job's resolved config), for runs made before verdicts existed or elsewhere."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.pipeline.output_verdicts import (
    STRICT_EXIT,
    VALIDATION_FILE,
    first_suspect_line,
    tolerance_line,
    validate_records,
)
from ddtree.pipeline.schema import RunConfig, ValidationConfig
from ddtree.pipeline.sweep_table import verdict_cell


def load_job_config(job_dir: Path) -> RunConfig:
    """The job's resolved config (config_resolved.yaml, else Hydra's .hydra/config.yaml)."""
    from omegaconf import OmegaConf

    from ddtree.pipeline.schema import to_run_config

    for name in ("config_resolved.yaml", ".hydra/config.yaml"):
        path = job_dir / name
        if path.is_file():
            return to_run_config(OmegaConf.load(path))
    raise ConfigError("job_dir", f"{job_dir} holds no config_resolved.yaml or .hydra/config.yaml",
                      "pass the directory of one job (the one with samples.jsonl)")


def recheck(job_dir: Path, validation: ValidationConfig | None = None, device: str | None = None) -> dict[str, Any]:
    """Validate a finished job's samples with the target its config names; writes validation.json."""
    from ddtree.pipeline.conversation import SAMPLES, stop_token_ids
    from ddtree.pipeline.datasets import load_dataset_prompts
    from ddtree.pipeline.models import load_target, resolve_device

    job_dir = Path(job_dir)
    samples = job_dir / SAMPLES
    if not samples.is_file():
        raise ConfigError("job_dir", f"{job_dir} has no {SAMPLES}", "pass the directory of one job")
    rc = load_job_config(job_dir)
    if validation is not None:
        rc.validation = validation
    records = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    dev = resolve_device(device or rc.device)
    target, tokenizer = load_target(rc, dev)
    result = validate_records(target, tokenizer, load_dataset_prompts(rc.dataset), records, rc,
                              stop_token_ids(tokenizer, target))
    per_output = [{"id": r["id"], "turn": r["turn"], "role": r["role"], **r["validation"]} for r in records]
    (job_dir / VALIDATION_FILE).write_text(json.dumps({"validation": result, "outputs": per_output}, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    from ddtree.pipeline.console import tracebacks_wanted, user_error

    p = argparse.ArgumentParser(prog="python -m ddtree.validate", description="Re-check a finished job's outputs "
                                "against its target (teacher-forced); writes validation.json into the job dir.")
    p.add_argument("job_dir", type=Path)
    p.add_argument("--strict", action="store_true", help=f"exit {STRICT_EXIT} when any output is suspect")
    p.add_argument("--steps", type=float, help="dtype steps a margin may reach and still be a tie")
    p.add_argument("--no-calibrate", action="store_true", help="no floor from the baseline's own drift")
    p.add_argument("--rescore-dtype", help="teacher-force in this dtype, e.g. float32")
    p.add_argument("--device", help="default: the job's device setting")
    a = p.parse_args(argv)
    try:
        cfg = load_job_config(a.job_dir).validation if a.job_dir.is_dir() else ValidationConfig()
        if a.steps is not None:
            cfg.steps = a.steps
        cfg.calibrate = cfg.calibrate and not a.no_calibrate
        cfg.rescore_dtype = a.rescore_dtype or cfg.rescore_dtype
        cfg.mode = "on"
        result = recheck(a.job_dir, cfg, a.device)
    except ConfigError as e:
        if tracebacks_wanted():
            raise
        user_error(str(e))
    print(f"{a.job_dir}: {verdict_cell(result)} of {result['checked']} outputs; "
          f"tolerance {tolerance_line(result)}; {result['seconds']:.1f}s")
    line = first_suspect_line(result)
    if line:
        print(line)
    if a.strict and result["suspect"]:
        sys.exit(STRICT_EXIT)
