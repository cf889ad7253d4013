"""`budget=auto`: pick DDTree's node budget without a sweep.

Before the job's own generations (untimed, not recorded in samples.jsonl):

1. calibration: DDTree at `auto.calibration_budget` on the first `auto.prompts` prompts, keeping the per-round records
   (ddtree.engine.diagnostics);
2. cost: one short generation (`auto.cost_tokens` new tokens) of AR and of DDTree at every candidate budget on the first
   prompt, timed by the engine's stages (ms per round), unless `auto.cost` names a table (ddtree.diagnose --cost format);
3. the diagnosis model (ddtree.pipeline.diagnose) predicts tau at each candidate from the calibration's records; the
   predicted speedup is tau x AR ms per token / round ms; the job runs at the best candidate.

summary.json's `auto_budget` keeps the prediction, the costs, the choice and, after the job, the outcome (measured tau
and speedup beside the predicted ones).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.pipeline.conversation import JobContext, run_conversation
from ddtree.pipeline.diagnose import JobData, collect, predicted_curves, read_cost_table


def _round_ms(res) -> float:
    return 1000 * sum(res.stage_seconds.values()) / max(1, res.rounds)


def choose_budget(models, prompts, rc, files, cache) -> dict[str, Any]:
    """Calibrate, measure the costs, predict, choose: sets rc.budget and returns the record for summary.json.
    files, cache: the job's (ddtree.pipeline.conversation.JobContext); the calibration's engines are closed on return."""
    t0 = time.perf_counter()
    a = rc.auto
    cal_budget = int(a.calibration_budget)
    candidates = sorted({int(b) for b in a.candidates})
    contexts: dict = {}  # one JobContext (so one Engine) per (method, budget)

    def run(prompt, budget: int | None, method: str, new: int | None = None):
        rc.budget = budget if budget is not None else cal_budget
        ctx = contexts.setdefault((method, rc.budget), JobContext(rc, models, files, cache, show_progress=False))
        return [res for _, res, _ in run_conversation(ctx, prompt, method, max_new_tokens=new)]

    calib = [res for p in prompts[: a.prompts] for res in run(p, cal_budget, "ddtree")]
    records = [r.diagnosis for r in calib if r.diagnosis]
    job = JobData("calibration", "ddtree", cal_budget, {}, [{"diagnosis": d} for d in records])
    if not job.diagnosed:
        raise ConfigError("budget", "budget=auto: the calibration recorded no rounds", "use a number")
    L = max(len(d.get("nodes", [])) - 1 for d in records) if any("nodes" in d for d in records) else None
    pred, _ = predicted_curves(collect(records, L), tuple(sorted(set(candidates) | {cal_budget})), records)
    if a.cost is not None:
        table = read_cost_table(Path(a.cost))
        round_ms, ar_ms, source = table["round_ms"], table["ar_ms"], f"table {a.cost}"
        if ar_ms is None or any(b not in round_ms for b in candidates):
            raise ConfigError("auto.cost", f"{a.cost} needs an 'ar' row and every candidate budget "
                              f"({', '.join(map(str, candidates))})", "add the rows, or auto.cost=null to measure")
    else:
        first = prompts[0]
        ar = run(first, None, "ar", a.cost_tokens)[0]
        ar_ms = 1000 * ar.decode_s / max(1, ar.rounds)
        round_ms = {b: _round_ms(run(first, b, "ddtree", a.cost_tokens)[0]) for b in candidates}
        source = f"measured: one generation of {a.cost_tokens} tokens per budget"
    speedup = {b: pred[b] * ar_ms / round_ms[b] for b in candidates if round_ms.get(b)}
    best = max(speedup, key=lambda b: (speedup[b], -b))
    for ctx in contexts.values():
        ctx.close()
    rc.budget = best
    return {"calibration_budget": cal_budget, "calibration_prompts": min(a.prompts, len(prompts)),
            "calibration_rounds": sum(len(d["depth"]) for d in records), "cost_source": source,
            "ar_ms_per_token": ar_ms, "round_ms": {b: round_ms[b] for b in candidates},
            "predicted_tau": {b: pred[b] for b in candidates}, "predicted_speedup": speedup,
            "chosen": best, "seconds": time.perf_counter() - t0}


def outcome_line(o: dict[str, Any]) -> str:
    """The job's line on budget=auto's outcome; a job without a decoding round (max_new_tokens=1: the prefill's token
    alone, or every prompt stopped at its first token) measured no tau to set beside the prediction."""
    predicted = f"predicted tau {o['predicted_tau']:.2f}, speedup {o['predicted_speedup']:.2f}x"
    if o["measured_tau"] is None:
        return f"budget=auto outcome: no decoding round ran (each answer ended at its first token): {predicted}"
    speedup = "n/a" if o["measured_speedup"] is None else f"{o['measured_speedup']:.2f}x"
    return (f"budget=auto outcome: tau {o['measured_tau']:.2f} (predicted {o['predicted_tau']:.2f}), speedup "
            f"{speedup} (predicted {o['predicted_speedup']:.2f}x)")


def outcome(auto: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The job's measured tau and speedup beside the prediction for the chosen budget."""
    b = auto["chosen"]
    tau, sp = summary.get("tau"), summary.get("speedup")
    pt, ps = auto["predicted_tau"][b], auto["predicted_speedup"][b]
    return {"budget": b, "predicted_tau": pt, "measured_tau": tau, "predicted_speedup": ps, "measured_speedup": sp,
            "tau_error": (pt - tau) / tau if tau else None}
