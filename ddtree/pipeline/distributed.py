"""Scale out inside one job: data-parallel ranks (torchrun, accelerate launch) and a target split over devices.

Data parallel (`torchrun --nproc_per_node=N -m ddtree.run ...`, `accelerate launch -m ddtree.run ...`):
the launcher sets RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE). Every rank composes the same
config, validates it and loads the same prompt list; rank 0 decides the job dir and whether the job is
skipped (already finished) and broadcasts both; rank r generates the prompts i with i % world == r, on
cuda:LOCAL_RANK (or the CPU), appending to samples.rank{r}.jsonl; rank 0 gathers every rank's records
(a collective: no shared file system needed), writes samples.jsonl in prompt order and summary.json,
and owns the one MLflow run. Other ranks never touch MLflow.

Device map (`model.device_map=auto`, or a {module: device} dict): the target is placed by accelerate,
each layer on its device. Inputs go to the execution device of the input embeddings; cache tensors
stay where their layer computed them; the engine moves commit indices to each cache layer's device.

The engine does not import this module; ddtree.pipeline.job does.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from ddtree.errors import ConfigError

T = TypeVar("T")

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
TIMEOUT_ENV = "DDTREE_DIST_TIMEOUT_MIN"  # how long a rank waits for the others (default 180 minutes)
# Hydra settings a rank > 0 replaces: its Hydra output goes to a scratch dir, rank 0's job dir is the job's
_RANK_SCRATCH_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.output_subdir")


# ---------------------------------------------------------------- ranks


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a data-parallel job (rank 0 of 1 when launched alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(key, f"environment variable is '{raw}', not an integer",
                          "launch with torchrun or accelerate launch, or unset it") from None


def _export_submitit_ranks() -> None:
    """In a submitit job of several tasks (hydra.launcher.tasks_per_node or nodes > 1) every task runs the
    Hydra job: give them the torch.distributed variables torchrun would have set, from the job environment."""
    if "WORLD_SIZE" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    try:
        from submitit import JobEnvironment
        from submitit.helpers import TorchDistributedEnvironment

        if JobEnvironment().num_tasks <= 1:
            return
    except Exception:  # submitit missing, or this process is not a submitit task
        return
    # GPUs stay visible: each rank picks cuda:LOCAL_RANK itself
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    """The rank layout torchrun / accelerate launch (torch elastic) put in the environment, or, in a
    submitit job of several tasks, the one its job environment describes."""
    if env is None:
        _export_submitit_ranks()
        env = os.environ
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank if world_size > 1 else 0)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
    if world_size < 1 or not 0 <= rank < world_size or not 0 <= local_rank < max(local_world, 1):
        raise ConfigError("RANK", f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank} are inconsistent",
                          "launch with torchrun or accelerate launch, which set them")
    return World(rank, world_size, local_rank, max(local_world, 1))


def rank_device(device: str, world: World, device_map: Any = None) -> str:
    """The device of this rank: an unindexed `cuda` becomes cuda:LOCAL_RANK when there are several ranks
    (with a device map: the first GPU of this rank's slice, see rank_max_memory)."""
    if not world.is_distributed or device != "cuda":
        return device
    import torch

    count = max(torch.cuda.device_count(), 1)
    if device_map is not None:
        return f"cuda:{world.local_rank * max(count // world.local_world_size, 1) % count}"
    # a scheduler that binds one GPU per task (SLURM --gpus-per-task) leaves each rank a single cuda:0
    return f"cuda:{world.local_rank % count}"


def init(world: World, device: str) -> None:
    """Join the job's process group (gloo on CPU; NCCL for CUDA tensors and gloo for objects on GPUs). Idempotent."""
    if not world.is_distributed:
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        backend = "cpu:gloo,cuda:nccl"  # object collectives (all we send) go through gloo
    else:
        backend = "gloo"
    minutes = float(os.environ.get(TIMEOUT_ENV) or 180)
    # ranks wait for the slowest one at the gather: the default 30 minutes is short for a long shard
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size,
                            timeout=timedelta(minutes=minutes))
    atexit.register(_destroy)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(obj: T, world: World) -> T:
    """Rank 0's `obj` on every rank."""
    if not world.is_distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, world: World) -> list[Any] | None:
    """Every rank's `obj` (in rank order) on rank 0; None on the other ranks."""
    if not world.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * world.world_size if world.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def shard(items: Sequence[T], world: World) -> list[T]:
    """This rank's share: item i goes to rank i % world_size (deterministic, balanced to within one)."""
    return list(items[world.rank::world.world_size])


