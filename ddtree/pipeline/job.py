"""One job of `python -m ddtree.run`: the baseline and the method on every prompt, recorded.

Each job writes samples.jsonl (appended as prompts finish) and summary.json into its Hydra job dir
under runs/, prints a short table and, with tracking=mlflow, records a run. `run_job` is a short
sequence of named phases; the entry point and its one-line errors are ddtree.pipeline.cli, the model
cache ddtree.pipeline.models.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddtree.engine.methods import BASELINE, METHODS, loads_drafter, reads_budget
from ddtree.engine.result import STAGES
from ddtree.pipeline import distributed as D
from ddtree.pipeline.autobudget import choose_budget, outcome, outcome_line
from ddtree.pipeline.config_checks import check_attention_settings, validate
from ddtree.pipeline.console import Progress, library_bars_off_outside_a_terminal
from ddtree.pipeline.conversation import (
    SAMPLES,
    JobContext,
    JobFiles,
    LoadedModels,
    run_batch,
    run_conversation,
    stop_token_ids,
)
from ddtree.pipeline.datasets import dataset_label, load_dataset_prompts
from ddtree.pipeline.models import (
    MODELS,
    ModelCache,
    cache_key,
    get_models,
    load_tokenizer,
    load_upstream,
    model_device,
    resolve_device,
)
from ddtree.pipeline.output_verdicts import check_outputs, report_suspects
from ddtree.pipeline.preflight import (
    attention_backends,
    attention_line,
    check_concurrency_fits,
    check_prompt_lengths,
    check_prompt_tokens,
    preflight,
)
from ddtree.pipeline.prompts import Prompt, encode, fingerprint
from ddtree.pipeline.resume import find_resume, write_job_file
from ddtree.pipeline.schema import (
    REPO_ROOT,
    RunConfig,
    flatten,
    identity_dict,
    method_settings,
    method_topk,
    resolved_dict,
    to_run_config,
    tracking_uri,
)
from ddtree.pipeline.sweep_table import SKIPPED, claim_config, format_table

# ---------------------------------------------------------------- compat


def apply_compat(rc: RunConfig) -> list[dict[str, Any]]:
    """compat.apply(only=, skip=); its report (one dict per patch). compat.enabled=false: nothing applied."""
    if not rc.compat.enabled:
        return []
    import compat
    from ddtree.engine import gdn

    # an unknown patch id raises ConfigError itself; engine= keeps the authors'-code rows out of native runs
    return compat.apply(only=rc.compat.only, skip=list(rc.compat.skip), engine=rc.engine, provided=gdn.provided())


# ---------------------------------------------------------------- one job


def baseline_key(rc: RunConfig, mine: list[Prompt], target_key: str | None) -> str:
    """Everything the AR baseline's tokens and timings depend on: the loaded target (its cache key) and settings."""
    return cache_key(target_key, fingerprint(mine), rc.temperature, rc.seed, rc.max_new_tokens,
                rc.dataset.chat_template, rc.dataset.enable_thinking, rc.engine, rc.upstream.path,
                OmegaConf.to_container(OmegaConf.structured(rc.compat)), rc.warmup,
                *([rc.concurrency] if rc.concurrency > 1 else []))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over generations: tau = committed tokens / rounds; tokens/s = new tokens / wall seconds."""
    tokens = sum(r["num_new_tokens"] for r in records)
    seconds = sum(r["total_s"] for r in records)
    rounds = sum(len(r["acceptance_lengths"]) for r in records)
    committed = sum(sum(r["acceptance_lengths"]) for r in records)
    return {
        "generations": len(records), "new_tokens": tokens, "rounds": rounds, "seconds": seconds,
        "tau": committed / rounds if rounds else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "ttft_s_mean": _mean([r["ttft_s"] for r in records]),
        "decode_s_mean": _mean([r["decode_s"] for r in records]),
        "stage_seconds_mean": {s: _mean([r["stage_seconds"].get(s, 0.0) for r in records]) for s in STAGES},
        "stage_ms_per_round": {s: (1000 * sum(r["stage_seconds"].get(s, 0.0) for r in records) / rounds
                                   if rounds else None) for s in STAGES},
    }


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of xs, linearly interpolated between the closest ranks; None without values."""
    if not xs:
        return None
    ys = sorted(xs)
    at = (len(ys) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (at - lo)


def load_figures(records: list[dict[str, Any]], batch_s: float | None) -> dict[str, Any]:
    """A role's figures under load: throughput_tok_s = every stream's new tokens over the wall seconds they took
    (`wall_s`: the generate_many calls' wall seconds when the job batched them, `batch_s`; one prompt at a time, the
    sum of the generations' total seconds), and each stream's latency (total_s = ttft_s + decode_s): median, p90.
    Batched, the records a rerun took from the job it continues are not in the throughput (their calls' seconds are
    that job's)."""
    timed = records if batch_s is None else [r for r in records if not r.get("resumed_from")]
    wall = sum(r["total_s"] for r in timed) if batch_s is None else batch_s
    tokens = sum(r["num_new_tokens"] for r in timed)
    lat = [r["total_s"] for r in records]
    return {"throughput_tok_s": tokens / wall if wall > 0 else None, "wall_s": wall,
            "latency_s": {"median": percentile(lat, 50), "p90": percentile(lat, 90)}}


def round_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Which round made these generations ("compiled", "eager", or both: "compiled+eager"), why (what) ran
    eagerly, and whether that was a fallback from the compiled round the setting asked for; None without records
    (records from before the field say nothing)."""
    kinds = sorted({r["round"] for r in records if r.get("round")})
    if not kinds:
        return None
    notes = list(dict.fromkeys(r["round_note"] for r in records if r.get("round_note")))
    return {"ran": "+".join(kinds), "why": "; ".join(notes) or None,
            "fallback": any(r.get("round_fallback") for r in records)}


def summarize(records: list[dict[str, Any]], rc: RunConfig, extra: dict[str, Any],
              batch_s: dict[str, float] | None = None) -> dict[str, Any]:
    """The job's summary.json. batch_s: the wall seconds of the batched calls by role ("method", "baseline") when
    the job ran with concurrency > 1 (load_figures)."""
    batch_s = batch_s or {}
    meth = [r for r in records if r["role"] == "method"]
    spec = METHODS[rc.method]
    base = [r for r in records if r["role"] == "baseline"]
    m = {**aggregate(meth), **load_figures(meth, batch_s.get("method"))}
    b = {**aggregate(base), **load_figures(base, batch_s.get("baseline"))} if base else (
        m if rc.method == BASELINE else None)
    match_rate = None
    if base and rc.temperature == 0:
        ref = {(r["id"], r["turn"]): r["output_ids"] for r in base}
        by_prompt: dict[str, bool] = {}
        for r in meth:
            by_prompt[r["id"]] = by_prompt.get(r["id"], True) and ref.get((r["id"], r["turn"])) == r["output_ids"]
        match_rate = sum(by_prompt.values()) / len(by_prompt) if by_prompt else None
    speedup = (m["tokens_per_s"] / b["tokens_per_s"]) if b and m["tokens_per_s"] and b["tokens_per_s"] else None
    block = next((r["block_size"] for r in meth if r.get("block_size")), None)
    return {
        "engine": rc.engine,
        "method": rc.method, "budget": rc.budget if reads_budget(rc.method, method_topk(rc)) else None, "block_size": block,
        "temperature": rc.temperature, "model": rc.model.name,
        "drafter": (spec.drafter_kind and spec.drafter_kind.summary) or rc.drafter.name_or_path or rc.drafter.kind,
        **({spec.settings: {"steps": method_settings(rc).steps, "topk": method_settings(rc).topk}}
           if spec.settings else {}),
        **({"scoring": rc.scoring} if spec.reads_scoring else {}),
        "dataset": dataset_label(rc.dataset),
        "num_prompts": len({r["id"] for r in meth}),
        "concurrency": rc.concurrency,
        "tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
        "throughput_tok_s": m["throughput_tok_s"], "wall_s": m["wall_s"], "latency_s": m["latency_s"],
        "baseline_tokens_per_s": b["tokens_per_s"] if b else None, "speedup": speedup, "match_rate": match_rate,
        "new_tokens": m["new_tokens"], "rounds": m["rounds"], "ttft_s_mean": m["ttft_s_mean"],
        "decode_s_mean": m["decode_s_mean"], "stage_seconds_mean": m["stage_seconds_mean"],
        "stage_ms_per_round": m["stage_ms_per_round"],
        "baseline": {k: b[k] for k in ("tau", "tokens_per_s", "new_tokens", "ttft_s_mean", "decode_s_mean",
                                       "throughput_tok_s", "wall_s", "latency_s")} if base else None,
        "compile": rc.compile, "round": round_summary(meth), "baseline_round": round_summary(base),
        **extra,
    }


def environment(device: str, compat_report: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import transformers

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
    try:
        own = importlib.metadata.version("ddtree")
    except importlib.metadata.PackageNotFoundError:
        own = None
    applied = [r["id"] for r in compat_report if r.get("status") == "applied"]
    return {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "ddtree": own},
            "device": device, "device_name": name,
            "compat": {"applied": applied, "patches": {r["id"]: r.get("status") for r in compat_report}}}


# ---------------------------------------------------------------- the job's phases


def job_dirs() -> tuple[Path, Path | None, list[str], Path | None]:
    """(job dir, sweep dir when this job is part of a multirun, this job's overrides, its log file)."""
    try:
        hc = HydraConfig.get()
    except ValueError:  # called without Hydra (a notebook): write to the cwd
        return Path.cwd(), None, [], None
    from hydra.types import RunMode

    job_dir = Path(hc.runtime.output_dir).resolve()
    sweep = Path(str(hc.sweep.dir)).resolve() if hc.mode == RunMode.MULTIRUN else None
    return job_dir, sweep, list(hc.overrides.task), job_dir / f"{hc.job.name}.log"


def run_name(rc: RunConfig) -> str:
    name = f"{rc.model.name}-{rc.method}" + (f"-b{rc.budget}" if reads_budget(rc.method, method_topk(rc)) else "")
    m = METHODS.get(rc.method)
    name += "-pair" if m is not None and m.reads_scoring and rc.scoring == "pair" else ""
    name += f"-x{rc.concurrency}" if rc.concurrency > 1 else ""  # streams at once (one prompt at a time: as before)
    return name + ("-upstream" if rc.engine == "upstream" else "")


def configure(cfg: DictConfig | RunConfig) -> tuple[RunConfig, list[Prompt], dict[str, Any]]:
    """The validated config, its prompts and its identity (what decides the results), before any model work."""
    rc = to_run_config(cfg)
    if rc.dataset.path:
        rc.dataset.path = hydra.utils.to_absolute_path(rc.dataset.path)
    rc = validate(rc)
    prompts = load_dataset_prompts(rc.dataset)
    facts = preflight(rc)  # every source there, before the store opens or a weight loads
    check_attention_settings(rc)  # attention=auto's choice (preflight makes it), checked as an explicit setting is
    if facts is not None:  # the tokenizer is on disk: the prompts as the job will encode them
        tokenizer, setting = load_tokenizer(rc), "dataset.path" if rc.dataset.path else "dataset"
        check_prompt_tokens(prompts, tokenizer, setting)
        checks_lengths = facts.context is not None and not rc.dataset.truncate
        lengths = first_turn_lengths(rc, prompts, tokenizer) if checks_lengths or rc.concurrency > 1 else None
        if checks_lengths:
            check_prompt_lengths(prompts, lengths, rc.max_new_tokens, facts.context, False, setting)
        if rc.concurrency > 1:  # its streams in the GPU's memory after the weights (CUDA; before any weight loads)
            check_concurrency_fits(rc, facts, longest_conversation(rc, prompts, tokenizer, lengths, facts.context))
    identity = identity_dict(rc)
    identity["prompts"] = fingerprint(prompts)
    return rc, prompts, identity


def first_turn_lengths(rc: RunConfig, prompts: list[Prompt], tokenizer) -> list[int]:
    """Tokens of each prompt's first turn as the job encodes it (later turns follow the model's answers)."""
    return [len(encode(tokenizer, [{"role": "user", "content": p.turns[0]}], chat_template=rc.dataset.chat_template,
                       enable_thinking=rc.dataset.enable_thinking)) for p in prompts]


def longest_conversation(rc: RunConfig, prompts: list[Prompt], tokenizer, lengths: list[int],
                         context: int | None) -> int:
    """The most tokens one stream's cache holds: over the prompts, the first turn as encoded, each later turn's
    words and every turn's max_new_tokens (a later turn sees the answers; its template's few tokens are not
    counted), at most the target's context."""
    longest = max((n + sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in p.turns[1:])
                   + len(p.turns) * rc.max_new_tokens for p, n in zip(prompts, lengths, strict=True)), default=0)
    return min(longest, context) if context else longest


def open_files(world) -> JobFiles:
    """Rank 0's job dir for every rank, with this rank's samples file started fresh."""

    job_dir, sweep_dir, overrides, log_file = D.broadcast(job_dirs(), world)
    job_dir.mkdir(parents=True, exist_ok=True)
    files = JobFiles(job_dir, sweep_dir, overrides, log_file,
                     job_dir / D.rank_samples_name(world.rank) if world.is_distributed else job_dir / SAMPLES)
    return files


def already_finished(rc: RunConfig, tracker, chash: str, world, files: JobFiles) -> bool:
    """Whether the tracking store holds a finished run of this config (force=true reruns it)."""

    done = D.broadcast(None if rc.force else tracker.finished_run(chash), world)
    if done and world.is_main:
        print(f"skipped: this config already finished as MLflow run {done} in experiment "
              f"'{rc.tracking.experiment}' ({' '.join(files.overrides) or 'defaults'}); force=true reruns it",
              flush=True)
    return bool(done)


def repeats_sweep_job(rc: RunConfig, chash: str, files: JobFiles, world) -> bool:
    """Whether an earlier job of this sweep has this config (DFlash in a budget sweep: it ignores the budget);
    such a job does not run, even with force=true, and says so in skipped.json and the sweep table."""

    if files.sweep_dir is None:
        return False
    first = D.broadcast(claim_config(files.sweep_dir, chash, files.job_dir) if world.is_main else None, world)
    if first is None:
        return False
    if world.is_main:
        why = (f"method={rc.method} ignores the budget" + (" and the scoring" if rc.method != "ddtree" else "")
               if not reads_budget(rc.method, method_topk(rc)) else "same config")
        note = f"skipped: same job as {Path(first).name} ({why})"
        files.job_dir.joinpath(SKIPPED).write_text(json.dumps(
            {"model": rc.model.name, "method": rc.method, "budget": rc.budget if reads_budget(rc.method, method_topk(rc))
             else None, "duplicate_of": first, "note": note}) + "\n")
        print(f"{note}: {first}", flush=True)
    return True


def install_compat(rc: RunConfig, world) -> list[dict[str, Any]]:
    """The compat patches (and with engine=upstream the authors' modules), before model work; their report."""
    compat_report = apply_compat(rc)
    if rc.engine == "upstream":  # import the authors' code before model work; report their patches too
        compat_report = load_upstream(rc).patches or compat_report
    for r in compat_report:
        if r.get("status") == "failed" and world.is_main:
            print(f"warning: compat patch {r['id']} failed to install: {r.get('detail')}", file=sys.stderr)
    return compat_report


def load_models(rc: RunConfig, device: str, cache: ModelCache) -> LoadedModels:
    library_bars_off_outside_a_terminal()  # a log gets one line per job, not a line per bar frame
    t_load = time.perf_counter()
    target, tokenizer, drafter = get_models(rc, device, cache)
    load_s = time.perf_counter() - t_load
    device = model_device(target, rc, device)
    return LoadedModels(target, tokenizer, drafter, device, stop_token_ids(tokenizer, target), load_s)


def tp_paths(target) -> dict[str, Any]:
    """What the engine runs sharded on a tensor-parallel target and what falls back, with why (ddtree.engine.sharded)."""
    from ddtree.engine.forward import lean_forward_for
    from ddtree.engine.sharded import paths

    return paths(target, lean_forward_for(target))


def tp_line(tp: dict[str, Any]) -> str:
    """The run's one line on its tensor-parallel target: the layout, what ran sharded, what fell back and why."""
    line = (f"tensor parallel: {tp['tp_size']} ranks a group x {tp['groups']} group(s); lean layers {tp['lean_layers']} "
            f"of {tp['layers']}, {tp['sharded_projections']} projections on this rank's shards")
    return "; ".join([line, *tp["notes"]])


def job_environment(models: LoadedModels, compat_report: list[dict[str, Any]], world, rc: RunConfig) -> dict[str, Any]:

    env = environment(models.device, compat_report)
    env["world_size"] = world.world_size
    tp = D.tensor_parallel(rc.model, world)
    if tp is not None:  # ranks = tp_size x data-parallel groups
        env["tensor_parallel"] = {"tp_size": tp.size, "groups": tp.groups, **tp_paths(models.target)}
    where = D.placement(models.target)
    if where is not None:
        env["placement"] = where
    return env


def start_samples(files: JobFiles, world) -> None:
    """Rank 0 writes the job's files; with several ranks each appends its own share of samples."""
    files.rank_samples.write_text("")  # a rerun in the same dir starts a fresh file
    if world.is_distributed and world.is_main:
        files.samples.unlink(missing_ok=True)  # written whole once the ranks' records are gathered


def start_tracking(rc: RunConfig, tracker, files: JobFiles, env: dict[str, Any], chash: str, world):
    """Rank 0: the resolved config on disk and the tracked run started (params, tags); the run."""
    from ddtree.pipeline.tracking import git_commit

    resolved = resolved_dict(rc)
    files.resolved.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    tags = {"torch_version": env["versions"]["torch"], "transformers_version": env["versions"]["transformers"],
            "python_version": env["versions"]["python"], "device": env["device"], "device_name": env["device_name"],
            "git_commit": git_commit(REPO_ROOT), "compat.applied": ",".join(env["compat"]["applied"]) or "none",
            **{f"compat.{k}": v for k, v in env["compat"]["patches"].items()},
            "overrides": " ".join(files.overrides), "job_dir": str(files.job_dir), "mlflow.source.name": "ddtree.run",
            "world_size": world.world_size, "ddtree.model": rc.model.name, "ddtree.model.source": rc.model.name_or_path,
            "ddtree.drafter": rc.drafter.name_or_path or rc.drafter.kind, "ddtree.dataset": dataset_label(rc.dataset),
            **rc.tags}
    if "placement" in env:
        tags["devices"] = ",".join(env["placement"]["devices"])
    if "tensor_parallel" in env:
        tags["tp_size"] = env["tensor_parallel"]["tp_size"]
    tags["mlflow.source.git.commit"] = (tags["git_commit"] or "").removesuffix("-dirty") or None
    sweep_dir = files.sweep_dir
    sweep_name = f"sweep {sweep_dir.parent.name}/{sweep_dir.name}" if sweep_dir else None
    return tracker.start(run_name=run_name(rc), params=flatten(resolved), tags=tags, config_hash=chash,
                         sweep_dir=sweep_dir, sweep_name=sweep_name)


def generate_all(ctx: JobContext, prompts: list[Prompt], world
                 ) -> tuple[list[dict[str, Any]], str | None, dict[str, float]] | None:
    """Every rank runs its share of the prompts; rank 0 gets (all records in prompt order, the job whose
    baseline was reused or None, the batched calls' wall seconds by role: the slowest rank's, empty one prompt at a
    time); the other ranks get None. A rank's failure is raised on rank 0 too."""

    rc = ctx.rc
    methods = [rc.method] + ([BASELINE] if rc.baseline and rc.method != BASELINE else [])
    records: list[dict[str, Any]] = []
    failure: BaseException | None = None
    reused_from = None
    try:
        reused_from = _generate_shard(ctx, prompts, D.shard(prompts, D.data_world(rc.model, world)), methods, records)
    except Exception as e:
        if not world.is_distributed:
            raise
        failure = e  # still join the gather below, so rank 0 learns of it instead of waiting
    finally:
        ctx.close()
    gathered = D.gather({"rank": world.rank, "records": records, "baseline_reused_from": reused_from,
                         "batch_s": dict(ctx.batch_s),
                         "error": None if failure is None else f"{type(failure).__name__}: {failure}"}, world)
    if failure is not None:
        raise failure
    if not world.is_main:
        return None
    errors = [f"rank {g['rank']}: {g['error']}" for g in gathered if g["error"]]
    if errors:
        raise RuntimeError("a data-parallel rank failed: " + "; ".join(errors))
    if world.is_distributed:
        per_rank = [g["records"] for g in gathered]
        tp = D.tensor_parallel(rc.model, world)
        if tp is not None:  # every rank of a group decoded its prompts: one copy, checked equal
            per_rank = D.first_of_each_group(per_rank, tp.size)
        records = D.merge_in_order(per_rank, [p.id for p in prompts])
        with ctx.files.samples.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(rec) + "\n" for rec in records)
    reused = {g.get("baseline_reused_from") for g in gathered} - {None}
    roles = {role for g in gathered for role in g["batch_s"]}
    batch_s = {role: max(g["batch_s"].get(role, 0.0) for g in gathered) for role in roles}
    return records, min(reused) if reused else None, batch_s


