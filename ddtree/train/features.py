"""Stage 2, hidden-state extraction: one target forward per sequence, context features in shards.

A shard (`shard_00000.safetensors`) holds, for up to `shard_size` sequences:
  input_ids [T] int32 (all sequences concatenated), features [T, n_ids * H],
  offsets [n + 1] int64 (sequence i is rows offsets[i]:offsets[i+1]),
  spans [m, 3] int64 (sequence index, start, end) — the positions anchors are drawn from.
Features are the engine's: hidden_states[i + 1] of each target layer id i, concatenated
(ddtree.engine.target.context_features). A shard is written atomically, so a restart redoes at most
the shard that was being written.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddtree.engine.target import context_features

MANIFEST = "manifest.json"


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.safetensors"


@torch.no_grad()
def sequence_features(model, sequences: list[list[int]], layer_ids: list[int]) -> list[torch.Tensor]:
    """Context features [len, n_ids * H] of each sequence, from one right-padded target forward."""
    dev = next(model.parameters()).device
    n = max(len(s) for s in sequences)
    pad = 0
    ids = torch.full((len(sequences), n), pad, dtype=torch.long, device=dev)
    mask = torch.zeros((len(sequences), n), dtype=torch.long, device=dev)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, device=dev)
        mask[i, :len(s)] = 1
    # padding at the end never reaches earlier positions of a causal model, and a mask of all ones
    # lets the model take its unpadded path
    out = model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask,
                output_hidden_states=[i + 1 for i in layer_ids], logits_to_keep=1, use_cache=False)
    feats = context_features(out.hidden_states, layer_ids)
    return [feats[i, :len(s)] for i, s in enumerate(sequences)]


def extract_features(model, records: list[dict], layer_ids: list[int], out_dir: Path, *, shard_size: int = 512,
                     batch_size: int = 8, dtype: torch.dtype = torch.bfloat16, shuffle_seed: int | None = 0,
                     log: Callable[[str], None] = print) -> dict:
    """Write every record's features into shards under out_dir; skips shards already there.

    Records are dealt into shards in a seeded random order (shuffle_seed=None keeps theirs), so
    every shard is a sample of the whole set: training reads shard after shard, and shards made
    of one kind of record (generated answers come grouped by prompt length) would make it forget.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if shuffle_seed is not None:
        records = list(records)
        random.Random(shuffle_seed).shuffle(records)
    n_shards = (len(records) + shard_size - 1) // shard_size
    t0, done_seqs, done_tokens = time.perf_counter(), 0, 0
    for k in range(n_shards):
        path = out_dir / shard_name(k)
        if path.exists():
            continue
        part = records[k * shard_size:(k + 1) * shard_size]
        feats: list[torch.Tensor | None] = [None] * len(part)
        order = sorted(range(len(part)), key=lambda i: len(part[i]["input_ids"]))  # little padding per batch
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            for i, f in zip(idx, sequence_features(model, [part[i]["input_ids"] for i in idx], layer_ids),
                            strict=True):
                feats[i] = f.to("cpu", dtype)
        lengths = [len(r["input_ids"]) for r in part]
        offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
        spans = [[i, s, e] for i, r in enumerate(part) for s, e in r["spans"]]
        tensors = {"input_ids": torch.tensor([t for r in part for t in r["input_ids"]], dtype=torch.int32),
                   "features": torch.cat(feats).contiguous(), "offsets": offsets,
                   "spans": torch.tensor(spans, dtype=torch.long).reshape(-1, 3)}
        meta = {"ids": json.dumps([r["id"] for r in part]), "target_layer_ids": json.dumps(list(layer_ids))}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
        done_seqs, done_tokens = done_seqs + len(part), done_tokens + sum(lengths)
        dt = time.perf_counter() - t0
        log(f"extract: shard {k + 1}/{n_shards}, {done_seqs / dt:.1f} samples/s, {done_tokens / dt:.0f} tokens/s")
    dt = time.perf_counter() - t0
    manifest = {"num_sequences": len(records), "num_tokens": sum(len(r["input_ids"]) for r in records),
                "num_shards": n_shards, "shard_size": shard_size, "target_layer_ids": list(layer_ids),
                "feature_dim": None, "dtype": str(dtype).removeprefix("torch."),
                "samples_per_s": done_seqs / dt if done_seqs else None}
    if n_shards:
        with safe_open(out_dir / shard_name(0), "pt") as f:
            manifest["feature_dim"] = f.get_slice("features").get_shape()[1]
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


@dataclass
class Sample:
    """One sequence: token ids [L], features [L, F], and the spans anchors come from."""

    input_ids: torch.Tensor
    features: torch.Tensor
    spans: list[tuple[int, int]]
    id: str | None = None


class FeatureShards:
    """Read access to an extraction directory, one shard at a time."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        manifest = self.dir / MANIFEST
        if not manifest.exists():
            raise FileNotFoundError(f"no {MANIFEST} in {self.dir}: run the extract stage first")
        self.manifest = json.loads(manifest.read_text())
        self.num_shards = self.manifest["num_shards"]
        self.target_layer_ids = self.manifest["target_layer_ids"]

    def __len__(self) -> int:
        return self.manifest["num_sequences"]

    def shard_sizes(self) -> list[int]:
        n, s = len(self), self.manifest["shard_size"]
        return [min(s, n - k * s) for k in range(self.num_shards)]

    def load(self, k: int) -> list[Sample]:
        with safe_open(self.dir / shard_name(k), "pt") as f:
            ids, feats = f.get_tensor("input_ids").long(), f.get_tensor("features")
            offsets, spans = f.get_tensor("offsets").tolist(), f.get_tensor("spans").tolist()
            names = json.loads(f.metadata()["ids"])
        by_seq: dict[int, list[tuple[int, int]]] = {}
        for i, s, e in spans:
            by_seq.setdefault(i, []).append((s, e))
        return [Sample(ids[a:b], feats[a:b], by_seq.get(i, []), names[i])
                for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))]

    def __iter__(self) -> Iterator[Sample]:
        for k in range(self.num_shards):
            yield from self.load(k)
