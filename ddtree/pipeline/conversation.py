"""One method's generations on one prompt, and what a job's share runs them with: the job's files, its loaded models
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


def run_conversation(ctx: JobContext, prompt: Prompt, method: str, max_new_tokens: int | None = None):
    """Yield (turn, GenerationResult, text) for each user turn; later turns see this method's answers.

    The native ddtree.Engine of each method is built on first use and kept in ctx.engines (one per job: the
    set-up runs once per method, not once per generation)."""
    import torch

    from ddtree import Engine

    rc, m = ctx.rc, ctx.models
    target, tokenizer, device = m.target, m.tokenizer, m.device
    spec = METHODS[method]
    drafter = m.drafter if spec.drafter_kind is not None else None  # (method=mtp: the target's head, models.py)
    kw = {"block_size": rc.drafter.block_size} if rc.drafter.block_size and spec.reads_block_size else {}
    if spec.settings:  # mtp.*, eagle3.*
        settings = method_settings(rc)
        kw.update(steps=settings.steps, topk=settings.topk)
    if rc.engine == "upstream":  # the authors' generate functions, same arguments and result type
        from ddtree.upstream.engine import generate_upstream

        generate = functools.partial(generate_upstream, load_upstream(rc), target, drafter, method=method,
                                     budget=rc.budget, **kw)
    else:
        if method not in ctx.engines:
            ctx.engines[method] = Engine(target, drafter, method=method, budget=rc.budget,
                                         tune_host_allocator=rc.host_allocator, record=rc.record_rounds, compile=rc.compile,
                                         scoring=rc.scoring if spec.reads_scoring else None, **kw)
        generate = ctx.engines[method].generate
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids = encode(tokenizer, messages, chat_template=rc.dataset.chat_template,
                     enable_thinking=rc.dataset.enable_thinking)
        if not ids:  # (prompts are checked before loading; a later turn holds the model's own answers)
            raise ConfigError("dataset", f"turn {turn + 1} of prompt '{prompt.id}' is no tokens under this tokenizer",
                              "remove it or give it words the tokenizer knows")
        new = max_new_tokens or rc.max_new_tokens
        if rc.dataset.truncate:
            ids = keep_last(ids, new, target_context(target))
        else:  # a later turn grows with the model's answers: checked again here
            check_prompt_lengths([prompt], [len(ids)], new, target_context(target), False)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        gen = None
        if rc.temperature > 0:  # per prompt and turn, so a result does not depend on the prompt order
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{rc.seed}:{prompt.id}:{turn}".encode()))
        res = generate(input_ids, temperature=rc.temperature, max_new_tokens=max_new_tokens or rc.max_new_tokens,
                       stop_token_ids=m.stops, generator=gen)
        text = tokenizer.decode(res.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        yield turn, res, text