def reused_baseline(records: list[dict[str, Any]]) -> bool:
    """Whether the baseline records came from an earlier job of this process (baseline_reuse)."""
    return any(r.get("reused_from") for r in records if r["role"] == "baseline")


def quantization_labels(rc: RunConfig) -> dict[str, str | None]:
    """What ran quantized (None: as loaded): the summary's, the diagnosis's and the run tags' record."""
    from ddtree.pipeline.quantization import label

    drafts = loads_drafter(rc.method)
    return {"target": label(rc.model.quantization), "drafter": label(rc.drafter.quantization) if drafts else None}


def finish(generated: tuple[list[dict[str, Any]], str | None, dict[str, float]], rc: RunConfig, files: JobFiles,
           extra: dict[str, Any], run) -> dict[str, Any]:
    """summary.json, the histogram and the table; the tracked run gets the metrics and files and ends."""
    from ddtree.pipeline.tracking import numeric_metrics, write_histogram

    records, reused_from, batch_s = generated
    summary = summarize(records, rc, {**extra, "baseline_reused_from": reused_from}, batch_s)
    if summary.get("auto_budget"):  # budget=auto: the outcome beside the prediction
        summary["auto_budget"]["outcome"] = outcome(summary["auto_budget"], summary)
    files.summary.write_text(json.dumps(summary, indent=2) + "\n")
    lengths = [a for r in records if r["role"] == "method" for a in r["acceptance_lengths"]]
    write_histogram(lengths, files.histogram, f"{run_name(rc)}: tau={summary['tau'] or 0:.2f}")
    print(format_table(summary), flush=True)
    print(f"attention: {summary['attention']['line']}", flush=True)
    if summary.get("tensor_parallel"):
        print(tp_line(summary["tensor_parallel"]), flush=True)
    if any(summary["quantization"].values()):
        q = summary["quantization"]
        print(f"quantization: target {q['target'] or 'none'}, drafter {q['drafter'] or 'its own precision'}", flush=True)
    print(f"results: {files.job_dir}", flush=True)
    if run is not None:
        if summary["baseline_reused_from"]:
            run.set_tags({"baseline_reused_from": summary["baseline_reused_from"]})
        if summary["round"]:  # which round ran, and why (what) ran eagerly
            run.set_tags({"ddtree.round": summary["round"]["ran"], "ddtree.round_fallback": summary["round"]["fallback"],
                          **({"ddtree.round_note": summary["round"]["why"][:500]} if summary["round"]["why"] else {})})
        run.log_metrics(numeric_metrics(summary))
        run.log_artifacts([*files.config_artifacts, files.samples, files.summary, files.histogram,
                           *([files.log_file] if files.log_file else [])])
        run.end("FINISHED")
    return summary


