"""A tensor-parallel target (transformers' `tp_plan`, torch DTensors) as the lean forward runs it: its own shards.

`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` shards each projection the plan names over
the ranks of a tensor-parallel group and replaces the module's forward by one that moves DTensors around it. The
lean forward does not call those modules: it reads each rank's shard once and computes what transformers' inference
path computes, with the same collective, without the DTensor wrapping:

* `colwise` (q, k, v, gate, up): `F.linear(x, W_local, b_local)`: this rank's heads / columns, no collective;
* `rowwise` (o, down): `F.linear(x_local, W_local)`, one all-reduce (sum) over the group, then the bias;
* `colwise_gather_output` (the head, the Gated DeltaNet projections): `F.linear(x, W_local, b_local)`, one
  all-gather over the group, concatenated along the last dimension (equal shards only; else the module's own); the
  receive buffers are kept from one call to the next while the shape holds (a round's shape repeats).

The sums and gathers are transformers' own (`dist.all_reduce` / the DTensor redistribute to Replicate), so a sharded
layer is bitwise the module's; every rank of a group gets the same bytes back from a collective, so the ranks'
logits, and their greedy or seeded sampled tokens, agree. A module whose style or placement is not one of those
runs its own (transformers') forward: `paths` says which.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["COLLECTIVE_STYLES", "embedding_rows", "gathered_linear", "group_of", "is_sharded", "linear_op", "paths", "sharded_linear",
           "styles", "whole_weight"]

# the collectives one call of each style pays
COLLECTIVE_STYLES = {"rowwise": "all_reduce", "colwise_gather_output": "all_gather", "embedding_rowwise": "all_reduce"}


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was loaded tensor-parallel over more than one rank."""
    return (getattr(model, "_tp_size", None) or 1) > 1 and bool(getattr(model, "tp_plan", None))


def styles(model: nn.Module) -> dict[int, str]:
    """{id(module): its tp_plan style} for every module the model's plan names (empty for a model not sharded)."""
    if not is_sharded(model):
        return {}
    plan = dict(model.tp_plan)
    out: dict[int, str] = {}
    for name, module in model.named_modules():
        style = plan.get(re.sub(r"\.\d+(\.|$)", r".*\1", name))
        if style is not None:
            out[id(module)] = style
    return out


def group_of(tensor: Any):
    """The process group of a DTensor on a one-dimensional mesh (the tensor-parallel group), else None."""
    mesh = getattr(tensor, "device_mesh", None)
    return mesh.get_group() if mesh is not None and mesh.ndim == 1 else None


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, _dtensor()) else tensor


def linear_op(module: nn.Module, style: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """fn(x) computing `module(x)` of a sharded nn.Linear on this rank's shard plus the style's one collective
    (module docstring); None where the module is not such a layer (its own forward then runs)."""
    from torch.distributed.tensor import Replicate, Shard

    DTensor = _dtensor()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module) is not nn.Linear or not isinstance(weight, DTensor) or "_hf_hook" in module.__dict__:
        return None
    group = group_of(weight)
    if group is None:
        return None
    placement = weight.placements[0]
    local_w, local_b = _local(weight), _local(bias)
    import torch.distributed as dist

    if style == "colwise" and placement == Shard(0):
        return lambda x: F.linear(x, local_w, local_b)
    if style == "rowwise" and placement in (Shard(1), Shard(-1)) and (bias is None or (
            isinstance(bias, DTensor) and bias.placements[0] == Replicate())):
        def rowwise(x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, local_w)
            dist.all_reduce(out, group=group)
            return out if local_b is None else out + local_b
        return rowwise
    size = dist.get_world_size(group)
    if style == "colwise_gather_output" and placement == Shard(0) and weight.shape[0] % size == 0:
        parts: list[torch.Tensor] = []  # the receive buffers, kept while the shape holds: no allocation a call

        def gathered(x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, local_w, local_b)
            if not parts or parts[0].shape != out.shape or parts[0].dtype != out.dtype:
                parts[:] = [torch.empty_like(out) for _ in range(size)]
            dist.all_gather(parts, out, group=group)
            return torch.cat(parts, dim=-1)
        return gathered
    return None


