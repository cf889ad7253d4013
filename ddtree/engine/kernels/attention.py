"""The attention layer's and the MLP's elementwise tails as one launch each: `ddtree::merge_attention`, `ddtree::silu_mul`.

* `merge_attention(o1, lse1, o2, lse2, gate, heads, dtype)`: a split tree verification's two parts (the prefix's and
  the tree's, `ddtree.engine.attention._split_verify`) merged by log-sum-exp, laid out [B, n, heads, d] in the
  model's dtype, and, for a gated attention (Qwen3.5 / Qwen3-Next), times sigmoid(gate): [B, n, heads * d]. The
  composite is the arithmetic the engine ran before (`merge2`, then `gate_output`): the outputs cast to float32,
  w = sigmoid(lse1 - lse2), o = lerp(o2, o1, w), the cast to the model's dtype, sigmoid of the gate in its dtype,
  the product rounded once. 13 launches on a GPU (casts, sub, sigmoid, lerp, the transposing cast, the gate's copy,
  its sigmoid, the product), one here. The parts are [B, kv heads, g * n, d] with the g query heads of a key/value
  group stacked along the sequence (lse [B, kv heads, g * n]); any strides.
* `silu_mul(gate, up)`: the MLP's `F.silu(gate) * up` (silu rounded to gate's dtype, then the product): 2 launches, 1.

Inside a compiled graph the call sites use the composite (Inductor fuses it), and where autograd records (a drafter
in training: the ops have no backward). Outputs in float64 run the composite on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.engine.kernels import FusedOp, fused, jit_cache

__all__ = ["gate_output", "merge2", "merge_attention", "silu_mul"]

_KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def merge2(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Exact softmax over two parts' keys (no sink): part 1's weight exp(lse1) / (exp(lse1) + exp(lse2)) is
    w = sigmoid(lse1 - lse2), and o = o2 + w (o1 - o2) is one lerp of the float32 outputs (float64 where an o is)."""
    l1 = lse1 if lse1.dtype == torch.float32 else lse1.float()
    l2 = lse2 if lse2.dtype == torch.float32 else lse2.float()
    o1 = o1 if o1.dtype in (torch.float32, torch.float64) else o1.float()
    o2 = o2 if o2.dtype in (torch.float32, torch.float64) else o2.float()
    w = torch.sigmoid((l1 - l2).unsqueeze(-1))
    if o1.dtype != o2.dtype or o1.dtype != w.dtype:
        o1, o2, w = o1.double(), o2.double(), w.double()
    return torch.lerp(o2, o1, w)


