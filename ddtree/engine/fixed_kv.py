"""Attention over fixed-capacity key/value buffers: what the compiled round's graphs and the drafters' fixed caches
(ddtree.engine.drafter: the DFlash drafter's `FixedDrafterCache`, the MTP and EAGLE-3 heads' `step`) share, below
all of them. Static addresses, a mask of the rows in use, each KV group's queries stacked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_attention", "grouped_bias", "kv_buffers"]


def grouped_bias(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, groups * n, C] (0 seen, dtype's min hidden) of `grouped_attention` from visible
    [n, C] (bool); [B, 1, groups * n, C] from [B, n, C] (a row per stream: ddtree.engine.batch). Rows follow the
    stacked queries, group member j then node i. In the queries' dtype, C a multiple of 16 (the capacities are): the
    memory-efficient kernel takes it as it is (no padded copy)."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    bias = zero.where(visible, torch.finfo(dtype).min)
    if bias.dim() == 2:
        return (bias.repeat(groups, 1) if groups > 1 else bias)[None, None]
    return (bias.repeat(1, groups, 1) if groups > 1 else bias)[:, None]


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """SDPA with a mask under grouped-query attention, as the eager split path runs it: each KV group's queries
    stacked along the sequence. query [1, H, n, d], keys and values [1, Hkv, C, d], bias `grouped_bias`'s
    [1, 1, (H / Hkv) n, C]; returns [1, H, n, d]. Without `enable_gqa`: on CUDA flash refuses a mask and the
    memory-efficient kernel GQA, so a masked GQA call falls to the math backend (K/V expanded, fp32 scores)."""
    b, h, n, d = query.shape
    hkv = keys.shape[1]
    out = F.scaled_dot_product_attention(query.reshape(b, hkv, h // hkv * n, d), keys, values, attn_mask=bias,
                                         scale=scale)
    return out.view(b, h, n, d)


def kv_buffers(layers: int, like: torch.Tensor, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(keys, values): one [1, Hkv, capacity, d] buffer each per layer, shaped and typed as `like`'s rows; static
    addresses. A buffer of its own per layer: Inductor writes rows into it in place (a view of a stacked buffer was
    copied whole, verify and commit)."""
    def one() -> torch.Tensor:
        t = torch.zeros(*like.shape[:-2], capacity, like.shape[-1], dtype=like.dtype, device=like.device)
        torch._dynamo.mark_static_address(t)
        return t

    return [one() for _ in range(layers)], [one() for _ in range(layers)]
