"""A verdict for every output of a job (ddtree.engine.output_check over samples.jsonl), and the re-check CLI.

    python -m ddtree.validate runs/2026-12-01/09-00-00-ddtree      # re-check a finished job
    python -m ddtree.validate <job dir> --strict --rescore-dtype float32

Runs after the timed generation (never inside it); its seconds are recorded as a share of the job.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from ddtree.engine.methods import BASELINE
from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import Prompt, encode
from ddtree.pipeline.schema import RunConfig, ValidationConfig

VALIDATION_FILE = "validation.json"
STRICT_EXIT = 3  # validation.strict and an output is suspect


class SuspectOutputs(Exception):
    """validation.strict: the job finished and recorded everything, but some output is suspect."""


def enabled(rc: RunConfig) -> bool:
    mode = rc.validation.mode
    return mode == "on" or (mode == "auto" and (rc.baseline or rc.method == BASELINE))


def rule_of(v: ValidationConfig):
    from ddtree.engine.output_check import ValidationRule

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


def decode_shape(rec: dict[str, Any], rc: RunConfig):
    """How a record's output was computed (its method's verified rows, its rounds): the shape a miss's second
    opinion replays (ddtree.engine.output_check.DecodeShape). Another engine's outputs: AR's, token by token."""
    from ddtree.engine.methods import METHODS, verified_rows
    from ddtree.engine.output_check import DecodeShape

    spec = METHODS.get(rec.get("method"))
    own = getattr(rc, spec.settings, None) if spec is not None and spec.settings else None  # rc.<Method.settings>, e.g. rc.mtp
    width = verified_rows(rec.get("method"), rec.get("budget"), rec.get("block_size"),
                          getattr(own, "steps", None), getattr(own, "topk", None))
    return DecodeShape(width=width, acceptance_lengths=rec.get("acceptance_lengths"))


def _compact(verdict) -> dict[str, Any]:
    """What a samples.jsonl record carries: the verdict, its reason and evidence, and the method side's numbers."""
    m = verdict.method
    d = {"verdict": verdict.verdict, "reason": verdict.reason, "side": verdict.side, "position": verdict.position,
         "divergence": verdict.divergence, "worst_margin_steps": m.worst_margin_steps, "near_ties": m.near_ties,
         "mean_logprob": m.mean_logprob}
    if m.num_shape_ties:  # positions the target computes differently in another shape (docs/validation.md)
        d.update(num_shape_ties=m.num_shape_ties, shape_ties=m.shape_ties)
    if verdict.verdict == "suspect":
        d["misses"] = [vars(x) for c in (m, verdict.baseline) if c is not None and not c.ok for x in c.misses]
    return d


def validate_records(target, tokenizer, prompts: list[Prompt], records: list[dict[str, Any]], rc: RunConfig,
                     stops: list[int], calibrations: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every record (adds `validation` to each, in place); the job's summary of the verdicts.

    calibrations: tolerances already calibrated on this target (the process's model cache), reused by key."""
    import torch

    from ddtree.engine.output_check import JobValidation, Validator
    from ddtree.engine.stats import logprob_test

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
    ar_role = "baseline" if base else ("method" if rc.method == BASELINE else None)
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
        check, _ = validator.check(inputs[("baseline", *key)], rec["output_ids"], shape=decode_shape(rec, rc))
        base_checks[key] = check
        job.baseline_suspect += not check.ok
        job.shape_ties += check.num_shape_ties
        rec["validation"] = {"verdict": "ok" if check.ok else "suspect", "worst_margin_steps":
                             check.worst_margin_steps, "mean_logprob": check.mean_logprob,
                             "misses": [vars(x) for x in check.misses]}
        if check.num_shape_ties:
            rec["validation"].update(num_shape_ties=check.num_shape_ties, shape_ties=check.shape_ties)
    pairs = []
    for rec in (r for r in records if r["role"] == "method"):
        key = (rec["id"], rec["turn"])
        ids = inputs[("method", *key)]
        b = base.get(key)
        same_input = b is not None and inputs[("baseline", *key)] == ids  # a later turn sees its own answers
        verdict = validator.verdict(ids, rec["output_ids"], b["output_ids"] if same_input else None,
                                    base_checks.get(key) if same_input else None, shape=decode_shape(rec, rc))
        rec["validation"] = _compact(verdict)
        job.shape_ties += verdict.method.num_shape_ties
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
                  samples: Path, calibrations: dict[str, Any], generation_s: float | None = None) -> dict[str, Any] | None:
    """The job's hook (rank 0, after the timed generation): verdicts into the records and samples.jsonl.
    calibrations: tolerances calibrated on this target before (the process's model cache keeps them); generation_s:
    the seconds the job spent generating (None: the records' own, one prompt at a time; batched streams overlap)."""
    if not enabled(rc):
        return None
    result = validate_records(models.target, models.tokenizer, prompts, records, rc, models.stops, calibrations)
    if generation_s is None:
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


def tolerance_line(v: dict[str, Any]) -> str:
    t, factor = v["tolerance"], v["rule"]["calibration_factor"]
    floor = (f", floor {t['floor']:.3g} ({factor:g}x the drift over {t['calibrated_positions']} AR positions)"
             if t.get("calibrated_positions") else "")
    flips = (f"; {t['routing_flips']} calibration rows where a MoE router chose other experts, left out"
             if t.get("routing_flips") else "")
    return f"{t['steps']:g} {t['dtype']} steps{floor}{flips}"