def gathered_linear(module: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A column-sharded nn.Linear whose caller needs its whole output (a Gated DeltaNet projection under
    transformers' plan): this rank's shard and one all-gather; None where `module` is not sharded."""
    return None if module is None else linear_op(module, "colwise_gather_output")


def sharded_linear(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear whose weight is a DTensor (sharded by a tp_plan)."""
    return type(module) is nn.Linear and isinstance(getattr(module, "weight", None), _dtensor())


def whole_weight(module: nn.Module) -> torch.Tensor | None:
    """The whole weight of a sharded nn.Linear, gathered once (a collective every rank of the group makes, in the
    same order: the engine builds its constants layer by layer on each); None where `module` is not one."""
    return module.weight.full_tensor() if sharded_linear(module) else None


def embedding_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`: the rows of an input embedding matrix (a drafter's block, read as the public code
    reads it). A vocabulary-sharded DTensor (transformers' `embedding_rowwise`, Shard(0) over the group): this rank's
    rows, zeros for the ids another rank holds, one all-reduce (sum): the same bytes on every rank."""
    if not isinstance(weight, _dtensor()):
        return F.embedding(ids, weight)
    from torch.distributed.tensor import Shard

    group, local = group_of(weight), weight.to_local()
    if group is None or weight.placements[0] != Shard(0):
        return F.embedding(ids, weight.full_tensor() if group is not None else local)
    import torch.distributed as dist

    start = dist.get_rank(group) * -(-weight.shape[0] // dist.get_world_size(group))  # torch.chunk's split
    inside = (ids >= start) & (ids < start + local.shape[0])
    rows = F.embedding((ids - start).clamp(0, max(local.shape[0] - 1, 0)), local)
    rows = rows.masked_fill(~inside.unsqueeze(-1), 0)
    dist.all_reduce(rows, group=group)
    return rows


def paths(model: nn.Module, lean: Any) -> dict[str, Any]:
    """What the engine runs sharded on a tensor-parallel `model` whose lean forward is `lean`
    (`ddtree.engine.forward.lean_forward_for(model)`, None where the model call runs), and what falls back to
    transformers' own forward, with why: the run's record (summary.json `tensor_parallel`) and the tests' evidence."""
    kinds = styles(model)
    layers = [] if lean is None else lean.lean_layers
    sharded = [m for m in model.modules() if id(m) in kinds and linear_op(m, kinds[id(m)]) is not None]
    own = sorted({kinds[id(m)] for m in model.modules() if id(m) in kinds and isinstance(m, nn.Linear)
                  and linear_op(m, kinds[id(m)]) is None})
    notes = []
    if lean is None:
        notes.append("lean forward: off for this model (the model call runs)")
    elif not all(layers):
        notes.append(f"lean layers: {sum(map(bool, layers))} of {len(layers)} (the others: their module forward)")
    if own:
        notes.append(f"projections run by transformers' forward: {', '.join(own)}")
    if any(kinds.get(id(m)) == "embedding_rowwise" for m in model.modules()):
        notes.append("embeddings: transformers' vocabulary-sharded lookup (1 all-reduce)")
    linear_layers = [t == "linear_attention" for t in (getattr(model.config.get_text_config(), "layer_types", None)
                                                      or [])]
    if any(linear_layers):
        notes.append("Gated DeltaNet: whole on every rank (transformers' plan gathers its projections' outputs: "
                     "3 all-gathers a layer, [W_a; -W_b] gathered once), its state whole per rank")
    return {"lean_layers": sum(map(bool, layers)), "layers": len(layers), "sharded_projections": len(sharded), "notes": notes}