def rank_samples_name(rank: int) -> str:
    return f"samples.rank{rank}.jsonl"


def merge_in_order(per_rank: Sequence[Sequence[dict[str, Any]]], prompt_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Records of every rank in prompt order; a prompt's own records keep their order (stable sort)."""
    order = {pid: i for i, pid in enumerate(prompt_ids)}
    merged = [r for records in per_rank for r in records]
    unknown = {r["id"] for r in merged} - set(order)
    if unknown:
        raise ValueError(f"records for prompts not in this job: {sorted(unknown)[:5]}")
    return sorted(merged, key=lambda r: order[r["id"]])


def hydra_argv_for_rank(argv: list[str], world: World) -> list[str]:
    """Command-line overrides for this rank: ranks > 0 send Hydra's own output to a scratch dir.

    Each rank composes its own config, and `${now:...}` in the job dir may differ by a second
    between ranks; rank 0's job dir (broadcast in run_job) is the job's, the others' is thrown away.
    """
    if not world.is_distributed or world.is_main:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"ddtree-rank{world.rank}-")
    atexit.register(shutil.rmtree, scratch, True)
    keep = [a for a in argv if a.split("=", 1)[0].lstrip("+~") not in _RANK_SCRATCH_KEYS]
    ours = [f"hydra.run.dir={scratch}/run", f"hydra.sweep.dir={scratch}/sweep", "hydra.output_subdir=null"]
    # next to the other overrides: Hydra's argparse refuses overrides split by a flag (`a=1 -m b=2`)
    at = max((i + 1 for i, a in enumerate(keep) if "=" in a and not a.startswith("-")), default=len(keep))
    return keep[:at] + ours + keep[at:]


# ---------------------------------------------------------------- placement over devices


def check_device_map(device_map: Any) -> None:
    """model.device_map: null, a strategy name, or {module name: device}. Raises ConfigError."""
    if device_map is None:
        return
    fix = "use model.device_map=auto (or balanced, sequential), or a {module: device} mapping"
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ConfigError("model.device_map", f"unknown strategy '{device_map}'", fix)
        return
    if not isinstance(device_map, Mapping) or not device_map:
        raise ConfigError("model.device_map", f"must be a strategy name or a mapping, got {device_map!r}", fix)
    gpus: dict[str, int] = {}
    for name, dev in device_map.items():
        if isinstance(dev, int) and not isinstance(dev, bool) and dev >= 0:
            gpus[name] = dev
        elif isinstance(dev, str) and dev.startswith("cuda:") and dev[5:].isdigit():
            gpus[name] = int(dev[5:])
        elif not (isinstance(dev, str) and dev in ("cpu", "disk", "mps")):
            raise ConfigError(f"model.device_map.{name}", f"'{dev}' is not a device",
                              "use a GPU index (0, 1, ...), cuda:N, cpu or disk")
    if gpus:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name, idx = max(gpus.items(), key=lambda kv: kv[1])
        if idx >= count:
            raise ConfigError(f"model.device_map.{name}", f"GPU {idx} does not exist ({count} GPU(s) here)",
                              "map modules to the GPUs this machine has, or to cpu")


def rank_max_memory(world: World) -> dict[Any, int] | None:
    """With several ranks on a node and a device map: this rank's own slice of the node's GPUs.

    LOCAL_WORLD_SIZE ranks share the visible GPUs in contiguous slices (8 GPUs, 2 ranks: 0-3, 4-7).
    None when there is a single rank (accelerate then uses every visible device) or no GPU.
    """
    if not world.is_distributed:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    per = n // world.local_world_size
    if per < 1:
        raise ConfigError("model.device_map", f"{world.local_world_size} ranks per node but only {n} GPU(s): "
                          "each rank needs its own GPUs for a device map",
                          "launch fewer processes per node (--nproc_per_node), or drop model.device_map")
    first = world.local_rank * per
    # get_device_properties does not create a CUDA context on the GPUs of other ranks
    return {i: int(torch.cuda.get_device_properties(i).total_memory * 0.9) for i in range(first, first + per)}


