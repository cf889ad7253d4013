"""Stage 3, training: a DFlash drafter on context features, resumable from its checkpoints.

AdamW with linear warmup and a cosine decay, gradient accumulation and clipping. Features come from
a `FeatureSource`: shards on disk (features=offline) or the frozen target itself, one forward per
micro-batch (features=online); both deal the same sequences into the same groups, so the data order
of an epoch depends only on (seed, epoch) and a resumed run skips exactly the micro-batches it had done.

A checkpoint (`checkpoints/step_NNNNNN/`) is the drafter in the public format plus `trainer_state.pt`
(optimizer state and counters, read back with `torch.load(weights_only=True)`: tensors and plain
values only, so a state file from elsewhere cannot run code). With an evaluation hook the drafter is
decoded every `eval_every` steps; the checkpoint with the best tau is kept and named in `best.json`.

Under torchrun / accelerate launch (WORLD_SIZE > 1) micro-batch m goes to rank m % world, each rank
has its own frozen target, and gradients are averaged (DistributedDataParallel, or FSDP with
optim.fsdp=true): world N with grad_accum k trains the drafter that one process with grad_accum N*k
trains. Optimizer state is saved whole and keyed by parameter name, so any of these resumes any other.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file

from ddtree.engine.drafter_kinds import TRAINED_KIND
from ddtree.errors import ConfigError
from ddtree.pipeline.distributed import World
from ddtree.pipeline.tracking import NullRun
from ddtree.train.config import OptimConfig
from ddtree.train.features import Sample
from ddtree.train.objective import block_loss, drafter_hidden, make_batch, selector_loss

STATE = "trainer_state.pt"
BEST = "best.json"


class FeatureSource(Protocol):
    """Sequences dealt into groups (shards), and their samples with context features on request."""

    target_layer_ids: list[int]

    def shard_sizes(self) -> list[int]: ...

    def samples(self, shard: int, idx: list[int]) -> list[Sample]: ...


@dataclass
class FrozenTarget:
    """What the objective needs from the target: its input embeddings and its lm_head."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    lm_head_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, model, device: torch.device | str = "cpu") -> FrozenTarget:
        head = model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return cls(model.get_input_embeddings().weight.detach().to(device),
                   head.weight.detach().to(device), None if bias is None else bias.detach().to(device))


# An evaluation hook: decodes held-out prompts with the drafter at an optimizer step, returns metrics
# with a "tau" entry (the score that picks the best checkpoint).
Evaluator = Callable[[torch.nn.Module, int], dict[str, float]]


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-batches consumed, all processes together
    best_tau: float | None = None
    best_step: int | None = None


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def epoch_microbatches(source: FeatureSource, batch_size: int, epoch: int, seed: int
                       ) -> list[tuple[int, list[int]]]:
    """(shard, sequence indices) of every micro-batch of an epoch, in order: a pure function of (seed, epoch)."""
    rng = random.Random(f"order-{seed}-{epoch}")
    sizes = source.shard_sizes()
    order = list(range(len(sizes)))
    rng.shuffle(order)
    out = []
    for k in order:
        idx = list(range(sizes[k]))
        rng.shuffle(idx)
        out += [(k, idx[i:i + batch_size]) for i in range(0, len(idx), batch_size)]
    return out


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(p for p in ckpt_dir.glob("step_*") if (p / STATE).exists())
    return found[-1] if found else None


def make_optimizer(drafter: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))


def planned_steps(source: FeatureSource, cfg: OptimConfig, world: World) -> tuple[int, int]:
    """(micro-batches per epoch, optimizer steps in all)."""
    per_epoch = len(epoch_microbatches(source, cfg.batch_size, 0, cfg.seed))
    steps_per_epoch = max(1, per_epoch // (cfg.grad_accum * world.world_size))
    return per_epoch, cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))


def read_trainer_state(path: Path, device: torch.device | str = "cpu") -> dict:
    """A checkpoint's trainer state, refusing anything but tensors and plain values (no code runs)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError("out_dir", f"{path} is not a plain state file and was not loaded ({first[:160]})",
                          f"delete {path.parent} to resume from an earlier checkpoint, or pass force=[train]") from None


def resume_weights(ckpt_dir: Path, drafter: torch.nn.Module, device: torch.device
                   ) -> tuple[TrainState, dict | None, Path | None]:
    """The latest checkpoint's counters and optimizer state (None without one); its weights go into `drafter`."""
    path = latest_checkpoint(ckpt_dir)
    state, optimizer = TrainState(), None
    if path is not None:
        saved = read_trainer_state(path / STATE, device)
        drafter.load_state_dict(load_file(path / "model.safetensors", device=str(device)))
        state.step, state.micro, optimizer = int(saved["step"]), int(saved["micro"]), saved["optimizer"]
    best = ckpt_dir / BEST
    if best.exists():
        b = json.loads(best.read_text())
        state.best_tau, state.best_step = b["tau"], b["step"]
    return state, optimizer, path


