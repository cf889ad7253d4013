"""Stage 3, training: a DFlash drafter from extracted features, resumable from its checkpoints.

AdamW with linear warmup and a cosine decay, gradient accumulation and clipping. A checkpoint
(`checkpoints/step_NNNNNN/`) is the drafter in the public format plus `trainer_state.pt`
(optimizer, step); the data order of an epoch depends only on (seed, epoch), so a resumed run
skips exactly the micro-batches it had done. Single process on CPU or one GPU; under
`accelerate launch` / torchrun (WORLD_SIZE > 1) the micro-batches are split over processes
and gradients averaged through accelerate.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ddtree.train.config import OptimConfig
from ddtree.train.features import FeatureShards, Sample
from ddtree.train.objective import block_loss, drafter_hidden, make_batch
from ddtree.train.tracking import NullTracker

STATE = "trainer_state.pt"


@dataclass
class FrozenTarget:
    """What training needs from the target: its input embeddings and its lm_head."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    lm_head_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, model, device: torch.device | str = "cpu") -> FrozenTarget:
        head = model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return cls(model.get_input_embeddings().weight.detach().to(device),
                   head.weight.detach().to(device), None if bias is None else bias.detach().to(device))


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def epoch_microbatches(shards: FeatureShards, batch_size: int, epoch: int, seed: int
                       ) -> list[tuple[int, list[int]]]:
    """(shard, sequence indices) of every micro-batch of an epoch, in order: a pure function of (seed, epoch)."""
    rng = random.Random(f"order-{seed}-{epoch}")
    order = list(range(shards.num_shards))
    rng.shuffle(order)
    sizes = shards.shard_sizes()
    out = []
    for k in order:
        idx = list(range(sizes[k]))
        rng.shuffle(idx)
        out += [(k, idx[i:i + batch_size]) for i in range(0, len(idx), batch_size)]
    return out


class _ShardCache:
    """Keeps the last loaded shard (micro-batches of an epoch come shard by shard)."""

    def __init__(self, shards: FeatureShards):
        self.shards, self.k, self.samples = shards, None, None

    def get(self, k: int, idx: list[int]) -> list[Sample]:
        if k != self.k:
            self.k, self.samples = k, self.shards.load(k)
        return [self.samples[i] for i in idx]


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(p for p in ckpt_dir.glob("step_*") if (p / STATE).exists())
    return found[-1] if found else None


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def train_drafter(drafter, target: FrozenTarget, shards: FeatureShards, cfg: OptimConfig, out_dir: Path, *,
                  device: torch.device | str = "cpu", tracker: NullTracker | None = None,
                  log: Callable[[str], None] = print) -> dict:
    """Train `drafter` in place on `shards`; checkpoints under out_dir/checkpoints. Returns a summary."""
    tracker = tracker or NullTracker()
    device = torch.device(device)
    rank, world = _world()
    if list(shards.target_layer_ids) != list(drafter.target_layer_ids):
        raise ValueError(f"features were extracted for target layers {shards.target_layer_ids}, the drafter reads "
                         f"{drafter.target_layer_ids}")
    drafter.to(device).train()
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))
    model, accelerator = drafter, None
    if world > 1:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu")
        model, opt = accelerator.prepare(drafter, opt)
        device = accelerator.device

    per_epoch = len(epoch_microbatches(shards, cfg.batch_size, 0, cfg.seed))
    steps_per_epoch = max(1, per_epoch // (cfg.grad_accum * world))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    ckpt_dir = out_dir / "checkpoints"
    step, micro = 0, 0  # optimizer steps done; micro-batches consumed (all processes together)
    resume = latest_checkpoint(ckpt_dir)
    if resume is not None:
        state = torch.load(resume / STATE, map_location=device, weights_only=False)
        drafter.load_state_dict(load_file(resume / "model.safetensors", device=str(device)))
        opt.load_state_dict(state["optimizer"])
        step, micro = state["step"], state["micro"]
        log(f"train: resumed from {resume.name} (step {step}/{total})")
    log(f"train: {len(shards)} sequences, {per_epoch} micro-batches/epoch, {total} steps "
        f"(batch {cfg.batch_size} x accum {cfg.grad_accum} x {world} proc, {cfg.anchors_per_seq} anchors/seq)")

    def batches() -> Iterator[tuple[int, list[Sample]]]:
        cache = _ShardCache(shards)
        m = micro
        while True:
            epoch, i = divmod(m, per_epoch)
            plan = epoch_microbatches(shards, cfg.batch_size, epoch, cfg.seed)
            for k, idx in plan[i:]:
                if m % world == rank:
                    yield m, cache.get(k, idx)
                m += 1

    stream = batches()
    bs, decay_w = drafter.block_size, cfg.loss_decay
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    agg: dict[str, float] = {}
    n_agg, t_log, tok_log = 0, time.perf_counter(), 0
    t_start = time.perf_counter()
    last: dict[str, float] = {}
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        for _ in range(cfg.grad_accum):
            m, samples = next(stream)
            batch = make_batch(samples, bs, cfg.anchors_per_seq, drafter.mask_token_id,
                               random.Random(f"anchors-{cfg.seed}-{m}")).to(device)
            with autocast:
                hidden = drafter_hidden(drafter, target.embed_weight, batch, call=model)
                loss, stats = block_loss(hidden, target.lm_head_weight, batch.labels, bs, decay_w, target.lm_head_bias)
            loss = loss / cfg.grad_accum
            (accelerator.backward(loss) if accelerator else loss.backward())
            for k, v in stats.items():
                agg[k] = agg.get(k, 0.0) + v
            n_agg += 1
            tok_log += stats["tokens"]
        micro = (m // world + 1) * world  # every process has consumed its share up to here
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0 or step == total:
            dt = time.perf_counter() - t_log
            last = {k: v / n_agg for k, v in agg.items() if k != "tokens"}
            last.update(lr=lr_at(step - 1, total, cfg), grad_norm=float(gnorm), label_tokens_per_s=tok_log / dt)
            if rank == 0:
                tracker.log_metrics({f"train/{k}": v for k, v in last.items()}, step=step)
                log(f"train: step {step}/{total} loss {last['loss']:.4f} acc {last['acc']:.3f} "
                    f"tau~{last['tau_proxy']:.2f} lr {last['lr']:.2e} {tok_log / dt:.0f} label tok/s")
            agg, n_agg, t_log, tok_log = {}, 0, time.perf_counter(), 0
        if rank == 0 and (step % cfg.save_every == 0 or step == total):
            save_checkpoint(drafter, opt, step, micro, ckpt_dir, cfg.keep_checkpoints)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    drafter.eval()
    return {"steps": total, "train_s": time.perf_counter() - t_start, **{f"final_{k}": v for k, v in last.items()}}


def save_checkpoint(drafter, opt, step: int, micro: int, ckpt_dir: Path, keep: int) -> Path:
    path = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    torch.save({"optimizer": opt.state_dict(), "step": step, "micro": micro}, tmp / STATE)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    older = sorted(p for p in ckpt_dir.glob("step_*") if p != path)
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    (ckpt_dir / "latest.json").write_text(json.dumps({"step": step, "path": path.name}) + "\n")
    return path