def gate_output(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A gated attention's out [B, T, heads, d] * sigmoid(gate [B, T, heads, d]): [B, T, heads * d], on the gate's
    contiguous copy (a CPU's vectorised sigmoid takes a scalar tail on short strided rows, AVX-512: 16-wide heads:
    not bitwise the module's, which flattens the gate first)."""
    g = torch.sigmoid(gate.reshape(*gate.shape[:2], -1))
    g.view(out.shape).mul_(out)  # (out as it is: a strided out multiplied in place, not copied first)
    return g


def _merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                     gate: torch.Tensor | None, heads: int, dtype: torch.dtype) -> torch.Tensor:
    out = merge2(o1, lse1, o2, lse2)
    B, kv, L, D = out.shape
    # [B, n, H, D] contiguous: the model's reshape of it to [B, n, H * D] is then a view, not a second copy
    # (reshape: a view of a contiguous merge; a copy only where parts come as [B, L, kv, D] storage)
    out = out.reshape(B, heads, kv * L // heads, D).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out if gate is None else gate_output(out, gate)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_rows(o1_ptr, l1_ptr, o2_ptr, l2_ptr, g_ptr, out_ptr, n, heads, groups, D,
                   a0, a1, a2, a3, la0, la1, la2, b0, b1, b2, b3, lb0, lb1, lb2, g0, g1, g2, g3,
                   HAS_GATE: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
        # one program per output row (b, t, h) of [B, n, H, D]; head h = kv * groups + j reads stacked row j * n + t
        row = tl.program_id(0).to(tl.int64)
        h = row % heads
        t = (row // heads) % n
        b = row // (heads * n)
        kv = h // groups
        r = (h % groups) * n + t
        cols = tl.arange(0, BLOCK).to(tl.int64)
        mask = cols < D
        x1 = tl.load(o1_ptr + b * a0 + kv * a1 + r * a2 + cols * a3, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(o2_ptr + b * b0 + kv * b1 + r * b2 + cols * b3, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(l1_ptr + b * la0 + kv * la1 + r * la2).to(tl.float32)
        s2 = tl.load(l2_ptr + b * lb0 + kv * lb1 + r * lb2).to(tl.float32)
        w = tl.sigmoid(s1 - s2)
        d = x1 - x2
        # torch's lerp(start=x2, end=x1, w): from the nearer end (fused multiply-adds, as its kernels compile)
        y = tl.where(tl.abs(w) < 0.5, tl.fma(d, w, x2), tl.fma(-d, 1.0 - w, x1))
        if ROUND:  # the cast to the model's dtype
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        if HAS_GATE:
            g = tl.load(g_ptr + b * g0 + t * g1 + h * g2 + cols * g3, mask=mask, other=0.0).to(tl.float32)
            g = tl.sigmoid(g).to(out_ptr.dtype.element_ty).to(tl.float32)  # sigmoid in the gate's dtype
            y = g * y
        tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul_flat(g_ptr, u_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)  # silu in the gate's dtype
        tl.store(out_ptr + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    return merge_rows, silu_mul_flat


def _launch_merge(o1, lse1, o2, lse2, gate, heads, dtype):
    import triton

    if (o1.dtype not in _KERNEL_FLOATS or o2.dtype not in _KERNEL_FLOATS or dtype not in _KERNEL_FLOATS
            or lse1.dtype != torch.float32 or lse2.dtype != torch.float32 or o1.shape != o2.shape
            or (gate is not None and gate.dtype != dtype)):
        return _merge_attention(o1, lse1, o2, lse2, gate, heads, dtype)  # float64 / mixed: the composite's dtypes
    B, kv, L, D = o1.shape
    n = kv * L // heads
    out = torch.empty((B, n, heads * D) if gate is not None else (B, n, heads, D), dtype=dtype, device=o1.device)
    rows = B * n * heads
    if rows and D:
        block = triton.next_power_of_2(D)
        gs = gate.stride() if gate is not None else (0, 0, 0, 0)
        _kernels()[0][(rows,)](o1, lse1, o2, lse2, gate if gate is not None else out, out, n, heads, heads // kv, D,
                               *o1.stride(), *lse1.stride(), *o2.stride(), *lse2.stride(), *gs,
                               HAS_GATE=gate is not None, ROUND=dtype != torch.float32, BLOCK=block,
                               num_warps=1 if block <= 128 else 2 if block <= 512 else 4)
    return out


def _launch_silu_mul(gate, up):
    import triton

    if gate.shape != up.shape or gate.dtype not in _KERNEL_FLOATS or up.dtype not in _KERNEL_FLOATS:
        return _silu_mul(gate, up)  # broadcasting, float64: the composite
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    numel = out.numel()
    if numel:
        block = 1024
        _kernels()[1][(triton.cdiv(numel, block),)](gate.contiguous(), up.contiguous(), out, numel, BLOCK=block,
                                                    num_warps=4)
    return out


_MERGE = FusedOp("merge_attention(Tensor o1, Tensor lse1, Tensor o2, Tensor lse2, Tensor? gate, int heads, "
                 "ScalarType dtype) -> Tensor", _merge_attention, _launch_merge)
_SILU_MUL = FusedOp("silu_mul(Tensor gate, Tensor up) -> Tensor", _silu_mul, _launch_silu_mul)

merge_attention = _MERGE.op


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up: the fused op where `fused`, else the composite."""
    return _SILU_MUL.op(gate, up) if fused(gate, up) else _silu_mul(gate, up)
