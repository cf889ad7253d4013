"""`python -m ddtree.check`: is another engine right? Its outputs judged against the same target, loaded by ddtree.

    python -m ddtree.check model=qwen3_8b dataset=gsm8k source=endpoint endpoint.url=http://127.0.0.1:8000/v1
    python -m ddtree.check source=file file.path=outputs.jsonl validation=strict      # exit 3 on a suspect output
    python -m ddtree.check temperature=0.7 repeats=200 dataset.max_samples=1          # T > 0: a distribution test

Each output gets a verdict by the rule of docs/validation.md (ddtree.engine.output_check, through
ddtree.pipeline.output_verdicts.validate_records): `exact` (every token the target's greedy choice), `tie` (some
token is not, but within the dtype tolerance, or it is where the target computes it as decoding does: a shape
tie), `suspect` (a token outside it under every computation: position, tokens, logits, margin), `ok` at T > 0
(every token has non-negligible target probability). Results go where a run's go: check.jsonl, summary.json, an
MLflow run (experiment ddtree-check), the table line. docs/check.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ddtree.engine.methods import BASELINE
from ddtree.errors import ConfigError
from ddtree.pipeline.check_sources import (
    FileOutputs,
    expand_repeats,
    output_token_ids,
    read_output_file,
    repeat_id,
)
from ddtree.pipeline.endpoint import (
    APIS,
    SERVERS,
    EndpointClient,
    EndpointError,
    counter_delta,
    sampler_fields,
)
from ddtree.pipeline.prompts import Prompt, encode, fingerprint
from ddtree.pipeline.schema import (
    CONF_DIR,
    REPO_ROOT,
    AttentionConfig,
    CompatConfig,
    DatasetConfig,
    ModelConfig,
    RunConfig,
    TrackingConfig,
    ValidationConfig,
    flatten,
    schema_node,
    structured,
    tracking_uri,
)

CHECK_FILE = "check.jsonl"
SUMMARY = "summary.json"
SOURCES = ("endpoint", "file")
CHECK_VERDICTS = ("exact", "tie", "ok", "suspect")


# ---------------------------------------------------------------- config


@dataclass
class EndpointConfig:
    """source=endpoint: an OpenAI-compatible server (or llama.cpp's native API)."""

    url: str | None = None  # http://HOST:PORT/v1 (api=llamacpp: http://HOST:PORT)
    api: str = "chat"  # chat: /chat/completions (the server's chat template) | completion | llamacpp
    model: str | None = None  # the served model's name; null: the only one GET /models lists
    api_key: str | None = None
    timeout_s: float = 600.0  # per request
    prompt_ids: bool = False  # completion/llamacpp: send ddtree's prompt token ids instead of its text
    # merged into every request: the fields that make a server return token ids (docs/check.md), e.g.
    # vLLM {return_token_ids: true}, SGLang {return_meta_info: true, return_token_ids: true}
    extra: dict[str, Any] = field(default_factory=dict)
    metrics: bool = True  # read vLLM's /metrics spec_decode counters before and after (where the server has them)
    # whose sampler defaults to send at their neutral values (docs/check.md): auto (GET /models says) | vllm | sglang
    # | llamacpp | llama-cpp-python | openai (the standard's fields only) | none (temperature and top_p only)
    server: str = "auto"


@dataclass
class FileSourceConfig:
    path: str | None = None  # JSONL: {"id", "prompt" | "turns", "output_ids" | "output"[, "finish_reason"]} a line


@dataclass
class CheckConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    source: str = "endpoint"  # endpoint | file
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    file: FileSourceConfig = field(default_factory=FileSourceConfig)
    temperature: float = 0.0  # what the engine is asked to sample at (0: greedy)
    max_new_tokens: int = 256
    repeats: int = 1  # each prompt this many times (T > 0: a distribution test over the repeats' first tokens)
    seed: int = 0  # sent to the server (seed + repeat)
    device: str = "auto"  # where ddtree's copy of the target runs
    baseline: str | None = "auto"  # ddtree's own AR outputs to compare with: auto (search runs_dir) | a job dir | null
    runs_dir: str = "runs"
    tags: dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(name="check_schema", node=schema_node(CheckConfig))
NON_IDENTITY = ("runs_dir", "tracking", "tags", "validation", "baseline", "device")


def to_check_config(cfg: DictConfig | CheckConfig) -> CheckConfig:
    return cfg if isinstance(cfg, CheckConfig) else structured(cfg, CheckConfig, cli="ddtree.check")


def run_config(cc: CheckConfig) -> RunConfig:
    """The run settings the shared pieces read (target loading, prompts, the verdict rule): plain AR decoding."""
    return RunConfig(model=cc.model, dataset=cc.dataset, attention=cc.attention, compat=cc.compat,
                     tracking=cc.tracking, validation=cc.validation, method=BASELINE, baseline=False,
                     temperature=cc.temperature, max_new_tokens=cc.max_new_tokens, seed=cc.seed, device=cc.device,
                     runs_dir=cc.runs_dir, tags=cc.tags)


def check_settings(cc: CheckConfig) -> RunConfig:
    """Every check of the settings alone (no server asked, no weight loaded); the run settings."""
    from ddtree.pipeline import config_checks as C

    rc = run_config(cc)
    C.check_run_settings(rc)
    C.check_model(rc)
    C.check_attention_settings(rc)
    C.check_tracking(rc)
    C.check_validation(rc)
    if cc.source not in SOURCES:
        raise ConfigError("source", f"unknown value '{cc.source}'", f"use one of: {', '.join(SOURCES)}")
    if cc.repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {cc.repeats}", "use repeats=1 (each prompt once)")
    if cc.source == "endpoint":
        C.check_dataset(rc.dataset)
        if cc.endpoint.api not in APIS:
            raise ConfigError("endpoint.api", f"unknown value '{cc.endpoint.api}'", f"use one of: {', '.join(APIS)}")
        if not cc.endpoint.url:
            raise ConfigError("endpoint.url", "is not set", "pass endpoint.url=http://HOST:PORT/v1, or source=file "
                              "file.path=<outputs.jsonl>")
        if cc.endpoint.server not in SERVERS:
            raise ConfigError("endpoint.server", f"unknown value '{cc.endpoint.server}'",
                              f"use one of: {', '.join(SERVERS)}")
        if not cc.endpoint.timeout_s > 0:
            raise ConfigError("endpoint.timeout_s", f"must be > 0, got {cc.endpoint.timeout_s}", "use e.g. 600")
        if cc.endpoint.prompt_ids and cc.endpoint.api == "chat":
            raise ConfigError("endpoint.prompt_ids", "the chat API takes messages, not token ids",
                              "use endpoint.api=completion (or llamacpp) with endpoint.prompt_ids=true")
    elif not cc.file.path:
        raise ConfigError("file.path", "is not set", "pass file.path=<outputs.jsonl>")
    return rc


# ---------------------------------------------------------------- ddtree's own AR baseline, from runs/


_SAME_DATASET = ("name", "path", "hub", "subset", "split", "template", "turns_field", "chat_template",
                 "enable_thinking")


def _baseline_job(job_dir: Path, cc: CheckConfig) -> str | None:
    """Why a finished job of ddtree.run cannot be the AR baseline of this check (None: it can)."""
    import yaml

    f = job_dir / "config_resolved.yaml"
    try:
        c = yaml.safe_load(f.read_text())
    except (OSError, yaml.YAMLError):
        return "no readable config_resolved.yaml"
    mine = OmegaConf.to_container(OmegaConf.structured(cc.model))
    if not isinstance(c, dict) or c.get("temperature") != 0 or cc.temperature != 0:
        return "not greedy"
    m = c.get("model") or {}
    if any(m.get(k) != mine.get(k) for k in ("name_or_path", "tiny", "dtype", "revision")):
        return "another target or dtype"
    if c.get("max_new_tokens") != cc.max_new_tokens:
        return f"max_new_tokens={c.get('max_new_tokens')}"
    d, mine_d = c.get("dataset") or {}, OmegaConf.to_container(OmegaConf.structured(cc.dataset))
    if any(d.get(k) != mine_d.get(k) for k in _SAME_DATASET):
        return "another dataset or template"
    return None


def find_baseline(cc: CheckConfig, prompt_ids: set[str]) -> tuple[str | None, dict[tuple[str, int], dict]]:
    """(its job dir, its AR records by (prompt id, turn)): the newest finished ddtree.run job on the same target,
    dtype, dataset and length, with `cc.baseline=auto`; that job with a path; nothing with null."""
    if cc.baseline in (None, "", "none", "null") or cc.temperature != 0:
        return None, {}
    if cc.baseline == "auto":
        root = Path(cc.runs_dir).expanduser()
        jobs = sorted((p.parent for p in root.glob("**/config_resolved.yaml") if (p.parent / SUMMARY).is_file()
                       and (p.parent / "samples.jsonl").is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    else:
        jobs = [Path(cc.baseline).expanduser()]
        why = _baseline_job(jobs[0], cc) if (jobs[0] / "samples.jsonl").is_file() else "no samples.jsonl"
        if why:
            raise ConfigError("baseline", f"{jobs[0]} cannot be this check's AR baseline ({why})",
                              "pass the dir of a finished ddtree.run job on the same target and dataset, or "
                              "baseline=auto / baseline=null")
    for job in jobs:
        if cc.baseline == "auto" and _baseline_job(job, cc):
            continue
        recs: dict[tuple[str, int], dict] = {}
        for line in (job / "samples.jsonl").read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            ar = r.get("role") == "baseline" or (r.get("role") == "method" and r.get("method") == BASELINE)
            if ar and str(r.get("id")) in prompt_ids and "output_ids" in r:
                recs.setdefault((str(r["id"]), int(r["turn"])), r)
        if recs:
            return str(job), recs
    return None, {}


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


# ---------------------------------------------------------------- gathering outputs


@dataclass
class Gathered:
    records: list[dict[str, Any]]
    error: EndpointError | None = None  # the server failed mid-dataset: what was gathered is kept
    acceptance: dict[str, Any] | None = None  # vLLM counters over the check's requests


def _conversation_ids(tokenizer, rc: RunConfig, messages: list[dict[str, str]]) -> list[int]:
    return encode(tokenizer, messages, chat_template=rc.dataset.chat_template, enable_thinking=rc.dataset.enable_thinking)


def gather_endpoint(cc: CheckConfig, rc: RunConfig, client: EndpointClient, prompts: list[Prompt], tokenizer,
                    stops: list[int], vocab: int, out, done: dict[str, list[dict]]) -> Gathered:
    """Ask the server for every prompt (repeats and turns), appending a record per answer to `out` (check.jsonl).
    `done`: records of prompts a dead check already gathered (resume). A server failure stops the loop."""
    from tqdm import tqdm

    e = cc.endpoint
    records: list[dict[str, Any]] = []
    before = client.spec_counters() if e.metrics and e.api != "llamacpp" else None
    fix = ("ask the server for token ids (docs/check.md: vLLM endpoint.extra={return_token_ids:true}, "
           "SGLang {return_meta_info:true,return_token_ids:true}, llama.cpp endpoint.api=llamacpp)")
    error = None
    todo = [(p, k) for p in prompts for k in range(cc.repeats)]
    for p, k in tqdm(todo, desc="check", unit="output", file=sys.stderr, dynamic_ncols=True):
        key = repeat_id(p.id, k)
        if key in done:
            got = [{**r, "resumed_from": r.get("resumed_from") or "earlier check"} for r in done[key]]
            records.extend(got)
            out.writelines(json.dumps(r) + "\n" for r in got)
            continue
        messages: list[dict[str, str]] = []
        turns = []
        try:
            for turn, user in enumerate(p.turns):
                messages.append({"role": "user", "content": user})
                ids = _conversation_ids(tokenizer, rc, messages)
                kw: dict[str, Any] = {}
                if e.api == "chat":
                    kw["messages"] = list(messages)
                    kw["chat_template_kwargs"] = {"enable_thinking": rc.dataset.enable_thinking} if (
                        rc.dataset.enable_thinking) else None
                else:
                    kw["prompt"] = ids if e.prompt_ids else tokenizer.decode(ids, skip_special_tokens=False)
                reply = client.generate(max_new_tokens=cc.max_new_tokens, temperature=cc.temperature,
                                        seed=cc.seed + k if cc.temperature > 0 else None, **kw)
                got = output_token_ids(text=reply.text, ids=reply.token_ids, finish_reason=reply.finish_reason,
                                       tokenizer=tokenizer, stops=stops, max_new_tokens=cc.max_new_tokens,
                                       where=f"prompt {p.id} turn {turn}", setting="endpoint", fix=fix,
                                       vocab_size=vocab, reported=reply.completion_tokens)
                n = len(got["output_ids"])
                text = reply.text if reply.token_ids is None else tokenizer.decode(
                    [t for t in got["output_ids"] if t not in stops], skip_special_tokens=True)
                rec = {"id": key, "prompt_id": p.id, "repeat": k, "turn": turn, "role": "method",
                       "source": "endpoint", **got, "text": text, "finish_reason": reply.finish_reason,
                       "num_new_tokens": n, "latency_s": reply.latency_s,
                       "tokens_per_s": n / reply.latency_s if reply.latency_s > 0 else None,
                       "prompt_tokens": len(ids), "server_prompt_tokens": reply.prompt_tokens,
                       "server_completion_tokens": reply.completion_tokens}
                if reply.prompt_token_ids is not None:
                    rec["prompt_ids_match"] = reply.prompt_token_ids == ids
                if reply.acceptance:
                    rec["server_acceptance"] = reply.acceptance
                turns.append(rec)
                messages.append({"role": "assistant", "content": text})
        except EndpointError as err:  # the server went down, failed or timed out: what was gathered is kept
            error = err
            break
        records.extend(turns)
        out.writelines(json.dumps(r) + "\n" for r in turns)
        out.flush()
    after = client.spec_counters() if before is not None else None
    return Gathered(records, error, counter_delta(before, after))


def gather_file(cc: CheckConfig, fo: FileOutputs, tokenizer, stops: list[int], vocab: int, out) -> Gathered:
    records = []
    for p in fo.prompts:
        pid, k = fo.prompt_of[p.id]
        for turn, o in enumerate(fo.outputs[p.id]):
            got = output_token_ids(text=o.get("text"), ids=o.get("ids"), finish_reason=o.get("finish_reason"),
                                   tokenizer=tokenizer, stops=stops, max_new_tokens=cc.max_new_tokens,
                                   where=f"prompt {p.id} turn {turn}", setting="file.path",
                                   fix="save the engine's token ids as output_ids", vocab_size=vocab)
            text = o["text"] if "text" in o else tokenizer.decode(
                [t for t in got["output_ids"] if t not in stops], skip_special_tokens=True)
            records.append({"id": p.id, "prompt_id": pid, "repeat": k, "turn": turn, "role": "method",
                            "source": "file", **got, "text": text, "finish_reason": o.get("finish_reason"),
                            "num_new_tokens": len(got["output_ids"])})
    out.writelines(json.dumps(r) + "\n" for r in records)
    return Gathered(records)


# ---------------------------------------------------------------- T > 0


def sampling_report(target, tokenizer, prompts: list[Prompt], records: list[dict[str, Any]], rc: RunConfig,
                    repeats: int) -> dict[str, Any]:
    """Per-position target probabilities of what was sampled (into each record), and two goodness-of-fit tests:
    the first token of each repeated prompt against the target's distribution there (chi-square), and the
    randomized PIT of every sampled token (uniform when sampling is right; chi-square over 10 bins)."""
    import torch

    from ddtree.engine.output_check import (
        chi_square_pvalue,
        sampled_pit,
        teacher_forced_logits,
        token_logprobs,
    )
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
            tests.append({"prompt": pid, "samples": len(drawn), **_first_token_test(probs, drawn)})
        report["first_token"] = tests
    return report


def _first_token_test(probs, drawn: list[int]) -> dict[str, Any]:
    """Chi-square of the first tokens drawn against the target's probabilities: tokens expected >= 5 times get a
    bin each, the rest one pooled bin (merged into the smallest when it is expected < 5 times)."""
    from collections import Counter

    from ddtree.engine.output_check import chi_square_pvalue

    n = len(drawn)
    counts = Counter(drawn)
    big = [t for t in probs.argsort(descending=True).tolist() if probs[t] * n >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [float(probs[t]) * n for t in big]
    rest_o, rest_e = n - sum(obs), n - sum(exp)
    if rest_e >= 5 or not exp:
        obs.append(rest_o)
        exp.append(rest_e)
    elif exp:
        obs[-1] += rest_o
        exp[-1] += rest_e
    if len(exp) < 2:
        return {"chi2": None, "dof": 0, "pvalue": None, "note": "too few samples for a test (need >= 5 expected "
                "in two bins)"}
    stat, dof, pv = chi_square_pvalue(obs, exp)
    return {"chi2": stat, "dof": dof, "pvalue": pv}


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


# ---------------------------------------------------------------- the job


def identity(cc: CheckConfig, prompts: list[Prompt], file_sha: str | None) -> dict[str, Any]:
    d = OmegaConf.to_container(OmegaConf.structured(cc), resolve=True)
    for k in NON_IDENTITY:
        d.pop(k, None)
    for k in ("api_key", "timeout_s", "metrics"):  # how the server is asked, not what it is asked
        d["endpoint"].pop(k, None)
    d["prompts"] = fingerprint(prompts)
    if file_sha:
        d["file_sha256"] = file_sha
    return d


@dataclass
class Source:
    """Where the outputs come from, opened and checked before any weight loads."""

    prompts: list[Prompt]  # the dataset's (or the file's) prompts
    outputs: list[Prompt]  # one per output: a prompt's repeats are prompts of their own ("<id>@<repeat>")
    client: EndpointClient | None = None
    file: FileOutputs | None = None


def open_source(cc: CheckConfig, rc: RunConfig) -> Source:
    """The file read and checked, or the server asked what it serves (down, 4xx/5xx, no such model: one line)."""
    from ddtree.pipeline.datasets import load_dataset_prompts

    if cc.source == "file":
        fo = read_output_file(cc.file.path)
        cc.repeats = fo.repeats  # the file's own samples per prompt
        return Source(fo.prompts, fo.prompts, file=fo)
    e = cc.endpoint
    client = EndpointClient(e.url, api=e.api, model=e.model, api_key=e.api_key, timeout_s=e.timeout_s, extra=e.extra,
                            server=e.server)
    cc.endpoint.model = client.served_model()
    cc.endpoint.server = client.server  # auto resolved: the sampler fields every request carries follow from it
    prompts = load_dataset_prompts(rc.dataset)
    return Source(prompts, expand_repeats(prompts, cc.repeats), client)


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


def run_check(cfg: DictConfig | CheckConfig) -> dict[str, Any]:
    """One check, as named phases: settings, source, tokenizer, tracking (resume), the target, gathering,
    verdicts, results. The summary."""
    from ddtree.pipeline.job import apply_compat, environment, job_dirs, record_failure, stop_token_ids
    from ddtree.pipeline.models import load_target, load_tokenizer, resolve_device
    from ddtree.pipeline.output_verdicts import SuspectOutputs
    from ddtree.pipeline.preflight import check_prompt_tokens
    from ddtree.pipeline.resume import find_resume, write_job_file
    from ddtree.pipeline.tracking import TAG_RESUMED_FROM, config_hash, make_tracker

    cc = to_check_config(cfg)
    for holder in (cc.dataset, cc.file):
        if holder.path:
            holder.path = hydra.utils.to_absolute_path(holder.path)
    rc = check_settings(cc)
    src = open_source(cc, rc)
    tokenizer = load_tokenizer(rc)
    check_prompt_tokens(src.prompts, tokenizer, "file.path" if src.file else "dataset")
    job_dir = job_dirs()[0]
    chash = config_hash(identity(cc, src.outputs, src.file.sha256 if src.file else None))
    tracker = make_tracker(cc.tracking.backend, tracking_uri(rc) if cc.tracking.backend == "mlflow" else None,
                           cc.tracking.experiment)
    resume = find_resume(tracker, chash, src.outputs, {"method"}, samples=CHECK_FILE) if src.client else None
    write_job_file(job_dir, chash)
    device = resolve_device(rc.device)
    env = environment(device, apply_compat(rc))
    run = start_tracking(cc, tracker, chash, job_dir, env)
    if resume is not None and resume.done:
        print(f"resuming: {len(resume.done)} of {len(src.outputs)} outputs were gathered by {resume.job_dir}",
              flush=True)
        tracker.supersede(resume.run_id, getattr(run, "run_id", None))
        if run is not None:
            run.set_tags({TAG_RESUMED_FROM: resume.run_id})
    try:
        t_load = time.perf_counter()
        target, _ = load_target(rc, device)
        load_s = time.perf_counter() - t_load
        stops = stop_token_ids(tokenizer, target)
        vocab = target.get_input_embeddings().weight.shape[0]
        with (job_dir / CHECK_FILE).open("w", encoding="utf-8") as out:
            if src.client is not None:
                g = gather_endpoint(cc, rc, src.client, src.prompts, tokenizer, stops, vocab, out,
                                    resume.done if resume else {})
            else:
                g = gather_file(cc, src.file, tokenizer, stops, vocab, out)
        if g.error is not None and not g.records:
            raise g.error
        summary = judge(cc, rc, target, tokenizer, src.outputs, g, stops, job_dir)
        summary.update(load_s=load_s, config_hash=chash, **{k: env[k] for k in ("versions", "device", "device_name")})
        finish(cc, summary, g, src, run, job_dir)
        return summary
    except SuspectOutputs:
        raise
    except BaseException as e:  # the run says FAILED (KILLED on Ctrl-C), with what was gathered
        if run is not None:
            from ddtree.pipeline.job import JobFiles

            _, sweep_dir, overrides, _ = job_dirs()
            record_failure(run, JobFiles(job_dir, sweep_dir, overrides, None, job_dir / CHECK_FILE), e)
        raise


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


# ---------------------------------------------------------------- entry


@hydra.main(config_path=str(CONF_DIR), config_name="check", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from ddtree.pipeline.cli import tracebacks_wanted, user_error
    from ddtree.pipeline.output_verdicts import STRICT_EXIT, SuspectOutputs

    try:
        run_check(cfg)
    except ConfigError as e:
        if tracebacks_wanted():
            raise
        user_error(str(e))
    except SuspectOutputs as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(STRICT_EXIT) from None


def main() -> None:
    from ddtree.pipeline.cli import run_cli

    run_cli(_hydra_main, "ddtree.check")
