"""`python -m ddtree.run`: compose conf/, run the baseline and the method on every prompt, record it.

    python -m ddtree.run                                    # tiny smoke run (offline)
    python -m ddtree.run model=qwen3_8b method=dflash
    python -m ddtree.run method=ddtree budget=32,64 -m      # a sweep: one MLflow parent, a child per job
    torchrun --nproc_per_node=8 -m ddtree.run model=qwen3_8b  # data parallel: the prompts shared by 8 ranks

Each job writes samples.jsonl (appended as prompts finish) and summary.json into its Hydra job dir
under runs/, prints a short table and, with tracking=mlflow, records a run. A mistake a user can
make ends the process with one line on stderr (exit code 2), before any model work where possible.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
import os
import platform
import re
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddtree.errors import ConfigError
from ddtree.pipeline.datasets import load_dataset_prompts
from ddtree.pipeline.prompts import Prompt, encode, fingerprint
from ddtree.pipeline.schema import (
    CONF_DIR,
    REPO_ROOT,
    RunConfig,
    flatten,
    identity_dict,
    resolved_dict,
    to_run_config,
    tracking_uri,
    validate,
)
from ddtree.pipeline.sweep_table import format_table

# conf/hydra/launcher/{submitit_slurm,submitit_local,ray}.yaml shadow the plugins' own configs on purpose
# (ddtree's defaults: a GPU per job); Hydra 1.3 then validates them against the plugin's schema, and says so
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema",
                        category=UserWarning)

USER_ERROR_EXIT = 2
SAMPLES = "samples.jsonl"
SUMMARY = "summary.json"
HISTOGRAM = "acceptance_hist.png"
RESOLVED = "config_resolved.yaml"
STAGES = ("draft", "tree", "verify", "commit")
# conf/hydra/launcher/*.yaml: the plugin module each needs -> how to install it
LAUNCHER_PACKAGES = {"hydra_plugins.hydra_submitit_launcher": "pip install 'ddtree[cluster]' (hydra-submitit-launcher)",
                     "hydra_plugins.hydra_ray_launcher": "pip install hydra-ray-launcher"}


# ---------------------------------------------------------------- models, loaded once per process


@dataclass
class ModelCache:
    """The last target and drafter loaded, so the jobs of a sweep (one process) reuse them.

    One of each is kept: a sweep over models frees the previous one instead of piling them up.
    """

    target_key: str | None = None
    target: Any = None
    tokenizer: Any = None
    drafter_key: str | None = None
    drafter: Any = None
    warmed: set[str] = field(default_factory=set)
    # AR baseline records of finished shards, by baseline_key(): reused by later jobs (baseline_reuse=true)
    baselines: dict[str, tuple[str, list[dict[str, Any]]]] = field(default_factory=dict)

    def clear(self) -> None:
        self.target_key = self.target = self.tokenizer = self.drafter_key = self.drafter = None
        self.warmed.clear()
        self.baselines.clear()


_MODELS = ModelCache()  # the per-process model cache (Hydra's basic launcher runs a sweep's jobs here)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def torch_dtype(name: str | None, *, tiny: bool):
    import torch

    if name in (None, "auto"):
        return torch.float32 if tiny else "auto"
    return getattr(torch, name)


def load_target(rc: RunConfig, device: str):
    """(model, tokenizer): a tiny random model built in code, or a checkpoint.

    With model.device_map set, accelerate places the layers (over this rank's GPUs under torchrun)
    and `device` is not used for the target; see ddtree.pipeline.distributed.input_device.
    """
    from ddtree.pipeline.distributed import dispatch, rank_max_memory, world_from_env

    m = rc.model
    max_memory = rank_max_memory(world_from_env()) if m.device_map is not None else None
    if m.tiny is not None:
        from ddtree.testing.tiny import tiny_model
        from ddtree.testing.tokenizer import tiny_tokenizer

        t = m.tiny
        model = tiny_model(t.model_type, seed=t.seed, attn_implementation=rc.attention.target,
                           dtype=torch_dtype(m.dtype, tiny=True), vocab_size=t.vocab_size,
                           num_hidden_layers=t.num_hidden_layers)
        model = dispatch(model, m.device_map, max_memory) if m.device_map is not None else model.to(device)
        return model.eval(), tiny_tokenizer(t.vocab_size)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"max_memory": max_memory} if max_memory else {}
    model = AutoModelForCausalLM.from_pretrained(
        m.name_or_path, dtype=torch_dtype(m.dtype, tiny=False), attn_implementation=rc.attention.target,
        revision=m.revision, trust_remote_code=m.trust_remote_code,
        device_map=m.device_map if m.device_map is not None else device, **kw)
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer or m.name_or_path, revision=m.revision,
                                              trust_remote_code=m.trust_remote_code)
    return model.eval(), tokenizer


def load_drafter(rc: RunConfig, target, device: str):
    """The DFlash drafter (None for drafter=none), checked against the target before any generation."""
    d = rc.drafter
    if d.kind == "none":
        return None
    from ddtree.engine.drafter import DFlashDrafter

    if d.kind == "random":
        kw = {"target_layer_ids": list(d.target_layer_ids)} if d.target_layer_ids is not None else {}
        drafter = DFlashDrafter.random_for_target(target.config, num_layers=d.num_layers,
                                                  block_size=d.block_size or 16, seed=d.seed,
                                                  attn_implementation=rc.attention.drafter, **kw)
        drafter = drafter.to(device=device, dtype=target.dtype)
    else:
        dtype = target.dtype if d.dtype in (None, "auto") else torch_dtype(d.dtype, tiny=False)
        kw = {"revision": d.revision} if d.revision else {}
        drafter = DFlashDrafter.from_pretrained(d.name_or_path, dtype=dtype, device=device,
                                                attn_implementation=rc.attention.drafter, **kw)
    drafter.check_compatible(target)
    return drafter.eval()


def model_device(target, rc: RunConfig, device: str) -> str:
    """Where inputs (and the drafter) go: `device`, or with a device map the embeddings' execution device."""
    if rc.model.device_map is None:
        return device
    from ddtree.pipeline.distributed import input_device

    return str(input_device(target))


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def get_models(rc: RunConfig, device: str):
    """(target, tokenizer, drafter), loading only what this job's settings change."""
    m = OmegaConf.to_container(OmegaConf.structured(rc.model))
    tkey = _key(m, device, rc.attention.target)
    if _MODELS.target_key != tkey:
        _MODELS.clear()
        _MODELS.target, _MODELS.tokenizer = load_target(rc, device)
        _MODELS.target_key = tkey
    drafter = None
    if rc.method != "ar":
        d = OmegaConf.to_container(OmegaConf.structured(rc.drafter))
        if rc.drafter.kind == "pretrained":
            d.pop("block_size")  # applied at generate time, not at load time
        dkey = _key(tkey, d, rc.attention.drafter, rc.engine, rc.upstream.path)
        if _MODELS.drafter_key != dkey:
            _MODELS.drafter = None
            _MODELS.drafter = load_drafter(rc, _MODELS.target, model_device(_MODELS.target, rc, device))
            if rc.engine == "upstream":  # the authors' drafter class, holding the same tensors
                from ddtree.upstream.engine import upstream_drafter

                _MODELS.drafter = upstream_drafter(load_upstream(rc), _MODELS.drafter)
            _MODELS.drafter_key = dkey
        drafter = _MODELS.drafter
    return _MODELS.target, _MODELS.tokenizer, drafter


def apply_compat(rc: RunConfig) -> list[dict[str, Any]]:
    """compat.apply(only=, skip=) when the patch registry is there; its report (one dict per patch)."""
    if not rc.compat.enabled:
        return []
    try:
        import compat

        apply = getattr(compat, "apply", None)
        if apply is None:
            from compat.registry import apply
    except ImportError:  # compat/ not written yet
        return []
    params = inspect.signature(apply).parameters
    kw = {k: v for k, v in (("only", rc.compat.only), ("skip", list(rc.compat.skip)), ("engine", rc.engine))
          if k in params}
    report = apply(**kw)  # an unknown patch id raises ConfigError itself
    return [r if isinstance(r, dict) else {"id": str(getattr(r, "id", r)), "status": "applied"} for r in report or []]


def load_upstream(rc: RunConfig):
    """engine=upstream: the authors' modules from upstream.path, patched as compat.* says (cached per path)."""
    from ddtree.upstream.engine import load_upstream_engine

    return load_upstream_engine(rc.upstream.path, only=rc.compat.only, skip=rc.compat.skip,
                                patch=rc.compat.enabled)


# ---------------------------------------------------------------- one job


def baseline_key(rc: RunConfig, mine: list[Prompt]) -> str:
    """Everything the AR baseline's tokens and timings depend on, besides the loaded target (its cache key)."""
    return _key(_MODELS.target_key, fingerprint(mine), rc.temperature, rc.seed, rc.max_new_tokens,
                rc.dataset.chat_template, rc.dataset.enable_thinking, rc.engine, rc.upstream.path,
                OmegaConf.to_container(OmegaConf.structured(rc.compat)), rc.warmup)


def stop_token_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    vocab = target.get_input_embeddings().weight.shape[0]
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def run_conversation(target, drafter, tokenizer, prompt: Prompt, method: str, rc: RunConfig, device: str,
                     stops: list[int], max_new_tokens: int | None = None):
    """Yield (turn, GenerationResult, text) for each user turn; later turns see this method's answers."""
    import torch

    from ddtree import generate

    if rc.engine == "upstream":  # the authors' generate functions, same arguments and result type
        from ddtree.upstream.engine import generate_upstream

        generate = functools.partial(generate_upstream, load_upstream(rc))
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids = encode(tokenizer, messages, chat_template=rc.dataset.chat_template,
                     enable_thinking=rc.dataset.enable_thinking)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        gen = None
        if rc.temperature > 0:  # per prompt and turn, so a result does not depend on the prompt order
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{rc.seed}:{prompt.id}:{turn}".encode()))
        kw = {"block_size": rc.drafter.block_size} if rc.drafter.block_size and method != "ar" else {}
        res = generate(target, drafter if method != "ar" else None, input_ids, method=method, budget=rc.budget,
                       temperature=rc.temperature, max_new_tokens=max_new_tokens or rc.max_new_tokens,
                       stop_token_ids=stops, generator=gen, **kw)
        text = tokenizer.decode(res.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        yield turn, res, text


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


def summarize(records: list[dict[str, Any]], rc: RunConfig, extra: dict[str, Any]) -> dict[str, Any]:
    meth = [r for r in records if r["role"] == "method"]
    base = [r for r in records if r["role"] == "baseline"]
    m = aggregate(meth)
    b = aggregate(base) if base else (m if rc.method == "ar" else None)
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
        "method": rc.method, "budget": rc.budget if rc.method == "ddtree" else None, "block_size": block,
        "temperature": rc.temperature, "model": rc.model.name, "drafter": rc.drafter.name_or_path or rc.drafter.kind,
        "num_prompts": len({r["id"] for r in meth}),
        "tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
        "baseline_tokens_per_s": b["tokens_per_s"] if b else None, "speedup": speedup, "match_rate": match_rate,
        "new_tokens": m["new_tokens"], "rounds": m["rounds"], "ttft_s_mean": m["ttft_s_mean"],
        "decode_s_mean": m["decode_s_mean"], "stage_seconds_mean": m["stage_seconds_mean"],
        "stage_ms_per_round": m["stage_ms_per_round"],
        "baseline": {k: b[k] for k in ("tau", "tokens_per_s", "new_tokens", "ttft_s_mean", "decode_s_mean")} if base else None,
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


def _job_dirs() -> tuple[Path, Path | None, list[str], Path | None]:
    """(job dir, sweep dir when this job is part of a multirun, this job's overrides, its log file)."""
    try:
        hc = HydraConfig.get()
    except ValueError:  # called without Hydra (a notebook): write to the cwd
        return Path.cwd(), None, [], None
    from hydra.types import RunMode

    job_dir = Path(hc.runtime.output_dir).resolve()
    sweep = Path(str(hc.sweep.dir)).resolve() if hc.mode == RunMode.MULTIRUN else None
    return job_dir, sweep, list(hc.overrides.task), job_dir / f"{hc.job.name}.log"


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """One Hydra job. Returns the summary; None when skipped because it already finished, and on ranks > 0.

    Under torchrun / accelerate launch every rank runs this with the same config: see ddtree.pipeline.distributed.
    """
    from ddtree.pipeline import distributed as D

    rc = to_run_config(cfg)
    if rc.dataset.path:
        rc.dataset.path = hydra.utils.to_absolute_path(rc.dataset.path)
    rc = validate(rc)
    prompts = load_dataset_prompts(rc.dataset)
    identity = identity_dict(rc)
    identity["prompts"] = fingerprint(prompts)
    world = D.world_from_env()
    device = D.rank_device(resolve_device(rc.device), world, rc.model.device_map)
    D.init(world, device)
    # rank 0's dirs are the job's: the other ranks' Hydra output went to a scratch dir (hydra_argv_for_rank)
    job_dir, sweep_dir, overrides, log_file = D.broadcast(_job_dirs(), world)
    job_dir.mkdir(parents=True, exist_ok=True)

    from ddtree.pipeline.tracking import (
        config_hash,
        git_commit,
        make_tracker,
        numeric_metrics,
        write_histogram,
    )

    chash = config_hash(identity)
    uri = tracking_uri(rc) if rc.tracking.backend == "mlflow" and world.is_main else None
    tracker = make_tracker(rc.tracking.backend if world.is_main else "none", uri, rc.tracking.experiment)
    done = D.broadcast(None if rc.force else tracker.finished_run(chash), world)
    if done:
        if world.is_main:
            print(f"skipped: this config already finished as MLflow run {done} in experiment "
                  f"'{rc.tracking.experiment}' ({' '.join(overrides) or 'defaults'}); force=true reruns it",
                  flush=True)
        return None

    compat_report = apply_compat(rc)
    if rc.engine == "upstream":  # import the authors' code before model work; report their patches too
        compat_report = load_upstream(rc).patches or compat_report
    for r in compat_report:
        if r.get("status") == "failed" and world.is_main:
            print(f"warning: compat patch {r['id']} failed to install: {r.get('detail')}", file=sys.stderr)
    t_load = time.perf_counter()
    target, tokenizer, drafter = get_models(rc, device)
    load_s = time.perf_counter() - t_load
    device = model_device(target, rc, device)  # with a device map: where the embeddings run
    stops = stop_token_ids(tokenizer, target)
    env = environment(device, compat_report)
    env["world_size"] = world.world_size
    where = D.placement(target)
    if where is not None:
        env["placement"] = where

    # rank 0 writes the job's files; with several ranks each appends its own share of samples
    samples_path = job_dir / SAMPLES
    rank_path = job_dir / D.rank_samples_name(world.rank) if world.is_distributed else samples_path
    rank_path.write_text("")  # a rerun in the same dir starts a fresh file
    if world.is_distributed and world.is_main:
        samples_path.unlink(missing_ok=True)  # written whole once the ranks' records are gathered
    resolved = resolved_dict(rc)
    artifacts = [job_dir / ".hydra" / "config.yaml", job_dir / ".hydra" / "overrides.yaml", job_dir / RESOLVED]
    base_name = f"{rc.model.name}-{rc.method}" + (f"-b{rc.budget}" if rc.method == "ddtree" else "")
    base_name += "-upstream" if rc.engine == "upstream" else ""
    job = None
    if world.is_main:
        (job_dir / RESOLVED).write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
        tags = {"torch_version": env["versions"]["torch"], "transformers_version": env["versions"]["transformers"],
                "python_version": env["versions"]["python"], "device": device, "device_name": env["device_name"],
                "git_commit": git_commit(REPO_ROOT), "compat.applied": ",".join(env["compat"]["applied"]) or "none",
                **{f"compat.{k}": v for k, v in env["compat"]["patches"].items()},
                "overrides": " ".join(overrides), "job_dir": str(job_dir), "mlflow.source.name": "ddtree.run",
                "world_size": world.world_size, **rc.tags}
        if where is not None:
            tags["devices"] = ",".join(where["devices"])
        tags["mlflow.source.git.commit"] = (tags["git_commit"] or "").removesuffix("-dirty") or None
        sweep_name = f"sweep {sweep_dir.parent.name}/{sweep_dir.name}" if sweep_dir else None
        job = tracker.start(run_name=base_name, params=flatten(resolved), tags=tags, config_hash=chash,
                            sweep_dir=sweep_dir, sweep_name=sweep_name)

    methods = [rc.method] + (["ar"] if rc.baseline and rc.method != "ar" else [])
    records: list[dict[str, Any]] = []
    import torch

    torch.manual_seed(rc.seed)
    try:
        failure: BaseException | None = None
        reused_from = None
        try:
            reused_from = _generate_shard(target, drafter, tokenizer, prompts, D.shard(prompts, world), methods,
                                          rc, device, stops, rank_path, records, base_name,
                                          show_progress=world.is_main, origin=str(job_dir))
        except Exception as e:
            if not world.is_distributed:
                raise
            failure = e  # still join the gather below, so rank 0 learns of it instead of waiting
        gathered = D.gather({"rank": world.rank, "records": records, "baseline_reused_from": reused_from,
                             "error": None if failure is None else f"{type(failure).__name__}: {failure}"}, world)
        if failure is not None:
            raise failure
        if not world.is_main:
            return None
        errors = [f"rank {g['rank']}: {g['error']}" for g in gathered if g["error"]]
        if errors:
            raise RuntimeError("a data-parallel rank failed: " + "; ".join(errors))
        if world.is_distributed:
            records = D.merge_in_order([g["records"] for g in gathered], [p.id for p in prompts])
            with samples_path.open("w", encoding="utf-8") as out:
                out.writelines(json.dumps(rec) + "\n" for rec in records)
        reused = {g.get("baseline_reused_from") for g in gathered} - {None}
        summary = summarize(records, rc, {**env, "load_s": load_s, "config_hash": chash,
                                          "baseline_reused_from": min(reused) if reused else None})
        (job_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        lengths = [a for r in records if r["role"] == "method" for a in r["acceptance_lengths"]]
        write_histogram(lengths, job_dir / HISTOGRAM, f"{base_name}: tau={summary['tau'] or 0:.2f}")
        print(format_table(summary), flush=True)
        print(f"results: {job_dir}", flush=True)
        if job is not None:
            if summary["baseline_reused_from"]:
                job.set_tags({"baseline_reused_from": summary["baseline_reused_from"]})
            job.log_metrics(numeric_metrics(summary))
            job.log_artifacts([*artifacts, samples_path, job_dir / SUMMARY, job_dir / HISTOGRAM,
                               *([log_file] if log_file else [])])
            job.end("FINISHED")
        return summary
    except BaseException as e:
        if job is not None:  # keep what finished; the run says FAILED (KILLED on Ctrl-C)
            try:
                job.set_tags({"error": f"{type(e).__name__}: {e}"[:500]})
                job.log_artifacts([*artifacts, samples_path if samples_path.is_file() else rank_path])
            finally:
                job.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise


def _generate_shard(target, drafter, tokenizer, prompts: list[Prompt], mine: list[Prompt], methods: list[str],
                    rc: RunConfig, device: str, stops: list[int], path: Path, records: list[dict[str, Any]],
                    base_name: str, show_progress: bool = True, origin: str = "") -> str | None:
    """Warm up (once per process and setting), then run every method on this rank's prompts, appending
    one record per prompt, turn and role to `records` and to `path` as each prompt finishes.

    With rc.baseline_reuse, the AR baseline comes from an earlier job of this process that ran it on the
    same prompts with the same settings (returned: that job's `origin`); else it runs here and is kept
    for later jobs under this job's `origin`."""
    wkey = _key(_MODELS.target_key, _MODELS.drafter_key, rc.method)
    if rc.warmup and wkey not in _MODELS.warmed:  # first-call costs stay out of the timings
        for meth in methods:
            for _ in run_conversation(target, drafter, tokenizer, Prompt("warmup", prompts[0].turns[:1]), meth,
                                      rc, device, stops, max_new_tokens=min(8, rc.max_new_tokens)):
                pass
        _MODELS.warmed.add(wkey)
    from tqdm import tqdm

    bkey = baseline_key(rc, mine) if "ar" in methods and rc.method != "ar" and rc.baseline_reuse else None
    reused_from, kept = _MODELS.baselines.get(bkey, (None, None)) if bkey else (None, None)
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for rec in kept or []:
        by_prompt.setdefault(rec["id"], []).append(rec)
    fresh: list[dict[str, Any]] = []
    with path.open("a", encoding="utf-8") as out:
        bar = tqdm(mine, desc=base_name, unit="prompt", file=sys.stderr, dynamic_ncols=True,
                   disable=not show_progress)
        for prompt in bar:
            for meth in reversed(methods):  # the baseline first: the method's outputs get compared to it
                role = "method" if meth == rc.method else "baseline"
                if role == "baseline" and reused_from is not None:
                    got = [{**rec, "reused_from": reused_from} for rec in by_prompt[prompt.id]]
                else:
                    got = [{"id": prompt.id, "turn": turn, "role": role, **res.to_dict(), "text": text}
                           for turn, res, text in run_conversation(target, drafter, tokenizer, prompt, meth, rc,
                                                                   device, stops)]
                    if role == "baseline":
                        fresh.extend(got)
                records.extend(got)
                out.writelines(json.dumps(rec) + "\n" for rec in got)
            out.flush()
            m = [r for r in records if r["role"] == "method"]
            bar.set_postfix(tau=f"{aggregate(m)['tau'] or 0:.2f}")
    if bkey and reused_from is None:  # complete: later jobs may reuse it
        _MODELS.baselines[bkey] = (origin, fresh)
    return reused_from


# ---------------------------------------------------------------- entry point


def _one_line(e: BaseException) -> str:
    """Hydra and OmegaConf errors in one line: the message and its cause, without search paths."""
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options:
        group, _, name = str(e.missing_cfg_file).rpartition("/")
        return f"{group}: unknown option '{name}' — use one of: {', '.join(sorted(e.options))}"
    msg, cause = str(e), e.__cause__
    merging = re.match(r"Error merging override (\S+?)=", msg)
    if merging and cause is not None:
        return f"{merging.group(1)}: {str(cause).splitlines()[0]}"
    unknown = re.match(r"Could not override '([^']+)'", msg)
    if unknown:
        key = unknown.group(1)
        return f"{key}: no such setting — check the spelling (python -m ddtree.run --cfg job prints every setting)"
    skip = ("Config search path", "provider=", "See https://", "Set the environment variable", "full_key:",
            "object_type=", "Available options")
    lines: list[str] = []
    for exc in (e, e.__cause__):
        if exc is None:
            continue
        for ln in str(exc).splitlines():
            ln = ln.strip()
            if ln and not ln.startswith(skip) and ln not in lines and not set(ln) <= {"^", " "}:
                lines.append(ln)
    return " ".join(lines) or type(e).__name__


def _user_error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(USER_ERROR_EXIT)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run_job(cfg)
    except BaseException as e:
        from ddtree.pipeline.distributed import world_from_env

        sweep_dir = _job_dirs()[1]
        if sweep_dir is not None and world_from_env().is_main:  # the basic launcher stops the sweep here
            from ddtree.pipeline.tracking import fail_sweep

            try:
                fail_sweep(sweep_dir)
            except Exception as err:  # never hide the job's own error behind a tracking one
                print(f"warning: could not mark the sweep's MLflow run failed: {err}", file=sys.stderr)
        if isinstance(e, ConfigError) and not os.environ.get("DDTREE_TRACEBACK"):
            _user_error(str(e))  # leaves Hydra as SystemExit: no "Error executing job" banner either
        raise


def main() -> None:
    # let composition errors reach us instead of Hydra's multi-line report
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        from ddtree.pipeline.distributed import hydra_argv_for_rank, world_from_env

        sys.argv[1:] = hydra_argv_for_rank(sys.argv[1:], world_from_env())  # torchrun ranks > 0: scratch dirs
        _hydra_main()
    except ConfigError as e:  # a malformed RANK/WORLD_SIZE environment
        _user_error(str(e))
    except (HydraException, OmegaConfBaseException) as e:
        if os.environ.get("DDTREE_TRACEBACK"):
            raise
        _user_error(_one_line(e))
    except RuntimeError as e:  # hydra/launcher=<x> whose plugin is not installed
        missing = next((fix for mod, fix in LAUNCHER_PACKAGES.items() if f"'{mod}." in str(e)), None)
        if missing is None or os.environ.get("DDTREE_TRACEBACK"):
            raise
        _user_error(f"hydra/launcher: the launcher plugin is not installed — {missing}")
    except BrokenPipeError:  # `--help | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main()