def dispatch(model, device_map: Any, max_memory: dict[Any, int] | None = None):
    """Place a model built in code (tiny models) with accelerate, as from_pretrained(device_map=...) does.

    Hooks are attached even when every entry is the same device, so the dispatched code path runs
    (and is tested) on a CPU-only machine too.
    """
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted(getattr(model, "_no_split_modules", None) or [])
    if isinstance(device_map, str):
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    dispatch_model(model, device_map=dict(device_map), force_hooks=True)
    return model


def _hook_device(module) -> Any:
    hooks = [getattr(module, "_hf_hook", None)]
    while hooks:
        h = hooks.pop()
        if h is None:
            continue
        hooks.extend(getattr(h, "hooks", ()))  # a SequentialHook
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return dev
    return None


def input_device(model):
    """Where a (possibly dispatched) model takes its input ids: the execution device of its embeddings.

    The embedding's own hook, else the hook of the nearest enclosing module that has one, else the
    embedding weight's device (a model on one device).
    """
    import torch

    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), None)
    if name is not None:
        parts = name.split(".")
        for i in range(len(parts), -1, -1):
            dev = _hook_device(model.get_submodule(".".join(parts[:i])))
            if dev is not None:
                return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    w = emb.weight
    return w.device if w.device.type != "meta" else torch.device("cpu")


def placement(model) -> dict[str, Any] | None:
    """{'devices': [...], 'device_map': {...}} of a dispatched model, for the summary; None otherwise."""
    dmap = getattr(model, "hf_device_map", None)
    if not dmap:
        return None
    devices = sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in dmap.values()})
    return {"devices": devices, "device_map": {k: (f"cuda:{v}" if isinstance(v, int) else str(v))
                                               for k, v in dmap.items()}}


# ---------------------------------------------------------------- tensor parallel

