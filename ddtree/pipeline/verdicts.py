"""A verdict for every output of a job (ddtree.engine.validate over samples.jsonl), and the re-check CLI.

    python -m ddtree.validate runs/2026-12-01/09-00-00-ddtree      # re-check a finished job
    python -m ddtree.validate <job dir> --strict --rescore-dtype float32

Runs after the timed generation (never inside it); its seconds are recorded as a share of the job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import Prompt, encode
from ddtree.pipeline.schema import RunConfig, ValidationConfig
from ddtree.pipeline.sweep_table import verdict_cell

VALIDATION_FILE = "validation.json"
STRICT_EXIT = 3  # validation.strict and an output is suspect


class SuspectOutputs(Exception):
    """validation.strict: the job finished and recorded everything, but some output is suspect."""


def enabled(rc: RunConfig) -> bool:
    mode = rc.validation.mode
    return mode == "on" or (mode == "auto" and (rc.baseline or rc.method == "ar"))


def rule_of(v: ValidationConfig):
    from ddtree.engine.validate import ValidationRule

    return ValidationRule(steps=v.steps, calibrate=v.calibrate, calibration_factor=v.calibration_factor,
                          calibration_outputs=v.calibration_outputs, calibration_tokens=v.calibration_tokens,
                          rescore_dtype=v.rescore_dtype,
                          false_alarm=v.false_alarm)


def conversation_inputs(tokenizer, prompt: Prompt, turns: list[dict[str, Any]], rc: RunConfig) -> list[list[int]]:
    """The input ids each turn was generated from: its user turns and this role's earlier answers (as run)."""
    messages: list[dict[str, str]] = []
    out = []
    for rec in sorted(turns, key=lambda r: r["turn"]):
        messages.append({"role": "user", "content": prompt.turns[rec["turn"]]})
        out.append(encode(tokenizer, messages, chat_template=rc.dataset.chat_template,
                          enable_thinking=rc.dataset.enable_thinking))
        messages.append({"role": "assistant", "content": rec["text"]})
    return out


def _compact(verdict) -> dict[str, Any]:
    """What a samples.jsonl record carries: the verdict, its reason and evidence, and the method side's numbers."""
    m = verdict.method
    d = {"verdict": verdict.verdict, "reason": verdict.reason, "side": verdict.side, "position": verdict.position,
         "divergence": verdict.divergence, "worst_margin_steps": m.worst_margin_steps, "near_ties": m.near_ties,
         "mean_logprob": m.mean_logprob}
    if verdict.verdict == "suspect":
        d["misses"] = [vars(x) for c in (m, verdict.baseline) if c is not None and not c.ok for x in c.misses]
    return d