def record_failure(run, files: JobFiles, e: BaseException) -> None:
    """Keep what finished; the run says FAILED (KILLED on Ctrl-C)."""
    if run is None:
        return
    try:
        run.set_tags({"error": f"{type(e).__name__}: {e}"[:500]})
        run.log_artifacts([*files.config_artifacts, files.samples if files.samples.is_file() else files.rank_samples])
    finally:
        run.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")


def run_job(cfg: DictConfig | RunConfig) -> dict[str, Any] | None:
    """One Hydra job. Returns the summary; None when skipped because it already finished, and on ranks > 0.

    Under torchrun / accelerate launch every rank runs this with the same config: see ddtree.pipeline.distributed.
    """
    import torch

    from ddtree.pipeline.tracking import TAG_RESUMED_FROM, config_hash, make_tracker

    rc, prompts, identity = configure(cfg)
    world = D.world_from_env()
    device = D.rank_device(resolve_device(rc.device), world, rc.model.device_map)
    D.init(world, device)
    files = open_files(world)
    chash = config_hash(identity)
    uri = tracking_uri(rc) if rc.tracking.backend == "mlflow" and world.is_main else None
    tracker = make_tracker(rc.tracking.backend if world.is_main else "none", uri, rc.tracking.experiment)
    if repeats_sweep_job(rc, chash, files, world) or already_finished(rc, tracker, chash, world, files):
        return None
    methods = {"method"} | ({"baseline"} if rc.baseline and rc.method != BASELINE else set())
    resume = find_resume(tracker, chash, prompts, methods) if not world.is_distributed else None
    if world.is_main:
        write_job_file(files.job_dir, chash)
    compat_report = install_compat(rc, world)
    models = load_models(rc, device, MODELS)
    env = job_environment(models, compat_report, world, rc)
    auto = None
    if rc.budget == "auto" and rc.concurrency == 1:  # a short calibration picks the budget (autobudget)
        # (concurrency > 1: the batched round chooses every round from the load, ddtree.engine.adaptive)
        auto = choose_budget(models, prompts, rc, files, MODELS)
        if world.is_distributed:  # rank 0's choice on every rank (its timings decide): a TP group's trees must agree
            auto = D.broadcast(auto, world)
            rc.budget = auto["chosen"]
        if world.is_main:
            print(f"budget=auto: budget {auto['chosen']} (predicted tau {auto['predicted_tau'][auto['chosen']]:.2f}, "
                  f"speedup {auto['predicted_speedup'][auto['chosen']]:.2f}x; calibrated on "
                  f"{auto['calibration_rounds']} rounds in {auto['seconds']:.1f} s)", flush=True)
    start_samples(files, world)
    run = start_tracking(rc, tracker, files, env, chash, world) if world.is_main else None
    if resume is not None:
        print(f"resuming: {len(resume.done)} of {len(prompts)} prompts were finished by {resume.job_dir} "
              f"(MLflow run {resume.run_id}, now ended KILLED); they are reused", flush=True)
        tracker.supersede(resume.run_id, getattr(run, "run_id", None))
        if run is not None:
            run.set_tags({TAG_RESUMED_FROM: resume.run_id, "ddtree.resumed_prompts": len(resume.done)})
    torch.manual_seed(rc.seed)
    try:
        ctx = JobContext(rc, models, files, MODELS, show_progress=world.is_main, resume=resume)
        generated = generate_all(ctx, prompts, world)
        tp = D.tensor_parallel(rc.model, world)
        if tp is not None:  # the verdicts' target forwards are collectives: the ranks of group 0 run them together
            generated = D.broadcast(generated, world)
            if not world.is_main and tp.group == 0:
                check_outputs(models, prompts, generated[0], rc, Path(os.devnull), MODELS.calibrations)
        if generated is None or not world.is_main:  # ranks > 0: rank 0 writes and records the job
            return None
        records, batch_s = generated[0], generated[2]
        ran_s = batch_s.get("method", 0.0) + (batch_s.get("baseline", 0.0) if not reused_baseline(records) else 0.0)
        checked = check_outputs(models, prompts, records, rc, files.samples, MODELS.calibrations,  # untimed
                                ran_s if batch_s else None)
        attention = {**attention_backends(rc), "line": attention_line(rc)}
        summary = finish(generated, rc, files, {**env, "load_s": models.load_s, "config_hash": chash,
                                                            "attention": attention,
                                                            "quantization": quantization_labels(rc),
                                                            "validation": checked,
                                                            **({"auto_budget": auto} if auto else {}),
                                                            **({"load_budget": ctx.load_budget}
                                                               if ctx.load_budget else {})}, run)
        if auto and world.is_main:
            print(outcome_line(summary["auto_budget"]["outcome"]), flush=True)
        report_suspects(rc, summary)
        return summary
    except BaseException as e:
        record_failure(run, files, e)
        raise