TP_PLANS = ("auto",)  # transformers' own plan of the model's family (its config's base_model_tp_plan)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among `world = size x groups` ranks: each group of `size` contiguous ranks (one node's GPUs
    where it fits) shards one copy of the target and decodes the same prompts; the groups split the prompts as
    data-parallel ranks do."""

    size: int  # ranks of one tensor-parallel group
    group: int  # this rank's group: its data-parallel rank
    rank: int  # this rank within its group
    groups: int  # tensor-parallel groups: the data-parallel world

    @property
    def data_world(self) -> World:
        """The data-parallel view: one 'rank' per group (prompt i goes to group i mod groups)."""
        return World(self.group, self.groups, 0, 1)


def tensor_parallel(model_cfg: Any, world: World) -> TensorParallel | None:
    """The tensor-parallel layout of `model_cfg` (model.tp_plan, model.tp_size) over `world`; None without a plan.
    Assumes check_tensor_parallel passed."""
    if getattr(model_cfg, "tp_plan", None) is None:
        return None
    size = model_cfg.tp_size or world.world_size
    return TensorParallel(size, world.rank // size, world.rank % size, world.world_size // size)


def data_world(model_cfg: Any, world: World) -> World:
    """The ranks prompts are split over: the world, or its tensor-parallel groups."""
    tp = tensor_parallel(model_cfg, world)
    return world if tp is None else tp.data_world


def _divisors(n: int, of: int) -> list[int]:
    return [d for d in range(1, of + 1) if of % d == 0 and n % d == 0]


def check_tensor_parallel(model_cfg: Any, world: World, config: Mapping[str, Any] | None = None) -> None:
    """model.tp_plan / model.tp_size against the launch and the target's config (when on disk), before loading:
    one ConfigError naming the setting and the fix."""
    plan, size = model_cfg.tp_plan, model_cfg.tp_size
    if plan is None:
        if size is not None:
            raise ConfigError("model.tp_size", f"is {size} but model.tp_plan is null",
                              "add model.tp_plan=auto, or drop model.tp_size")
        return
    if plan not in TP_PLANS:
        raise ConfigError("model.tp_plan", f"unknown plan '{plan}'",
                          "use model.tp_plan=auto (the plan transformers ships with the model's family), or null")
    if model_cfg.device_map is not None:
        raise ConfigError("model.tp_plan", "and model.device_map both split the target over GPUs",
                          "keep one: model.tp_plan=auto (every GPU works on every layer) or model.device_map "
                          "(the layers run one GPU after another)")
    if model_cfg.quantization is not None:
        raise ConfigError("model.tp_plan", "a quantized target is not sharded by ddtree's tensor parallel",
                          "drop model.quantization, or model.tp_plan")
    if not world.is_distributed:
        raise ConfigError("model.tp_plan", "tensor parallel shards the target over several processes; this is one",
                          "launch with torchrun --nproc_per_node=N -m ddtree.run ..., or drop model.tp_plan")
    size = world.world_size if size is None else size
    if size < 1 or world.world_size % size:
        raise ConfigError("model.tp_size", f"{size} does not divide the job's {world.world_size} ranks",
                          f"use one of {_divisors(world.world_size, world.world_size)} (ranks = tp_size x "
                          "data-parallel groups)")
    if not config:
        return
    from ddtree.engine.families import has_tp_plan

    mtype = config.get("text_model_type") or config.get("model_type")
    if mtype and not has_tp_plan(str(mtype)):
        raise ConfigError("model.tp_plan", f"transformers has no tensor-parallel plan for the '{mtype}' family",
                          "drop model.tp_plan: use data-parallel ranks or model.device_map (docs/scale.md)")
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    linear = [(config.get(k), f"Gated DeltaNet {w} heads") for k, w in (("linear_num_key_heads", "key"),
                                                                         ("linear_num_value_heads", "value"))]
    for n, what in ((heads, "attention heads"), (kv, "key/value heads"), *linear):
        if isinstance(n, int) and n % size:
            sizes = [d for d in _divisors(n, world.world_size) if d > 1]
            raise ConfigError("model.tp_size", f"{size} ranks cannot share the target's {n} {what}: each rank "
                              "holds whole heads", f"use model.tp_size in {sizes}" if sizes else
                              "drop model.tp_plan: data-parallel ranks (each the whole target) or model.device_map")


class _GroupMesh:
    """transformers builds its tensor-parallel mesh over the whole world (tp x fsdp x pp = WORLD_SIZE); a job of
    several tensor-parallel groups needs it over this rank's group. While loading, transformers' mesh builder is
    replaced by one that lays the same meshes over (groups x size), the groups on transformers' `dp_replicate` axis,
    which only FSDP reads (off here: dp_replicate_size stays 1 in the DistributedConfig)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.module = self.original = None

    def build(self, distributed_config):
        import torch
        from transformers.distributed.utils import TransformersDeviceMesh, _bind_local_device

        device_type = torch._C._get_accelerator().type
        device = _bind_local_device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
        groups, size = self.tp.groups, self.tp.size
        dense = torch.distributed.init_device_mesh(device_type, (1, groups, 1, size),
                                                   mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        expert = torch.distributed.init_device_mesh(device_type, (1, groups, size, 1),
                                                    mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        return device, TransformersDeviceMesh(dense, expert)

    def __enter__(self):
        if self.tp.groups > 1:
            import transformers.distributed.mixin as mixin

            self.module, self.original = mixin, mixin.initialize_distributed_mesh
            mixin.initialize_distributed_mesh = self.build
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.initialize_distributed_mesh = self.original
        return False


def tp_load_kwargs(tp: TensorParallel) -> dict[str, Any]:
    """from_pretrained's keywords for a target sharded over this rank's tensor-parallel group."""
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=tp.size, tp_plan="auto")}


def tp_loading(tp: TensorParallel) -> _GroupMesh:
    """The context a tensor-parallel from_pretrained runs in (see _GroupMesh)."""
    return _GroupMesh(tp)


def first_of_each_group(per_rank: Sequence[Sequence[dict[str, Any]]], size: int) -> list[Sequence[dict[str, Any]]]:
    """The records of each tensor-parallel group's first rank. Every rank of a group decoded the same prompts; their
    tokens must agree (the same gathered logits and the same seeded generator on each: docs/scale.md), else the group
    computed different things and its result is refused."""
    out = []
    for first in range(0, len(per_rank), size):
        mine = [(r["id"], r["turn"], r["role"], r["output_ids"]) for r in per_rank[first]]
        for other in range(first + 1, first + size):
            theirs = [(r["id"], r["turn"], r["role"], r["output_ids"]) for r in per_rank[other]]
            if theirs != mine:
                raise RuntimeError(f"tensor-parallel ranks {first} and {other} decoded different tokens: the ranks of "
                                   "a group must compute the same logits (report it with the job's config)")
        out.append(per_rank[first])
    return out
