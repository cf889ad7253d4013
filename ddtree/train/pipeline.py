"""The four stages in order, each skipped when its output exists (force=[stage] redoes it and what follows).

    out_dir/
      data/sequences.jsonl         stage data
      features/shard_*.safetensors  stage extract (+ manifest.json); features=online writes none
      checkpoints/step_*/          stage train (resume points; best.json names the best by tau)
      drafter/                     the final drafter (public format, loads in python -m ddtree.run)
      eval.json                    stage eval
      summary.json                 what this invocation did

Under torchrun (WORLD_SIZE > 1) every rank loads its own target; the ranks share the answers to
regenerate, the shards to extract and the training; rank 0 alone evaluates and records to MLflow,
the other ranks wait for it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddtree.errors import ConfigError
from ddtree.paths import runs_root
from ddtree.pipeline import distributed
from ddtree.pipeline.distributed import World
from ddtree.pipeline.models import load_checkpoint, resolve_device
from ddtree.pipeline.schema import flatten
from ddtree.pipeline.tracking import (
    TAG_ROLE,
    MlflowTracker,
    NullRun,
    config_hash,
    metric_key,
    numeric_metrics,
)
from ddtree.train.config import STAGES, TrainConfig, as_dict

RUN_FILE = "mlflow_run.json"  # the MLflow run of this out_dir: a resumed training continues it


def log(msg: str) -> None:
    print(msg, flush=True)


def load_frozen_target(cfg: TrainConfig, device: torch.device):
    """The frozen target and its tokenizer, through the runs' loader (ddtree.pipeline.models.load_checkpoint)."""
    t = cfg.target
    model, tok = load_checkpoint(t.name_or_path, device=str(device), dtype=getattr(torch, t.dtype),
                                 attn_implementation=t.attn_implementation, tokenizer=t.tokenizer,
                                 device_map=t.device_map, setting="target.name_or_path")
    model.requires_grad_(False)  # frozen: only the drafter trains
    return model, tok


def mask_token_id(cfg: TrainConfig, tokenizer, vocab_size: int) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    if cfg.drafter.mask_token:
        tid = tokenizer.convert_tokens_to_ids(cfg.drafter.mask_token)
        if tid is not None and tid != tokenizer.unk_token_id and 0 <= tid < vocab_size:
            return int(tid)
    return vocab_size - 1


def build_drafter(cfg: TrainConfig, target_config, tokenizer, vocab_size: int):
    from ddtree.engine.drafter import DFlash2Drafter, DFlashDrafter

    d = cfg.drafter
    if d.init:
        return DFlashDrafter.from_pretrained(d.init, dtype=torch.float32)  # its architecture decides the class
    kw = dict(num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=d.target_layer_ids,
              mask_token_id=mask_token_id(cfg, tokenizer, vocab_size), seed=d.seed)
    if d.arch == "dflash2":  # identity convolutions and a selector adding nothing yet (training's start)
        return DFlash2Drafter.random_for_target(target_config, conv_kernel_size=d.conv_kernel_size,
                                                conv_group_size=d.conv_group_size, selector_rank=d.selector_rank,
                                                selector_top_k=d.selector_top_k, perturb=False, **kw)
    return DFlashDrafter.random_for_target(target_config, **kw)


def clear_stages(out: Path, forced: list[str]) -> None:
    """Remove the outputs of the first forced stage and of every stage after it."""
    if not forced:
        return
    outputs = {"data": [out / "data"], "extract": [out / "features"],
               "train": [out / "checkpoints", out / "drafter"], "eval": [out / "eval.json"]}
    for stage in STAGES[min(STAGES.index(s) for s in forced):]:
        for p in outputs[stage]:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()


def numbers(d: dict[str, Any], prefix: str) -> dict[str, float]:
    """Every finite number of a (nested) dict as MLflow metrics under `prefix`."""
    return {metric_key(k): v for k, v in numeric_metrics(d, prefix).items()}


def open_tracking(cfg: TrainConfig, out: Path, world: World):
    """The MLflow run of this out_dir (continued on resume), or a NullRun (tracking=none, ranks > 0)."""
    if cfg.tracking.backend == "none" or not world.is_main:
        return NullRun()
    uri = cfg.tracking.uri or f"sqlite:///{runs_root() / 'runs' / 'mlflow.db'}"
    tracker = MlflowTracker(uri, cfg.tracking.experiment)
    run_file = out / RUN_FILE
    if run_file.exists():
        record = json.loads(run_file.read_text())
        job = tracker.reopen(record["run_id"]) if record.get("tracking_uri") == uri else None
        if job is not None:
            return job
    params = as_dict(cfg)
    job = tracker.start(run_name=cfg.tracking.run_name or out.name, params=flatten(params),
                        tags={TAG_ROLE: "train", "ddtree.out_dir": str(out)}, config_hash=config_hash(params))
    run_file.write_text(json.dumps({"run_id": job.run_id, "tracking_uri": uri}) + "\n")
    return job


