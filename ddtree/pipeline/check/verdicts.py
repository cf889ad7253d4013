"""ddtree.check's verdicts: one per output by output_check's rule (`method_side_verdict`, its one home) with a
suspect's sampler hint, the T > 0 goodness-of-fit tests (ddtree.engine.stats), and the summary of a check."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ddtree.pipeline.check.config import CHECK_FILE, CheckConfig
from ddtree.pipeline.check.gather import Gathered, find_baseline
from ddtree.pipeline.endpoint import sampler_fields
from ddtree.pipeline.prompts import Prompt
from ddtree.pipeline.schema import RunConfig

CHECK_VERDICTS = ("exact", "tie", "ok", "suspect")


# ---------------------------------------------------------------- the verdict of one output


def sampler_hint(miss: dict[str, Any], context: list[int]) -> str | None:
    """What a suspect's evidence says when it looks like a sampler setting rather than the decoding (None: it does
    not): the emitted token is the target's runner-up, or the target's choice already stands in the context more
    often than the emitted token (what a repetition, presence or frequency penalty pushes down). The verdict stays."""
    if miss.get("kind") not in ("not_argmax", "stop_not_chosen") or miss.get("expected") is None:
        return None
    want, got = miss["expected"], miss["emitted"]
    signs = []
    if miss.get("emitted_rank") == 1:
        signs.append("the emitted token is the target's runner-up")
    seen, seen_got = context.count(want), context.count(got)
    if seen > seen_got:
        signs.append(f"the target's choice {want} already occurs {seen}x in the context (the emitted {got}: "
                     f"{seen_got}x)")
    if not signs:
        return None
    return (" and ".join(signs) + ": this is what a sampler setting the server applies does (a repetition, presence "
            "or frequency penalty, min_p, top_k, DRY): compare summary.json's `sampler` (what ddtree sent) with the "
            "server's settings; switch off any other with endpoint.extra (docs/check.md)")


def check_verdict(v: dict[str, Any], temperature: float, prompt_ids: list[int] | None = None,
                  output_ids: list[int] | None = None) -> dict[str, Any]:
    """This check's verdict of one output from its validation record (ddtree.pipeline.output_verdicts):
    the engine's output alone against the target; a baseline that failed its own check does not count here.
    `prompt_ids`, `output_ids`: what the output was generated from and what it is (a suspect's sampler hint)."""
    from ddtree.engine.output_check import method_side_verdict

    verdict = method_side_verdict(v, temperature)  # the rule's one home: ddtree.engine.output_check
    failed = verdict == "suspect"
    out = {"verdict": verdict, "worst_margin_steps": v.get("worst_margin_steps"), "near_ties": v.get("near_ties"),
           "mean_logprob": v.get("mean_logprob")}
    if v.get("num_shape_ties"):
        out.update(num_shape_ties=v["num_shape_ties"], shape_ties=v["shape_ties"])
    if failed:
        misses = list(v.get("misses", []))[:3]
        out.update(reason=v["reason"].removeprefix("method: ").removeprefix("both: "), position=v.get("position"),
                   misses=misses)
        first = misses[0] if misses else None
        hint = None
        if first and temperature == 0 and prompt_ids is not None and output_ids is not None:
            hint = sampler_hint(first, list(prompt_ids) + list(output_ids[: first["position"]]))
        if hint:
            out.update(reason=f"{out['reason']}; {hint}", sampler_hint=hint)
    return out


def _suspect_inputs(tokenizer, prompts: list[Prompt], records: list[dict[str, Any]],
                    rc: RunConfig) -> dict[tuple[str, int], list[int]]:
    """The input ids of every turn of an output that has a suspect turn (its sampler hint reads the context)."""
    from ddtree.pipeline.output_verdicts import conversation_inputs

    by_id = {p.id: p for p in prompts}
    out: dict[tuple[str, int], list[int]] = {}
    for pid in dict.fromkeys(r["id"] for r in records if r["validation"].get("verdict") == "suspect"):
        turns = sorted((r for r in records if r["id"] == pid), key=lambda r: r["turn"])
        for rec, ids in zip(turns, conversation_inputs(tokenizer, by_id[pid], turns, rc), strict=True):
            out[(pid, rec["turn"])] = list(ids)
    return out


def judge(cc: CheckConfig, rc: RunConfig, target, tokenizer, prompts: list[Prompt], g: Gathered, stops: list[int],
          job_dir: Path) -> dict[str, Any]:
    """Verdicts for every gathered output (and the baseline comparison, the T > 0 report); check.jsonl rewritten."""
    from ddtree.pipeline.output_verdicts import validate_records

    records = g.records
    baseline_dir, base = find_baseline(cc, {r["prompt_id"] for r in records})
    base_recs = []
    for r in records:
        b = base.get((r["prompt_id"], r["turn"]))
        if b is not None:
            base_recs.append({"id": r["id"], "turn": r["turn"], "role": "baseline", "output_ids": b["output_ids"],
                              "text": b.get("text", "")})
    validation = validate_records(target, tokenizer, prompts, records + base_recs, rc, stops)
    by_key = {(b["id"], b["turn"]): b for b in base_recs}
    inputs = _suspect_inputs(tokenizer, prompts, records, rc)
    for r in records:
        r["check"] = check_verdict(r["validation"], cc.temperature, inputs.get((r["id"], r["turn"])), r["output_ids"])
        b = by_key.get((r["id"], r["turn"]))
        if b is not None:
            r["baseline_equal"] = b["output_ids"] == r["output_ids"]
            r["baseline_verdict"] = r["validation"]["verdict"]  # against ddtree's AR output (docs/validation.md)
    sampling = sampling_report(target, tokenizer, prompts, records, rc, cc.repeats) if cc.temperature > 0 else None
    with (job_dir / CHECK_FILE).open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    return summarize(cc, records, validation, baseline_dir, base, g.acceptance, sampling,
                     complete=g.error is None, error=str(g.error) if g.error else None)


# ---------------------------------------------------------------- T > 0


def sampling_report(target, tokenizer, prompts: list[Prompt], records: list[dict[str, Any]], rc: RunConfig,
                    repeats: int) -> dict[str, Any]:
    """Per-position target probabilities of what was sampled (into each record), and two goodness-of-fit tests:
    the first token of each repeated prompt against the target's distribution there (chi-square), and the
    randomized PIT of every sampled token (uniform when sampling is right; chi-square over 10 bins)."""
    import torch

    from ddtree.engine.output_check import teacher_forced_logits
    from ddtree.engine.stats import chi_square_pvalue, pooled_chi_square, sampled_pit, token_logprobs
    from ddtree.pipeline.output_verdicts import conversation_inputs

    T = rc.temperature
    by_id = {p.id: p for p in prompts}
    gen = torch.Generator().manual_seed(rc.seed)
    pits: list[torch.Tensor] = []
    first: dict[str, tuple[torch.Tensor, list[int]]] = {}  # prompt id -> (target probs at position 0, tokens drawn)
    for pid in dict.fromkeys(r["id"] for r in records):
        turns = sorted((r for r in records if r["id"] == pid), key=lambda r: r["turn"])
        for rec, ids in zip(turns, conversation_inputs(tokenizer, by_id[pid], turns, rc), strict=True):
            out = rec["output_ids"]
            if not out:
                continue
            logits = teacher_forced_logits(target, ids, out)
            lp = token_logprobs(logits, out, T)
            rec["target_probs"] = [float(f"{x:.6g}") for x in lp.exp().tolist()]
            pits.append(sampled_pit(logits, out, T, gen))
            if rec["turn"] == 0:
                probs, drawn = first.setdefault(rec["prompt_id"], (torch.softmax(logits[0].double() / T, -1).cpu(), []))
                drawn.append(out[0])
    report: dict[str, Any] = {"temperature": T}
    if pits:
        u = torch.cat(pits)
        counts = torch.histc(u, bins=10, min=0.0, max=1.0).tolist()
        stat, dof, pv = chi_square_pvalue(counts, [len(u) / 10] * 10)
        report["pit"] = {"tokens": len(u), "chi2": stat, "dof": dof, "pvalue": pv}
    if repeats > 1:
        tests = []
        for pid, (probs, drawn) in first.items():
            tests.append({"prompt": pid, "samples": len(drawn), **pooled_chi_square(probs, drawn)})
        report["first_token"] = tests
    return report


# ---------------------------------------------------------------- summary


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(cc: CheckConfig, records: list[dict[str, Any]], validation: dict[str, Any], baseline_dir: str | None,
              baseline: dict[tuple[str, int], dict], acceptance: dict[str, Any] | None,
              sampling: dict[str, Any] | None, complete: bool, error: str | None) -> dict[str, Any]:
    from ddtree.pipeline.datasets import dataset_label

    counts = {k: sum(r["check"]["verdict"] == k for r in records) for k in CHECK_VERDICTS}
    suspects = [r for r in records if r["check"]["verdict"] == "suspect"]
    positions = [r["check"]["position"] for r in suspects if r["check"].get("position") is not None]
    compared = [r for r in records if "baseline_equal" in r]
    equal = sum(r["baseline_equal"] for r in compared)
    tokens = sum(r["num_new_tokens"] for r in records)
    seconds = sum(r.get("latency_s") or 0.0 for r in records)
    server = _server_acceptance(records, acceptance)
    source = cc.endpoint.url if cc.source == "endpoint" else cc.file.path
    v = {**{k: validation.get(k) for k in ("tolerance", "rule", "seconds", "calibration_seconds")},
         "checked": len(records), **counts,
         "first_suspects": [{"id": r["prompt_id"], "repeat": r["repeat"], "turn": r["turn"],
                             "reason": r["check"]["reason"], "position": r["check"].get("position")}
                            for r in suspects[:3]],
         "first_suspect_position": min(positions) if positions else None,
         "median_first_suspect_position": statistics.median(positions) if positions else None}
    return {
        "check": True, "source": cc.source, "from": source, "served_model": cc.endpoint.model,
        **({"server": cc.endpoint.server, "sampler": {"temperature": cc.temperature, "top_p": 1.0, **sampler_fields(
            cc.endpoint.server, cc.endpoint.api, cc.temperature, cc.endpoint.extra)}} if cc.source == "endpoint" else {}),
        "model": cc.model.name, "method": f"check:{cc.source}", "budget": None, "block_size": None,
        "temperature": cc.temperature, "max_new_tokens": cc.max_new_tokens,
        "dataset": dataset_label(cc.dataset) if cc.source == "endpoint" else Path(cc.file.path).stem,
        "num_prompts": len({r["prompt_id"] for r in records}), "outputs": len(records), "repeats": cc.repeats,
        "complete": complete, "error": error,
        "tau": (server or {}).get("mean_acceptance_length"),
        "tokens_per_s": tokens / seconds if seconds > 0 else None, "latency_s_mean": _mean([r.get("latency_s")
                                                                                           for r in records]),
        "new_tokens": tokens, "baseline_tokens_per_s": None, "speedup": None,
        "match_rate": equal / len(compared) if compared else None,
        "ids_from": {k: sum(r["ids_from"] == k for r in records) for k in ("engine", "text")},
        "stops_appended": sum(r["stop_appended"] for r in records),
        "prompt_mismatches": sum(1 for r in records if r.get("prompt_ids_match") is False
                                 or (r.get("server_prompt_tokens") not in (None, r.get("prompt_tokens"))
                                     and r.get("prompt_ids_match") is None)),
        "baseline": {"job_dir": baseline_dir, "compared": len(compared), "equal": equal} if baseline_dir else None,
        "server_acceptance": server,
        "validation": v,
        "sampling": sampling,
    }


def _server_acceptance(records: list[dict[str, Any]], vllm: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server's own speculative-decoding report: vLLM counters, else SGLang's or llama.cpp's per request."""
    if vllm:
        return {"reported_by": "vllm /metrics", **vllm}
    acc = [r["server_acceptance"] for r in records if r.get("server_acceptance")]
    if not acc:
        return None
    if any("spec_verify_ct" in a for a in acc):  # SGLang: tokens per verification = mean acceptance length
        steps = sum(a.get("spec_verify_ct", 0) for a in acc)
        toks = sum(r.get("server_completion_tokens") or r["num_new_tokens"] for r in records if r.get("server_acceptance"))
        return {"reported_by": "sglang meta_info", "verify_steps": steps,
                "mean_acceptance_length": toks / steps if steps else None}
    drafted = sum(a.get("draft_n", 0) for a in acc)
    accepted = sum(a.get("draft_n_accepted", 0) for a in acc)
    return {"reported_by": "llama.cpp timings", "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def summary_line(s: dict[str, Any]) -> str:
    from ddtree.pipeline.sweep_table import verdict_cell

    v = s["validation"]
    line = f"{s['from']}: {verdict_cell(v)} of {v['checked']} outputs"
    if s["baseline"]:
        line += f"; {s['baseline']['equal']}/{s['baseline']['compared']} equal ddtree's AR outputs"
    if v["first_suspect_position"] is not None:
        line += f"; first suspect position {v['first_suspect_position']}"
    if s["prompt_mismatches"]:
        line += (f"; WARNING: for {s['prompt_mismatches']} outputs the server's prompt length differs from ddtree's "
                 "encoding (another chat template?)")
    if s.get("sampling") and s["sampling"].get("pit"):
        line += f"; PIT p={s['sampling']['pit']['pvalue']:.3g}"
    return line