def _generate_shard(ctx: JobContext, prompts: list[Prompt], mine: list[Prompt], methods: list[str],
                    records: list[dict[str, Any]]) -> str | None:
    """Warm up (once per process and setting), then run every method on this rank's prompts (`mine`), appending
    one record per prompt, turn and role to `records` and to this rank's samples file: as each prompt finishes
    (concurrency=1), or once every batch has (concurrency > 1: _generate_batched).

    With rc.baseline_reuse, the AR baseline comes from an earlier job of this process that ran it on the
    same prompts with the same settings (returned: that job's dir); else it runs here and is kept in
    ctx.cache for later jobs under this job's dir."""
    rc, cache, resume = ctx.rc, ctx.cache, ctx.resume
    wkey = cache_key(cache.target_key, cache.drafter_key, rc.method, rc.concurrency)
    if rc.warmup and wkey not in cache.warmed:  # first-call costs stay out of the timings
        first = Prompt("warmup", prompts[0].turns[:1])
        for meth in methods:
            if rc.concurrency > 1:  # the batched call, as many streams as the job will run at once
                run_batch(ctx, [first] * min(rc.concurrency, len(mine) or 1), meth,
                          max_new_tokens=min(8, rc.max_new_tokens))
                continue
            for _ in run_conversation(ctx, first, meth, max_new_tokens=min(8, rc.max_new_tokens)):
                pass
        cache.warmed.add(wkey)
    reuse = BASELINE in methods and rc.method != BASELINE and rc.baseline_reuse
    if rc.concurrency > 1 and resume is not None and resume.done:  # kept walls cover the whole shard: run it
        reuse = False
    bkey = baseline_key(rc, mine, cache.target_key) if reuse else None
    reused_from, kept, kept_s = cache.baselines.get(bkey, (None, None, None)) if bkey else (None, None, None)
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for rec in kept or []:
        by_prompt.setdefault(rec["id"], []).append(rec)
    if rc.concurrency > 1:
        fresh = _generate_batched(ctx, mine, methods, records, (reused_from, by_prompt, kept_s))
    else:
        fresh = _generate_one_by_one(ctx, mine, methods, records, (reused_from, by_prompt))
    if bkey and reused_from is None and not (resume and resume.done):  # complete: later jobs may reuse it
        cache.baselines[bkey] = (str(ctx.files.job_dir), fresh, ctx.batch_s.get("baseline"))
    return reused_from