@dataclass
class Session:
    """What the stages share: the config, the loaded models, the tracking run and the summary."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    world: World
    tracker: Any
    target: Any = None
    tokenizer: Any = None
    drafter: Any = None
    summary: dict = field(default_factory=dict)

    @property
    def sequences(self) -> Path:
        from ddtree.train.data import SEQUENCES

        return self.out / "data" / SEQUENCES

    @property
    def features(self) -> Path:
        return self.out / "features"

    @property
    def final(self) -> Path:
        return self.out / "drafter"

    def record(self, stage: str, stats: dict, metrics: dict | None = None) -> None:
        """Keep a stage's stats in the summary and log its numbers (or `metrics`) under '<stage>/'."""
        self.summary["stages"][stage] = stats
        self.tracker.log_metrics(numbers(stats if metrics is None else metrics, f"{stage}/"))


def stage_data(s: Session) -> None:
    """Sequences to train on. Regenerated answers are split over the ranks (prompt i on rank i % world)."""
    from ddtree.train.data import generate_sequences, hub_prompts, read_prompts, text_sequences

    if s.sequences.exists():
        log(f"data: {s.sequences} exists, skipped")
        return
    c, t = s.cfg.data, time.perf_counter()
    if c.source == "texts" or (c.source == "hub" and not c.hub.regenerate):
        if s.world.is_main:
            stats = text_sequences(s.tokenizer, c.texts, s.out / "data", max_samples=c.max_samples, log=log,
                                   hub=c.hub if c.source == "hub" else None)
            s.record("data", {**stats, "seconds": time.perf_counter() - t})
        return
    prompts = hub_prompts(c.hub) if c.source == "hub" else read_prompts(c.prompts, "data.prompts")
    prompts = prompts[:c.max_samples or None]
    where = s.out / "data" / f"rank{s.world.rank}" if s.world.is_distributed else s.out / "data"
    stats = generate_sequences(s.target, s.tokenizer, distributed.shard(prompts, s.world), where,
                               max_new_tokens=c.max_new_tokens, temperature=c.temperature, batch_size=c.batch_size,
                               chat_template=c.chat_template, seed=s.cfg.seed + s.world.rank, log=log)
    if s.world.is_distributed:
        distributed.gather(None, s.world)  # every rank's file is complete
        if not s.world.is_main:
            return
        stats = merge_rank_sequences(s.out / "data", s.world.world_size, [p.id for p in prompts])
    stats["seconds"] = time.perf_counter() - t
    s.record("data", stats)
    log(f"data: {stats}")


def merge_rank_sequences(data_dir: Path, world_size: int, prompt_ids: list[str]) -> dict:
    """data/rank*/sequences.jsonl as one data/sequences.jsonl in the order one process writes them
    (so the seeded shards, and the drafter, are those of one process)."""
    from ddtree.train.data import SEQUENCES, generation_order, read_sequences, sequence_stats

    records = sorted((r for k in range(world_size) for r in read_sequences(data_dir / f"rank{k}" / SEQUENCES)),
                     key=generation_order(prompt_ids))
    tmp = data_dir / (SEQUENCES + ".merging")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(data_dir / SEQUENCES)
    return {**sequence_stats(records), "ranks": world_size}


def stage_extract(s: Session) -> None:
    from ddtree.train.data import read_sequences
    from ddtree.train.features import MANIFEST, check_disk_plan, disk_plan, extract_features, write_manifest

    if s.cfg.features == "online":
        log("extract: features=online, the target computes them during training (nothing written)")
        return
    if (s.features / MANIFEST).exists():
        log(f"extract: {s.features} exists, skipped")
        return
    if not s.sequences.exists():
        raise ConfigError("stages", f"extract needs {s.sequences}", "add 'data' to stages")
    records = read_sequences(s.sequences)
    hidden = s.target.config.get_text_config().hidden_size
    plan = disk_plan(records, len(s.drafter.target_layer_ids) * hidden, getattr(torch, s.cfg.extract.dtype),
                     s.features)
    if s.world.is_main:
        log(f"extract: disk plan {plan.describe()}")
    check_disk_plan(plan, s.cfg.extract.keep_free_gb)  # every rank refuses alike: nobody waits for rank 0
    t, w, dtype = time.perf_counter(), s.world, getattr(torch, s.cfg.extract.dtype)
    stats = extract_features(s.target, records, s.drafter.target_layer_ids, s.features,
                             shard_size=s.cfg.extract.shard_size, batch_size=s.cfg.extract.batch_size, dtype=dtype,
                             shuffle_seed=s.cfg.seed, rank=w.rank, world_size=w.world_size, log=log)
    if w.is_distributed:
        per_rank = distributed.gather(stats, w)  # every rank's shards are written
        if not w.is_main:
            return
        rates = [r["samples_per_s"] for r in per_rank if r["samples_per_s"]]
        stats = write_manifest(s.features, records, s.drafter.target_layer_ids, s.cfg.extract.shard_size, dtype,
                               {"samples_per_s": sum(rates) or None, "ranks": w.world_size})
    stats.update(seconds=time.perf_counter() - t, planned_bytes=plan.total_bytes)
    s.record("extract", stats)


