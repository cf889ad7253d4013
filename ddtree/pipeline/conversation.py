"""One method's generations on one prompt (run_conversation) or on many at once (run_batch: concurrency > 1, through
Engine.generate_many), and what a job's share runs them with: the job's files, its loaded models
and a JobContext (ddtree.pipeline.job builds them; budget=auto's calibration, ddtree.pipeline.autobudget, runs its
own conversations through the same code)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.engine.methods import METHODS
from ddtree.errors import ConfigError
from ddtree.pipeline.models import ModelCache, load_upstream, target_context
from ddtree.pipeline.preflight import check_prompt_lengths, keep_last
from ddtree.pipeline.prompts import Prompt, encode
from ddtree.pipeline.resume import Resume
from ddtree.pipeline.schema import RunConfig, method_settings

SAMPLES = "samples.jsonl"
SUMMARY = "summary.json"
HISTOGRAM = "acceptance_hist.png"
RESOLVED = "config_resolved.yaml"


@dataclass
class JobFiles:
    """Where a job writes: rank 0's Hydra job dir (the other ranks' Hydra output went to a scratch dir)."""

    job_dir: Path
    sweep_dir: Path | None  # set when this job is part of a multirun
    overrides: list[str]
    log_file: Path | None
    rank_samples: Path  # this rank's share of samples.jsonl (the file itself on a single process)

    @property
    def samples(self) -> Path:
        return self.job_dir / SAMPLES

    @property
    def summary(self) -> Path:
        return self.job_dir / SUMMARY

    @property
    def histogram(self) -> Path:
        return self.job_dir / HISTOGRAM

    @property
    def resolved(self) -> Path:
        return self.job_dir / RESOLVED

    @property
    def config_artifacts(self) -> list[Path]:
        return [self.job_dir / ".hydra" / "config.yaml", self.job_dir / ".hydra" / "overrides.yaml", self.resolved]


@dataclass
class LoadedModels:
    target: Any
    tokenizer: Any
    drafter: Any
    device: str  # where inputs go (with a device map: the embeddings' device)
    stops: list[int]
    load_s: float


@dataclass
class JobContext:
    """What one rank's share of a job runs with, built by run_job: nothing below it reads a module global."""

    rc: RunConfig
    models: LoadedModels
    files: JobFiles
    cache: ModelCache  # the process's cache: warm-up marks and reusable AR baselines across a sweep's jobs
    show_progress: bool = True
    resume: Resume | None = None
    engines: dict[str, Any] = field(default_factory=dict)  # one ddtree.Engine per method, built on first use
    # concurrency > 1: the wall seconds of the batched calls by role ("method", "baseline"), for the throughput
    batch_s: dict[str, float] = field(default_factory=dict)
    # concurrency > 1 with budget=auto: the per-round controller's record of each batched call (LoadBudget.summary)
    load_budget: list[dict] = field(default_factory=list)

    def close(self) -> None:
        """Close the job's engines: the cached target is handed to the next job as it was loaded."""
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def stop_token_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    vocab = target.get_input_embeddings().weight.shape[0]
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def engine_for(ctx: JobContext, method: str):
    """The native ddtree.Engine of `method`, built on first use and kept in ctx.engines (one per job: the set-up runs
    once per method, not once per generation)."""
    from ddtree import Engine

    if method not in ctx.engines:
        rc, m = ctx.rc, ctx.models
        spec = METHODS[method]
        drafter = m.drafter if spec.drafter_kind is not None else None  # (method=mtp: the target's head, models.py)
        ctx.engines[method] = Engine(m.target, drafter, method=method, budget=rc.budget,
                                     tune_host_allocator=rc.host_allocator, record=rc.record_rounds,
                                     compile=rc.compile, scoring=rc.scoring if spec.reads_scoring else None,
                                     **_draft_settings(rc, spec))
    return ctx.engines[method]


def _draft_settings(rc: RunConfig, spec) -> dict[str, Any]:
    """The method's own keyword arguments: the drafter's block size, its settings group's steps and topk (mtp.*, ...)."""
    kw = {"block_size": rc.drafter.block_size} if rc.drafter.block_size and spec.reads_block_size else {}
    if spec.settings:  # its own settings group (Method.settings)
        settings = method_settings(rc)
        kw.update(steps=settings.steps, topk=settings.topk)
    return kw