def _resumed(ctx: JobContext, prompt: Prompt) -> list[dict[str, Any]] | None:
    """The records of `prompt` the job this one continues finished (marked with its dir), or None."""
    resume = ctx.resume
    if resume is None or prompt.id not in resume.done:
        return None
    return [{**rec, "resumed_from": rec.get("resumed_from") or str(resume.job_dir)} for rec in resume.done[prompt.id]]


def _generate_one_by_one(ctx: JobContext, mine: list[Prompt], methods: list[str], records: list[dict[str, Any]],
                         reused: tuple[str | None, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """concurrency=1: each prompt in turn, the baseline then the method, its records written as it finishes; the
    baseline records generated here (for later jobs to reuse)."""
    rc = ctx.rc
    reused_from, by_prompt = reused
    fresh: list[dict[str, Any]] = []
    with ctx.files.rank_samples.open("a", encoding="utf-8") as out:
        # a bar on a terminal; one line per job in a log (CI, nohup, SLURM), where each frame would be a line
        bar = Progress(mine, run_name(rc), "prompt", enabled=ctx.show_progress)
        for prompt in bar:
            got = _resumed(ctx, prompt)
            if got is not None:  # finished by the job this one continues
                records.extend(got)
                out.writelines(json.dumps(rec) + "\n" for rec in got)
                continue
            for meth in reversed(methods):  # the baseline first: the method's outputs get compared to it
                role = "method" if meth == rc.method else "baseline"
                if role == "baseline" and reused_from is not None:
                    got = [{**rec, "reused_from": reused_from} for rec in by_prompt[prompt.id]]
                else:
                    got = [{"id": prompt.id, "turn": turn, "role": role, **res.to_dict(), "text": text}
                           for turn, res, text in run_conversation(ctx, prompt, meth)]
                    if role == "baseline":
                        fresh.extend(got)
                records.extend(got)
                out.writelines(json.dumps(rec) + "\n" for rec in got)
            out.flush()
            m = [r for r in records if r["role"] == "method"]
            bar.set_postfix(tau=f"{aggregate(m)['tau'] or 0:.2f}")
    return fresh


def _generate_batched(ctx: JobContext, mine: list[Prompt], methods: list[str], records: list[dict[str, Any]],
                      reused: tuple[str | None, dict[str, list[dict[str, Any]]], float | None]
                      ) -> list[dict[str, Any]]:
    """concurrency > 1: the baseline, then the method, each through one Engine.generate_many call per turn over
    every prompt not finished by the job this one continues (conversation.run_batch); the wall seconds of each
    role's calls go to ctx.batch_s. The unit of work is the batch: the records are written, in prompt order as
    concurrency=1 writes them, once both batches have finished (a job killed mid-batch leaves only the prompts it
    resumed). Returns the baseline records generated here (for later jobs to reuse)."""
    rc = ctx.rc
    reused_from, by_prompt, kept_s = reused
    todo = [p for p in mine if _resumed(ctx, p) is None]
    made: dict[str, dict[str, list[dict[str, Any]]]] = {}
    fresh: list[dict[str, Any]] = []
    bar = Progress([m for m in reversed(methods)], run_name(rc), "generate_many call",
                   enabled=ctx.show_progress)
    for meth in bar:  # the baseline first, as one prompt at a time
        role = "method" if meth == rc.method else "baseline"
        if role == "baseline" and reused_from is not None:
            made[role] = {p.id: [{**rec, "reused_from": reused_from} for rec in by_prompt[p.id]] for p in todo}
            ctx.batch_s[role] = kept_s or 0.0
            continue
        got, ctx.batch_s[role] = run_batch(ctx, todo, meth) if todo else ([], 0.0)
        made[role] = {p.id: [{"id": p.id, "turn": turn, "role": role, **res.to_dict(), "text": text}
                             for turn, (res, text) in enumerate(turns)] for p, turns in zip(todo, got, strict=True)}
        if role == "baseline":
            fresh = [rec for p in todo for rec in made[role][p.id]]
    with ctx.files.rank_samples.open("a", encoding="utf-8") as out:
        for prompt in mine:
            got = _resumed(ctx, prompt)
            if got is None:
                got = [rec for meth in reversed(methods)
                       for rec in made["method" if meth == rc.method else "baseline"][prompt.id]]
            records.extend(got)
            out.writelines(json.dumps(rec) + "\n" for rec in got)
    return fresh