def feature_source(s: Session):
    """Shards on disk (features=offline) or the target in this process (features=online)."""
    from ddtree.train.data import read_sequences
    from ddtree.train.features import FeatureShards, OnlineFeatures

    layer_ids = s.drafter.target_layer_ids
    if s.cfg.features == "online":
        if not s.sequences.exists():
            raise ConfigError("stages", f"training needs {s.sequences}", "add 'data' to stages")
        return OnlineFeatures(s.target, read_sequences(s.sequences), layer_ids, shard_size=s.cfg.extract.shard_size,
                              shuffle_seed=s.cfg.seed)
    shards = FeatureShards(s.features)
    if list(shards.target_layer_ids) != list(layer_ids):
        raise ConfigError("drafter.target_layer_ids", f"features in {s.features} hold target layers "
                          f"{shards.target_layer_ids}, the drafter reads {layer_ids}",
                          "pass force=[extract] or those layer ids")
    return shards


def curve_evaluator(s: Session) -> Callable | None:
    """The acceptance curve: DFlash and DDTree (eval.curve_budget) on the held-out prompts, at a step."""
    from ddtree.train.evaluate import evaluate

    c = s.cfg.eval
    if not (c.prompts and c.every):
        return None

    def run(drafter, step: int) -> dict[str, float]:
        report = evaluate(s.target, drafter, s.tokenizer, c.prompts, max_samples=c.curve_samples,
                          max_new_tokens=c.max_new_tokens, methods=["dflash", "ddtree"], budgets=[c.curve_budget],
                          chat_template=c.chat_template, warmup=False, baseline=False, log=lambda _: None)
        ms = report["methods"]
        tree = ms[f"ddtree@{c.curve_budget}"]
        return {**numbers({k: {"tau": m["tau"], "tokens_per_s": m["tokens_per_s"]} for k, m in ms.items()},
                          "curve/"), "tau": tree["tau"]}

    return run


def stage_train(s: Session) -> None:
    from ddtree.train.trainer import FrozenTarget, latest_checkpoint, train_drafter

    if (s.final / "config.json").exists():
        log(f"train: {s.final} exists, skipped")
        return
    stats = train_drafter(s.drafter, FrozenTarget.of(s.target, s.device), feature_source(s), s.cfg.optim, s.out,
                          device=s.device, tracker=s.tracker, log=log, evaluate=curve_evaluator(s),
                          eval_every=s.cfg.eval.every, world=s.world)
    if s.world.is_main:  # the last step's checkpoint is the final drafter (whole, also under FSDP)
        last = latest_checkpoint(s.out / "checkpoints")
        s.final.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(last / name, s.final / name)
        s.record("train", stats)
        log(f"train: saved {s.final}")


def stage_eval(s: Session) -> None:
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.train.evaluate import evaluate

    c = s.cfg.eval
    if not c.prompts:
        return
    path = s.out / "eval.json"
    if path.exists():
        log(f"eval: {path} exists, skipped")
        return
    trained = DFlashDrafter.from_pretrained(s.final, dtype=s.target.dtype, device=s.device)
    report = evaluate(s.target, trained, s.tokenizer, c.prompts, max_samples=c.max_samples,
                      max_new_tokens=c.max_new_tokens, methods=list(c.methods), budgets=list(c.budgets),
                      chat_template=c.chat_template, warmup=c.warmup, log=log)
    path.write_text(json.dumps(report, indent=1) + "\n")
    s.record("eval", report, report["methods"])
    s.tracker.log_artifacts([path])


STAGE_RUNNERS: dict[str, Callable[[Session], None]] = {
    "data": stage_data, "extract": stage_extract, "train": stage_train, "eval": stage_eval}
RANK0_STAGES = ("eval",)  # under torchrun the other ranks wait for these


def load_models(s: Session) -> None:
    s.target, s.tokenizer = load_frozen_target(s.cfg, s.device)
    vocab = s.target.get_input_embeddings().weight.shape[0]
    s.drafter = build_drafter(s.cfg, s.target.config, s.tokenizer, vocab)
    s.drafter.check_compatible(s.target)


def run(cfg: TrainConfig) -> dict:
    """Run the configured stages; returns the summary (also written to out_dir/summary.json)."""
    world = distributed.world_from_env()
    out = Path(cfg.out_dir)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        clear_stages(out, cfg.force)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(resolve_device(cfg.device))
    device = torch.device(distributed.rank_device(str(device), world))
    distributed.init(world, str(device))
    s = Session(cfg, out, device, world, open_tracking(cfg, out, world), summary={"out_dir": str(out), "stages": {}})
    status = "FAILED"
    try:
        load_models(s)
        for stage in STAGES:
            if stage not in cfg.stages:
                continue
            if world.is_main or stage not in RANK0_STAGES:
                STAGE_RUNNERS[stage](s)
            if world.is_distributed:
                distributed.broadcast(None, world)  # the other ranks wait for rank 0's stage
        status = "FINISHED"
    finally:
        if world.is_main:
            (out / "summary.json").write_text(json.dumps(s.summary, indent=1, default=str) + "\n")
        s.tracker.end(status)
    return s.summary
