"""The four stages in order, each skipped when its output exists (force=[stage] redoes it and what follows).

    out_dir/
      data/sequences.jsonl         stage data
      features/shard_*.safetensors  stage extract (+ manifest.json)
      checkpoints/step_*/          stage train (resume points); drafter/ is the final drafter
      eval.json                    stage eval
      summary.json                 what this invocation did
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from ddtree.errors import ConfigError
from ddtree.train.config import STAGES, TrainConfig, as_dict
from ddtree.train.tracking import make_tracker


def log(msg: str) -> None:
    print(msg, flush=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name} requested but CUDA is not available", "use device=cpu or auto")
    return torch.device(name)


def load_target(cfg: TrainConfig, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cfg.target.name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(cfg.target.tokenizer or path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.target.dtype),
                                                     attn_implementation=cfg.target.attn_implementation)
    except OSError as e:
        raise ConfigError("target.name_or_path", f"cannot load {path}: {str(e).splitlines()[0]}",
                          "point to a Hugging Face checkpoint directory or hub id") from None
    return model.to(device).eval(), tok


def mask_token_id(cfg: TrainConfig, tokenizer, vocab_size: int) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    if cfg.drafter.mask_token:
        tid = tokenizer.convert_tokens_to_ids(cfg.drafter.mask_token)
        if tid is not None and tid != tokenizer.unk_token_id and 0 <= tid < vocab_size:
            return int(tid)
    return vocab_size - 1


def build_drafter(cfg: TrainConfig, target_config, tokenizer, vocab_size: int):
    from ddtree.engine.drafter import DFlashDrafter

    if cfg.drafter.init:
        return DFlashDrafter.from_pretrained(cfg.drafter.init, dtype=torch.float32)
    return DFlashDrafter.random_for_target(
        target_config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
        target_layer_ids=cfg.drafter.target_layer_ids, mask_token_id=mask_token_id(cfg, tokenizer, vocab_size),
        seed=cfg.drafter.seed)


def _clear(out: Path, stage: str) -> None:
    paths = {"data": [out / "data"], "extract": [out / "features"],
             "train": [out / "checkpoints", out / "drafter"], "eval": [out / "eval.json"]}[stage]
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def run(cfg: TrainConfig) -> dict:
    """Run the configured stages; returns the summary (also written to out_dir/summary.json)."""
    from ddtree.train.data import SEQUENCES, generate_sequences, read_sequences, text_sequences
    from ddtree.train.evaluate import evaluate
    from ddtree.train.features import MANIFEST, FeatureShards, extract_features
    from ddtree.train.trainer import FrozenTarget, train_drafter

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.force:
        first = min(STAGES.index(s) for s in cfg.force)
        for s in STAGES[first:]:
            _clear(out, s)
    device = resolve_device(cfg.device)
    tracker = make_tracker(cfg.tracking, out)
    tracker.log_params(as_dict(cfg))
    summary: dict = {"out_dir": str(out), "stages": {}}
    status = "FAILED"
    try:
        target, tok = load_target(cfg, device)
        vocab = target.get_input_embeddings().weight.shape[0]
        drafter = build_drafter(cfg, target.config, tok, vocab)
        drafter.check_compatible(target)
        layer_ids = drafter.target_layer_ids
        seq_path, feat_dir, final = out / "data" / SEQUENCES, out / "features", out / "drafter"

        if "data" in cfg.stages:
            if seq_path.exists():
                log(f"data: {seq_path} exists, skipped")
            else:
                t = time.perf_counter()
                if cfg.data.source == "generate":
                    stats = generate_sequences(target, tok, cfg.data.prompts, out / "data",
                                               max_samples=cfg.data.max_samples,
                                               max_new_tokens=cfg.data.max_new_tokens,
                                               temperature=cfg.data.temperature, batch_size=cfg.data.batch_size,
                                               chat_template=cfg.data.chat_template, seed=cfg.seed, log=log)
                else:
                    stats = text_sequences(tok, cfg.data.texts, out / "data", max_samples=cfg.data.max_samples,
                                           log=log)
                stats["seconds"] = time.perf_counter() - t
                summary["stages"]["data"] = stats
                tracker.log_metrics({f"data/{k}": v for k, v in stats.items()})
                log(f"data: {stats}")

        if "extract" in cfg.stages:
            if (feat_dir / MANIFEST).exists():
                log(f"extract: {feat_dir} exists, skipped")
            else:
                if not seq_path.exists():
                    raise ConfigError("stages", f"extract needs {seq_path}", "add 'data' to stages")
                t = time.perf_counter()
                manifest = extract_features(target, read_sequences(seq_path), layer_ids, feat_dir,
                                            shard_size=cfg.extract.shard_size, batch_size=cfg.extract.batch_size,
                                            dtype=getattr(torch, cfg.extract.dtype), shuffle_seed=cfg.seed, log=log)
                manifest["seconds"] = time.perf_counter() - t
                summary["stages"]["extract"] = manifest
                tracker.log_metrics({f"extract/{k}": v for k, v in manifest.items()})

        if "train" in cfg.stages:
            if (final / "config.json").exists():
                log(f"train: {final} exists, skipped")
            else:
                shards = FeatureShards(feat_dir)
                if list(shards.target_layer_ids) != list(layer_ids):
                    raise ConfigError("drafter.target_layer_ids",
                                      f"features in {feat_dir} hold target layers {shards.target_layer_ids}, the "
                                      f"drafter reads {layer_ids}", "pass force=[extract] or those layer ids")
                frozen = FrozenTarget.of(target, device)
                stats = train_drafter(drafter, frozen, shards, cfg.optim, out, device=device, tracker=tracker, log=log)
                drafter.to("cpu").save_pretrained(final)
                summary["stages"]["train"] = stats
                tracker.log_metrics({f"train/{k}": v for k, v in stats.items()})
                log(f"train: saved {final}")

        if "eval" in cfg.stages and cfg.eval.prompts:
            from ddtree.engine.drafter import DFlashDrafter

            eval_path = out / "eval.json"
            if eval_path.exists():
                log(f"eval: {eval_path} exists, skipped")
            else:
                trained = DFlashDrafter.from_pretrained(final, dtype=target.dtype, device=device)
                report = evaluate(target, trained, tok, cfg.eval.prompts, max_samples=cfg.eval.max_samples,
                                  max_new_tokens=cfg.eval.max_new_tokens, methods=list(cfg.eval.methods),
                                  budgets=list(cfg.eval.budgets), chat_template=cfg.eval.chat_template,
                                  warmup=cfg.eval.warmup, log=log)
                eval_path.write_text(json.dumps(report, indent=1) + "\n")
                summary["stages"]["eval"] = report
                tracker.log_metrics({f"eval/{name}": m for name, m in report["methods"].items()})
                tracker.log_artifact(eval_path)
        status = "FINISHED"
    finally:
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        tracker.end(status)
    return summary