def turn_ids(ctx: JobContext, prompt: Prompt, messages: list[dict[str, str]], turn: int, new: int):
    """The conversation so far (`messages`, ending with turn `turn`'s user message) as input ids [1, P] on the
    target's device: truncated (dataset.truncate) or checked against the context (a later turn grows with the
    model's answers)."""
    import torch

    rc, m = ctx.rc, ctx.models
    ids = encode(m.tokenizer, messages, chat_template=rc.dataset.chat_template,
                 enable_thinking=rc.dataset.enable_thinking)
    if not ids:  # (prompts are checked before loading; a later turn holds the model's own answers)
        raise ConfigError("dataset", f"turn {turn + 1} of prompt '{prompt.id}' is no tokens under this tokenizer",
                          "remove it or give it words the tokenizer knows")
    if rc.dataset.truncate:
        ids = keep_last(ids, new, target_context(m.target))
    else:
        check_prompt_lengths([prompt], [len(ids)], new, target_context(m.target), False)
    return torch.tensor([ids], dtype=torch.long, device=m.device)


def run_conversation(ctx: JobContext, prompt: Prompt, method: str, max_new_tokens: int | None = None):
    """Yield (turn, GenerationResult, text) for each user turn; later turns see this method's answers.

    The native ddtree.Engine of each method is built on first use and kept in ctx.engines (engine_for)."""
    import torch

    rc, m = ctx.rc, ctx.models
    spec = METHODS[method]
    if rc.engine == "upstream":  # the authors' generate functions, same arguments and result type
        from ddtree.upstream.engine import generate_upstream

        drafter = m.drafter if spec.drafter_kind is not None else None
        generate = functools.partial(generate_upstream, load_upstream(rc), m.target, drafter, method=method,
                                     budget=rc.budget, **_draft_settings(rc, spec))
    else:
        generate = engine_for(ctx, method).generate
    new = max_new_tokens or rc.max_new_tokens
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        input_ids = turn_ids(ctx, prompt, messages, turn, new)
        gen = None
        if rc.temperature > 0:  # per prompt and turn, so a result does not depend on the prompt order
            gen = torch.Generator(device=m.device).manual_seed(zlib.crc32(f"{rc.seed}:{prompt.id}:{turn}".encode()))
        res = generate(input_ids, temperature=rc.temperature, max_new_tokens=new, stop_token_ids=m.stops,
                       generator=gen)
        text = m.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        yield turn, res, text


def batch_seed(seed: int, turn: int) -> int:
    """Engine.generate_many's seed for turn `turn` of a batched job (T > 0): from the job's seed, one per turn."""
    return zlib.crc32(f"{seed}:turn{turn}".encode())


def run_batch(ctx: JobContext, prompts: list[Prompt], method: str,
              max_new_tokens: int | None = None) -> tuple[list[list[tuple[Any, str]]], float]:
    """Every prompt's conversation with `method` through Engine.generate_many, up to rc.concurrency streams at once:
    one call per turn (turn k of every prompt that has one; later turns see this method's answers). Returns
    ([(GenerationResult, text) per turn] per prompt, in prompt order; the calls' wall seconds summed)."""
    import time

    rc, m = ctx.rc, ctx.models
    engine = engine_for(ctx, method)
    new = max_new_tokens or rc.max_new_tokens
    messages: list[list[dict[str, str]]] = [[] for _ in prompts]
    got: list[list[tuple[Any, str]]] = [[] for _ in prompts]
    wall = 0.0
    for turn in range(max((len(p.turns) for p in prompts), default=0)):
        live = [i for i, p in enumerate(prompts) if turn < len(p.turns)]
        ids = []
        for i in live:
            messages[i].append({"role": "user", "content": prompts[i].turns[turn]})
            ids.append(turn_ids(ctx, prompts[i], messages[i], turn, new))
        t0 = time.perf_counter()  # (the results are host lists: the call has finished its device work)
        results = engine.generate_many(ids, concurrency=rc.concurrency, temperature=rc.temperature,
                                       max_new_tokens=new, stop_token_ids=m.stops, seed=batch_seed(rc.seed, turn))
        wall += time.perf_counter() - t0
        if results and results[0].load_budget is not None and max_new_tokens is None:  # (not the warm-up's)
            ctx.load_budget.append(results[0].load_budget)
        for i, res in zip(live, results, strict=True):
            text = m.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            messages[i].append({"role": "assistant", "content": text})
            got[i].append((res, text))
    return got, wall
