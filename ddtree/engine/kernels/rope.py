"""A query's or key's per-head norm and its rotary embedding as one launch: `ddtree::norm_rope`.

Qwen3 / Qwen3.5 / Qwen3-Next attention normalises each head of q and k (an RMSNorm over the head, `kernels.norm`'s
arithmetic, centred or Llama-style) and then rotates it. The lean forward's rotation (`forward.RopeTables`) is
x * cos' + x[..., perm] * sin' over the whole head, each product and the sum rounded to x's dtype. The composite
here is exactly those ops (the norm, the two products, the sum: 5 launches on a GPU with the norm fused, more
without); the Triton kernel computes each output element from the row's float32 norm the same way, one launch.

x [B, T, heads, d] (the projection's layout: any strides with unit last stride), cos' and sin' [B, T, 1, d] (the
tables' row layout, `RopeTables.row_tables`), perm [d] long; returns [B, T, heads, d] in x's dtype.
"""

from __future__ import annotations

import torch

from ddtree.engine.kernels import FusedOp, jit_cache
from ddtree.engine.kernels.norm import _norm

__all__ = ["norm_rope"]

_KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool, cos: torch.Tensor,
               sin: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    n = _norm(x, weight, eps, centered)
    return n * cos + n.index_select(-1, perm) * sin


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_rope_rows(x_ptr, w_ptr, c_ptr, s_ptr, p_ptr, out_ptr, T, H, D, sx0, sx1, sx2, sc0, sc1, ss0, ss1, eps,
                       CENTERED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # (b, t, h) of [B, T, H, d]
        h = row % H
        t = (row // H) % T
        b = row // (H * T)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        perm = tl.load(p_ptr + cols, mask=mask, other=0)
        base = x_ptr + b * sx0 + t * sx1 + h * sx2
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + perm, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + perm, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if CENTERED:  # kernels.norm's arithmetic, rounded to the norm's dtype
            n = (x * rstd * w).to(dt).to(tl.float32)
            npm = (xp * rstd * wp).to(dt).to(tl.float32)
        else:
            n = ((x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(dt).to(tl.float32)
            npm = ((xp * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * wp).to(dt).to(tl.float32)
        c = tl.load(c_ptr + b * sc0 + t * sc1 + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + b * ss0 + t * ss1 + cols, mask=mask, other=0.0).to(tl.float32)
        y = (n * c).to(dt).to(tl.float32) + (npm * s).to(dt).to(tl.float32)  # each product rounded, then the sum
        tl.store(out_ptr + row * D + cols, y.to(dt), mask=mask)

    return norm_rope_rows


def _launch(x, weight, eps, centered, cos, sin, perm):
    import triton

    out_dtype = x.dtype if centered else torch.promote_types(weight.dtype, x.dtype)
    B, T, H, D = x.shape
    if (x.dim() != 4 or x.stride(-1) != 1 or out_dtype not in _KERNEL_FLOATS or cos.dtype != out_dtype
            or sin.dtype != out_dtype or cos.shape != (B, T, 1, D) or sin.shape != (B, T, 1, D)
            or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        return _norm_rope(x, weight, eps, centered, cos, sin, perm)  # other layouts and dtypes: the composite
    out = torch.empty((B, T, H, D), dtype=out_dtype, device=x.device)
    rows = B * T * H
    if rows and D:
        block = triton.next_power_of_2(D)
        _kernels()[(rows,)](x, weight.contiguous(), cos, sin, perm.contiguous(), out, T, H, D, x.stride(0),
                            x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                            eps, CENTERED=centered, BLOCK=block, num_warps=1 if block <= 128 else 2)
    return out


_NORM_ROPE = FusedOp("norm_rope(Tensor x, Tensor weight, float eps, bool centered, Tensor cos, Tensor sin, "
                     "Tensor perm) -> Tensor", _norm_rope, _launch)

norm_rope = _NORM_ROPE.op