def validate_records(target, tokenizer, prompts: list[Prompt], records: list[dict[str, Any]], rc: RunConfig,
                     stops: list[int], calibrations: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every record (adds `validation` to each, in place); the job's summary of the verdicts.

    calibrations: tolerances already calibrated on this target (the process's model cache), reused by key."""
    import torch

    from ddtree.engine.validate import JobValidation, Validator, logprob_test

    t0 = time.perf_counter()
    validator = Validator(target, rule=rule_of(rc.validation), temperature=rc.temperature, stop_token_ids=stops,
                          max_new_tokens=rc.max_new_tokens)
    by_id = {p.id: p for p in prompts}
    inputs: dict[tuple[str, str, int], list[int]] = {}
    for role in ("baseline", "method"):
        for pid in dict.fromkeys(r["id"] for r in records if r["role"] == role):
            turns = [r for r in records if r["role"] == role and r["id"] == pid]
            if pid not in by_id:
                raise ConfigError("dataset", f"prompt '{pid}' of samples.jsonl is not in the job's dataset",
                                  "re-check with the dataset the job ran")
            for rec, ids in zip(sorted(turns, key=lambda r: r["turn"]),
                                conversation_inputs(tokenizer, by_id[pid], turns, rc), strict=True):
                inputs[(role, pid, rec["turn"])] = ids
    base = {(r["id"], r["turn"]): r for r in records if r["role"] == "baseline"}
    # the AR outputs are the calibration: the baseline's, or the method's own when the method is AR
    ar_role = "baseline" if base else ("method" if rc.method == "ar" else None)
    t_cal = time.perf_counter()
    if rc.validation.calibrate and rc.temperature == 0 and ar_role:
        pairs = [(inputs[(ar_role, r["id"], r["turn"])], r["output_ids"]) for r in records if r["role"] == ar_role]
        calibrated = calibrations if calibrations is not None else {}
        key = json.dumps([vars(validator.rule), pairs[: validator.rule.calibration_outputs]])
        if key not in calibrated:  # a sweep reusing one baseline calibrates once
            calibrated[key] = dataclasses.replace(validator.calibrate(pairs))
        validator.tolerance = dataclasses.replace(calibrated[key])
    job = JobValidation(tolerance=vars(validator.tolerance).copy(), rule=vars(validator.rule).copy(),
                        calibration_seconds=time.perf_counter() - t_cal)
    base_checks = {}
    for key, rec in base.items():
        check, _ = validator.check(inputs[("baseline", *key)], rec["output_ids"])
        base_checks[key] = check
        job.baseline_suspect += not check.ok
        rec["validation"] = {"verdict": "ok" if check.ok else "suspect", "worst_margin_steps":
                             check.worst_margin_steps, "mean_logprob": check.mean_logprob,
                             "misses": [vars(x) for x in check.misses]}
    pairs = []
    for rec in (r for r in records if r["role"] == "method"):
        key = (rec["id"], rec["turn"])
        ids = inputs[("method", *key)]
        b = base.get(key)
        same_input = b is not None and inputs[("baseline", *key)] == ids  # a later turn sees its own answers
        verdict = validator.verdict(ids, rec["output_ids"], b["output_ids"] if same_input else None,
                                    base_checks.get(key) if same_input else None)
        rec["validation"] = _compact(verdict)
        job.add(verdict, {"id": rec["id"], "turn": rec["turn"]})
        if b is not None and verdict.method.mean_logprob is not None and base_checks[key].mean_logprob is not None:
            pairs.append((verdict.method.mean_logprob, base_checks[key].mean_logprob))
    if rc.temperature > 0:
        job.logprob_pvalue, job.logprob_mean_difference = logprob_test(pairs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    job.seconds = time.perf_counter() - t0
    return job.to_dict()


def first_suspect_line(v: dict[str, Any] | None) -> str | None:
    if not v or not v.get("first_suspects"):
        return None
    s = v["first_suspects"][0]
    return f"first suspect: prompt {s['id']} turn {s['turn']}: {s['reason']}"


def check_outputs(models, prompts: list[Prompt], records: list[dict[str, Any]], rc: RunConfig,
                  samples: Path) -> dict[str, Any] | None:
    """The job's hook (rank 0, after the timed generation): verdicts into the records and samples.jsonl."""
    if not enabled(rc):
        return None
    from ddtree.pipeline.models import MODELS

    result = validate_records(models.target, models.tokenizer, prompts, records, rc, models.stops,
                              MODELS.calibrations)
    generation_s = sum(r["total_s"] for r in records if not r.get("reused_from"))
    result["share_of_job"] = result["seconds"] / (result["seconds"] + generation_s) if generation_s else None
    with samples.open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(rec) + "\n" for rec in records)
    return result


def report_suspects(rc: RunConfig, summary: dict[str, Any]) -> None:
    """Print the first suspect's evidence; under validation.strict raise SuspectOutputs (exit 3)."""
    v = summary.get("validation")
    line = first_suspect_line(v)
    if line:
        print(line, flush=True)
    if v and v["suspect"] and rc.validation.strict:
        raise SuspectOutputs(f"validation.strict: {v['suspect']} of {v['checked']} outputs are suspect — "
                             "see 'validation' in summary.json and samples.jsonl")


# ---------------------------------------------------------------- python -m ddtree.validate <job dir>


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
    from ddtree.pipeline.datasets import load_dataset_prompts
    from ddtree.pipeline.job import SAMPLES, stop_token_ids
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
    from ddtree.pipeline.cli import tracebacks_wanted, user_error

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


def tolerance_line(v: dict[str, Any]) -> str:
    t, factor = v["tolerance"], v["rule"]["calibration_factor"]
    floor = (f", floor {t['floor']:.3g} ({factor:g}x the drift over {t['calibrated_positions']} AR positions)"
             if t.get("calibrated_positions") else "")
    return f"{t['steps']:g} {t['dtype']} steps{floor}"
