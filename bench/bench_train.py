"""Throughput of drafter training on the toy pair: answer regeneration, feature extraction, and
training from shards (features=offline) or from the target in the loop (features=online).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py [--samples 128] [--steps 20] [--repeats 3]

Each number is the median of --repeats passes. Also prints the target's forward time per token
(the cost online features add to every training token) and an estimate for Qwen3.6-27B on one H200
from a stated forward cost (see the README, "Train a drafter for your target").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddtree.engine.drafter import DFlashDrafter
from ddtree.pipeline.prompts import read_jsonl
from ddtree.train.config import OptimConfig
from ddtree.train.data import generate_sequences, read_sequences
from ddtree.train.features import FeatureShards, OnlineFeatures, extract_features, sequence_features
from ddtree.train.trainer import FrozenTarget, train_drafter

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "assets" / "toy"
LAYERS = [1, 3, 5]  # the toy drafter's target layers


def quiet(_: str) -> None:
    pass


def regenerate(target, tok, prompts, work: Path, batch_size: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    t = time.perf_counter()
    stats = generate_sequences(target, tok, prompts, work, max_new_tokens=128, batch_size=batch_size, log=quiet)
    dt = time.perf_counter() - t
    return {"samples_per_s": stats["sequences"] / dt, "answer_tokens_per_s": stats["answer_tokens"] / dt}


def extract(target, records, work: Path, batch_size: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    t = time.perf_counter()
    m = extract_features(target, records, LAYERS, work, shard_size=1024, batch_size=batch_size, dtype=torch.float32,
                         log=quiet)
    dt = time.perf_counter() - t
    return {"samples_per_s": m["num_sequences"] / dt, "tokens_per_s": m["num_tokens"] / dt}


def train(target, source, records, steps: int, work: Path) -> dict:
    shutil.rmtree(work / "checkpoints", ignore_errors=True)
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=16, target_layer_ids=LAYERS,
                                              mask_token_id=3, seed=0)
    cfg = OptimConfig(batch_size=16, anchors_per_seq=12, max_steps=steps, log_every=steps, save_every=10**9,
                      warmup_steps=2)
    t = time.perf_counter()
    s = train_drafter(drafter, FrozenTarget.of(target), source, cfg, work, log=quiet)
    dt = time.perf_counter() - t
    mean_len = sum(len(r["input_ids"]) for r in records) / len(records)
    return {"steps_per_s": steps / dt, "sequence_tokens_per_s": steps * cfg.batch_size * mean_len / dt,
            "label_tokens_per_s": s["final_label_tokens_per_s"]}


def forward_ms_per_token(target, records, batch_size: int) -> float:
    seqs = [r["input_ids"] for r in records[:batch_size]]
    t = time.perf_counter()
    sequence_features(target, seqs, LAYERS)
    return 1000 * (time.perf_counter() - t) / sum(len(s) for s in seqs)


def median_of(fn, repeats: int) -> dict:
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(TOY / "target", dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(TOY / "target")
    prompts = read_jsonl(TOY / "train_prompts.jsonl")[:args.samples]
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    try:
        res = {"regenerate": median_of(lambda: regenerate(target, tok, prompts, work / "data", args.batch_size),
                                       args.repeats)}
        records = read_sequences(work / "data" / "sequences.jsonl")
        res["extract"] = median_of(lambda: extract(target, records, work / "features", args.batch_size), args.repeats)
        shards = FeatureShards(work / "features")
        online = OnlineFeatures(target, records, LAYERS, shard_size=1024)
        res["train_offline"] = median_of(lambda: train(target, shards, records, args.steps, work), args.repeats)
        res["train_online"] = median_of(lambda: train(target, online, records, args.steps, work), args.repeats)
        res["target_forward_ms_per_token"] = statistics.median(
            forward_ms_per_token(target, records, 16) for _ in range(args.repeats))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["setup"] = {"samples": len(records), "steps": args.steps, "repeats": args.repeats,
                    "threads": torch.get_num_threads(), "mean_tokens_per_sample":
                    sum(len(r["input_ids"]) for r in records) / len(records)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
