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
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddtree.engine.target import context_features
from ddtree.errors import ConfigError

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


def deal_into_shards(records: list[dict], shard_size: int, shuffle_seed: int | None) -> list[list[dict]]:
    """Records dealt into shards in a seeded random order (shuffle_seed=None keeps theirs).

    Every shard is then a sample of the whole set: training reads shard after shard, and shards made
    of one kind of record (generated answers come grouped by prompt length) would make it forget.
    Offline extraction and online features deal alike, so both train on the same micro-batches.
    """
    if shuffle_seed is not None:
        records = list(records)
        random.Random(shuffle_seed).shuffle(records)
    return [records[k:k + shard_size] for k in range(0, len(records), shard_size)]


def extract_features(model, records: list[dict], layer_ids: list[int], out_dir: Path, *, shard_size: int = 512,
                     batch_size: int = 8, dtype: torch.dtype = torch.bfloat16, shuffle_seed: int | None = 0,
                     rank: int = 0, world_size: int = 1, log: Callable[[str], None] = print) -> dict | None:
    """Write every record's features into shards under out_dir (see deal_into_shards); skips shards already there.

    With several ranks, rank r writes the shards k with k % world_size == r, and only rank 0 writes the
    manifest (call it once every rank has finished; see write_manifest); the others return None.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = deal_into_shards(records, shard_size, shuffle_seed)
    n_shards = len(shards)
    t0, done_seqs, done_tokens = time.perf_counter(), 0, 0
    for k, part in enumerate(shards):
        path = out_dir / shard_name(k)
        if path.exists() or k % world_size != rank:
            continue
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
    stats = {"samples_per_s": done_seqs / dt if done_seqs else None}
    return write_manifest(out_dir, records, layer_ids, shard_size, dtype, stats) if world_size == 1 else stats


def write_manifest(out_dir: Path, records: list[dict], layer_ids: list[int], shard_size: int, dtype: torch.dtype,
                   stats: dict) -> dict:
    """manifest.json: what the shards hold; written last, it marks the extraction finished."""
    n_shards = (len(records) + shard_size - 1) // shard_size
    manifest = {"num_sequences": len(records), "num_tokens": sum(len(r["input_ids"]) for r in records),
                "num_shards": n_shards, "shard_size": shard_size, "target_layer_ids": list(layer_ids),
                "feature_dim": None, "dtype": str(dtype).removeprefix("torch."), **stats}
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
        self._loaded: tuple[int, list[Sample]] | None = None  # micro-batches of an epoch come shard by shard

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

    def samples(self, shard: int, idx: list[int]) -> list[Sample]:
        if self._loaded is None or self._loaded[0] != shard:
            self._loaded = (shard, self.load(shard))
        return [self._loaded[1][i] for i in idx]

    def __iter__(self) -> Iterator[Sample]:
        for k in range(self.num_shards):
            yield from self.load(k)


def _record_sample(record: dict, features: torch.Tensor) -> Sample:
    return Sample(torch.tensor(record["input_ids"], dtype=torch.long), features,
                  [(int(a), int(b)) for a, b in record["spans"]], record["id"])


class OnlineFeatures:
    """features=online: the frozen target computes each micro-batch's features when it is asked for them.

    Nothing goes to disk; records are dealt into the same groups as offline shards (deal_into_shards),
    so the data order, resume and checkpoints are those of offline training. One no-grad target forward
    per micro-batch (right-padded), in the target's own dtype and on its own device(s).
    """

    def __init__(self, model, records: list[dict], layer_ids: list[int], *, shard_size: int = 512,
                 shuffle_seed: int | None = 0):
        self.model, self.target_layer_ids = model, list(layer_ids)
        self.shards = deal_into_shards(records, shard_size, shuffle_seed)

    def __len__(self) -> int:
        return sum(len(p) for p in self.shards)

    def shard_sizes(self) -> list[int]:
        return [len(p) for p in self.shards]

    def samples(self, shard: int, idx: list[int]) -> list[Sample]:
        records = [self.shards[shard][i] for i in idx]
        feats = sequence_features(self.model, [r["input_ids"] for r in records], self.target_layer_ids)
        return [_record_sample(r, f) for r, f in zip(records, feats, strict=True)]


@dataclass
class DiskPlan:
    """What offline extraction will write, against the free space where it writes."""

    bytes_per_token: int
    tokens: int
    total_bytes: int
    free_bytes: int
    written_bytes: int  # shards already there (a resumed extraction)

    def describe(self) -> str:
        return (f"{self.bytes_per_token:,} B/token x {self.tokens:,} tokens = {_size(self.total_bytes)}, "
                f"{_size(self.written_bytes)} written, {_size(self.free_bytes)} free")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def disk_plan(records: list[dict], feature_dim: int, dtype: torch.dtype, out_dir: Path) -> DiskPlan:
    """Bytes per token (features + the int32 token id), the total for `records`, and the free space."""
    per_token = feature_dim * torch.empty((), dtype=dtype).element_size() + 4
    tokens = sum(len(r["input_ids"]) for r in records)
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    written = sum(f.stat().st_size for f in out_dir.glob("shard_*.safetensors")) if out_dir.exists() else 0
    return DiskPlan(per_token, tokens, per_token * tokens, shutil.disk_usage(probe).free, written)


def check_disk_plan(plan: DiskPlan, keep_free_gb: float) -> None:
    """Refuse an extraction that would not fit (leaving keep_free_gb free), before writing anything."""
    needed = plan.total_bytes - plan.written_bytes
    room = plan.free_bytes - keep_free_gb * 1e9
    if needed > room:
        raise ConfigError("features", f"offline extraction needs {_size(needed)} more ({plan.describe()}; "
                          f"extract.keep_free_gb={keep_free_gb:g})",
                          "use features=online (the target computes features during training, nothing on disk)")