def resume(ckpt_dir: Path, drafter: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
           ) -> tuple[TrainState, Path | None]:
    """The state of the latest checkpoint, loaded into `drafter` and `opt` (a fresh state when there is none)."""
    state, optimizer, path = resume_weights(ckpt_dir, drafter, device)
    if optimizer is not None:
        load_optimizer_state(drafter, opt, optimizer)
    return state, path


def optimizer_state(drafter: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, whole (FSDP: gathered on every rank; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(drafter, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(drafter: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(drafter, opt, saved, options=StateDictOptions(full_state_dict=True))


def whole_weights(drafter: torch.nn.Module, world: World, cfg: OptimConfig) -> dict[str, torch.Tensor]:
    """The drafter's weights, whole (FSDP: gathered; a collective every rank calls)."""
    if not (world.is_distributed and cfg.fsdp):
        return drafter.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(drafter, opt, state: TrainState, ckpt_dir: Path, keep: int, optimizer: dict | None = None) -> Path:
    """Write step_NNNNNN atomically; keep the newest `keep` checkpoints and the best one.

    `drafter` is a whole (unsharded) drafter; `optimizer`: its optimizer state when `opt` is sharded.
    """
    path = ckpt_dir / f"step_{state.step:06d}"
    tmp = ckpt_dir / f".tmp_step_{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    optimizer = optimizer if optimizer is not None else optimizer_state(drafter, opt)
    torch.save({"optimizer": optimizer, "step": state.step, "micro": state.micro}, tmp / STATE)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    best = f"step_{state.best_step:06d}" if state.best_step is not None else None
    older = sorted(p for p in ckpt_dir.glob("step_*") if p != path and p.name != best)
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    (ckpt_dir / "latest.json").write_text(json.dumps({"step": state.step, "path": path.name}) + "\n")
    return path


def micro_batches(source: FeatureSource, cfg: OptimConfig, start: int, per_epoch: int, world: World
                  ) -> Iterator[tuple[int, list[Sample]]]:
    """(global micro-batch index, samples) of this rank from micro-batch `start` on, epoch after epoch."""
    m = start
    while True:
        epoch, i = divmod(m, per_epoch)
        for k, idx in epoch_microbatches(source, cfg.batch_size, epoch, cfg.seed)[i:]:
            if m % world.world_size == world.rank:
                yield m, source.samples(k, idx)
            m += 1


@dataclass
class LossWindow:
    """Loss statistics since the last log line."""

    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)

    def add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.tokens += int(stats["tokens"])

    def means(self) -> dict[str, float]:
        out = {k: v / max(1, self.count) for k, v in self.sums.items() if k != "tokens"}
        out["label_tokens_per_s"] = self.tokens / max(time.perf_counter() - self.since, 1e-9)
        return out


def distribute(drafter: torch.nn.Module, cfg: OptimConfig, world: World, device: torch.device) -> torch.nn.Module:
    """The module to call: the drafter itself, or its data-parallel wrapper (gradients averaged over ranks).

    optim.fsdp shards the drafter's parameters, gradients and optimizer state over the ranks in place
    (FSDP2, each decoder layer and the rest): for a drafter whose AdamW state does not fit one device.
    """
    if not world.is_distributed:
        return drafter
    if cfg.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world.world_size,))
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(drafter, mesh=mesh)
        return drafter
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


@dataclass
class Training:
    """A training run set up to take steps: the module to call, its optimizer, and rank 0's whole drafter."""

    model: torch.nn.Module  # the drafter, or its DDP wrapper
    opt: torch.optim.Optimizer
    whole: torch.nn.Module  # the drafter itself, or under FSDP a whole copy on rank 0
    state: TrainState
    resumed: Path | None


def prepare(drafter, cfg: OptimConfig, ckpt_dir: Path, world: World, device: torch.device) -> Training:
    """Resume from the latest checkpoint, wrap for data parallelism, and build the optimizer after it."""
    drafter.to(device).train()
    state, saved_optimizer, resumed = resume_weights(ckpt_dir, drafter, device)
    # FSDP shards the drafter in place: rank 0 keeps a whole copy to evaluate and save
    whole = copy.deepcopy(drafter).cpu() if world.is_distributed and cfg.fsdp and world.is_main else drafter
    model = distribute(drafter, cfg, world, device)
    opt = make_optimizer(drafter, cfg)  # after sharding: it steps the parameters FSDP made
    if saved_optimizer is not None:
        load_optimizer_state(drafter, opt, saved_optimizer)
    return Training(model, opt, whole, state, resumed)


def accumulate(drafter, t: Training, target: FrozenTarget, stream, cfg: OptimConfig, device: torch.device,
               window: LossWindow) -> int:
    """Forward and backward of grad_accum micro-batches; the index of the last one."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    for _ in range(cfg.grad_accum):
        m, samples = next(stream)
        batch = make_batch(samples, drafter.block_size, cfg.anchors_per_seq, drafter.mask_token_id,
                           random.Random(f"anchors-{cfg.seed}-{m}")).to(device)
        with autocast:
            hidden = drafter_hidden(drafter, target.embed_weight, batch, call=t.model)
            loss, stats = block_loss(hidden, target.lm_head_weight, batch.labels, drafter.block_size,
                                     cfg.loss_decay, target.lm_head_bias)
            if TRAINED_KIND.selector(drafter) is not None:  # its row's hook (DFlash2): the selector's term too
                sel = cfg.selector
                extra, more = selector_loss(drafter, hidden, target.lm_head_weight, batch, cfg.loss_decay,
                                            target.lm_head_bias, rule=sel.loss, alpha=sel.alpha,
                                            inject_gold=sel.inject_gold, stop_gradient=sel.stop_gradient)
                loss, stats = loss + extra, {**stats, **more}
        (loss / cfg.grad_accum).backward()
        window.add(stats)
    return m


def probe_metrics(drafter, target: FrozenTarget, source: FeatureSource, cfg: OptimConfig,
                  device: torch.device) -> dict[str, float]:
    """A DFlash2 drafter's selector metrics (`objective.selector_metrics`, the block loss's beside them) on a fixed
    probe: the first micro-batch of epoch 0 with anchors of their own seed, the same blocks at every evaluation.
    Empty for a drafter without a selector."""
    if TRAINED_KIND.selector(drafter) is None:
        return {}
    shard, idx = epoch_microbatches(source, cfg.batch_size, 0, cfg.seed)[0]
    batch = make_batch(source.samples(shard, idx), drafter.block_size, cfg.anchors_per_seq, drafter.mask_token_id,
                       random.Random(f"probe-{cfg.seed}")).to(device)
    home, was = next(drafter.parameters()).device, drafter.training
    drafter.to(device).eval()
    with torch.no_grad():
        hidden = drafter_hidden(drafter, target.embed_weight, batch)
        _, stats = block_loss(hidden, target.lm_head_weight, batch.labels, drafter.block_size, cfg.loss_decay,
                              target.lm_head_bias)
        sel = cfg.selector
        _, more = selector_loss(drafter, hidden, target.lm_head_weight, batch, cfg.loss_decay, target.lm_head_bias,
                                rule=sel.loss, inject_gold=sel.inject_gold)
    drafter.to(home).train(was)
    return {k: v for k, v in {**stats, **more}.items() if k not in ("loss", "tokens")}


def train_drafter(drafter, target: FrozenTarget, source: FeatureSource, cfg: OptimConfig, out_dir: Path, *,
                  device: torch.device | str = "cpu", tracker=None, log: Callable[[str], None] = print,
                  evaluate: Evaluator | None = None, eval_every: int | None = None,
                  world: World | None = None) -> dict:
    """Train `drafter` in place; checkpoints under out_dir/checkpoints. Returns a summary."""
    tracker, world, device = tracker or NullRun(), world or World(), torch.device(device)
    if list(source.target_layer_ids) != list(drafter.target_layer_ids):
        raise ValueError(f"features hold target layers {source.target_layer_ids}, the drafter reads "
                         f"{drafter.target_layer_ids}")
    ckpt_dir = out_dir / "checkpoints"
    t = prepare(drafter, cfg, ckpt_dir, world, device)
    state = t.state
    per_epoch, total = planned_steps(source, cfg, world)
    if t.resumed is not None:
        log(f"train: resumed from {t.resumed.name} (step {state.step}/{total})")
    log(f"train: {sum(source.shard_sizes())} sequences, {per_epoch} micro-batches/epoch, {total} steps "
        f"(batch {cfg.batch_size} x accum {cfg.grad_accum} x {world.world_size} proc, "
        f"{cfg.anchors_per_seq} anchors/seq)")

    stream = micro_batches(source, cfg, state.micro, per_epoch, world)
    window, last, last_probe, t_start = LossWindow(), {}, {}, time.perf_counter()
    while state.step < total:
        for g in t.opt.param_groups:
            g["lr"] = lr_at(state.step, total, cfg)
        m = accumulate(drafter, t, target, stream, cfg, device, window)
        state.micro = (m // world.world_size + 1) * world.world_size  # every rank has consumed its share
        gnorm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), cfg.grad_clip)
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        state.step += 1
        if state.step % cfg.log_every == 0 or state.step == total:
            last = {**window.means(), "lr": lr_at(state.step - 1, total, cfg), "grad_norm": float(gnorm)}
            if world.is_main:
                _log_step(last, state.step, total, tracker, log)
            window = LossWindow()
        evaluated = bool(evaluate is not None and eval_every and (state.step % eval_every == 0 or state.step == total))
        if evaluated or state.step % cfg.save_every == 0 or state.step == total:
            optimizer = _gather_whole(drafter, t.opt, t.whole, world, cfg)
            if evaluated and world.is_main:
                _evaluate_step(t.whole, evaluate, state, tracker, ckpt_dir, device, log)
            if (evaluated or state.step == total) and world.is_main:
                probe = probe_metrics(t.whole, target, source, cfg, device)
                if probe:
                    tracker.log_metrics({f"probe/{k}": v for k, v in probe.items()}, step=state.step)
                    log(f"train: step {state.step} probe " + " ".join(f"{k} {v:.3f}" for k, v in probe.items()))
                    last_probe = probe
            if world.is_main:
                save_checkpoint(t.whole, t.opt, state, ckpt_dir, cfg.keep_checkpoints, optimizer)
    if world.is_distributed:
        import torch.distributed as dist

        dist.barrier()
    drafter.eval()
    summary = {"steps": total, "train_s": time.perf_counter() - t_start, **{f"final_{k}": v for k, v in last.items()},
               **{f"probe_{k}": v for k, v in last_probe.items()}}
    if state.best_step is not None:
        summary.update(best_step=state.best_step, best_tau=state.best_tau)
    return summary


def _log_step(last: dict[str, float], step: int, total: int, tracker, log: Callable[[str], None]) -> None:
    tracker.log_metrics({f"train/{k}": v for k, v in last.items()}, step=step)
    selector = (f"selector loss {last['selector_loss']:.4f} acc {last['selector_acc']:.3f} "
                f"(recall {last['unary_recall']:.3f} tf {last['selector_acc_tf']:.3f} vs unary {last['unary_acc']:.3f}, "
                f"path tau {last['path_tau']:.2f} of oracle {last['oracle_tau']:.2f}) ") if (
        "unary_recall" in last) else ""  # a DFlash2 drafter's
    log(f"train: step {step}/{total} loss {last['loss']:.4f} acc {last['acc']:.3f} tau~{last['tau_proxy']:.2f} "
        f"{selector}lr {last['lr']:.2e} {last['label_tokens_per_s']:.0f} label tok/s")


def _gather_whole(drafter, opt, whole, world: World, cfg: OptimConfig) -> dict | None:
    """Under FSDP: the weights into rank 0's whole copy, and the whole optimizer state (collectives)."""
    if not (world.is_distributed and cfg.fsdp):
        return None
    weights, optimizer = whole_weights(drafter, world, cfg), optimizer_state(drafter, opt)
    if world.is_main:
        whole.load_state_dict(weights)
    return optimizer


def _evaluate_step(drafter, evaluate: Evaluator, state: TrainState, tracker, ckpt_dir: Path, device: torch.device,
                   log: Callable[[str], None]) -> None:
    """Decode the held-out set now, log the metrics at this step, and mark this step best when tau rose."""
    home = next(drafter.parameters()).device
    drafter.to(device).eval()
    with torch.no_grad():
        metrics = evaluate(drafter, state.step)
    drafter.to(home).train()
    tracker.log_metrics(metrics, step=state.step)
    tau = metrics["tau"]
    if state.best_tau is None or tau > state.best_tau:
        state.best_tau, state.best_step = tau, state.step
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / BEST).write_text(json.dumps({"step": state.step, "tau": tau,
                                                 "path": f"step_{state.step:06d}"}) + "\n")
        tracker.set_tags({"ddtree.best_step": state.step, "ddtree.best_tau": round(tau, 4)})
    log(f"train: step {state.step} eval tau {tau:.3f} (best {state.best_tau:.3f} at step {state.best_step})")
