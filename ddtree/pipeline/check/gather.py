"""ddtree.check's outputs collected: the source opened (a file read, a server asked what it serves), every prompt
asked of the server (repeats and turns, resumable) or read from the file, and ddtree's own AR outputs on the same
target found in runs/ (the baseline they are compared with)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddtree.engine.methods import BASELINE
from ddtree.errors import ConfigError
from ddtree.pipeline.check.config import SUMMARY, CheckConfig
from ddtree.pipeline.check.sources import (
    FileOutputs,
    expand_repeats,
    output_token_ids,
    read_output_file,
    repeat_id,
)
from ddtree.pipeline.endpoint import EndpointClient, EndpointError, counter_delta
from ddtree.pipeline.prompts import Prompt, encode
from ddtree.pipeline.schema import RunConfig


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
