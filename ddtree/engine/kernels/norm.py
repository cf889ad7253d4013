"""RMSNorm as one launch: `ddtree::rms_norm` and `ddtree::add_rms_norm` (the residual add folded in).

Two arithmetics, the ones `ddtree.engine.forward.lean_norm` reproduces (bitwise, on the CPU):
* centered (Qwen3.5 / Qwen3-Next: (1 + w)): `F.rms_norm(x.float(), scale, eps).type_as(x)`, scale = 1 + w in
  float32: normalised and scaled in float32, rounded once. Three launches on CUDA (torch's fused kernel takes a
  weight of the input's dtype only), one here.
* scaled (Llama / Qwen3: w): `w * F.rms_norm(x, None, eps)`: normalised in float32, rounded to x's dtype, then the
  weight's product in the result dtype. Two launches on CUDA, one here.
`add_rms_norm(x, residual, ...)` returns (norm(residual + x), residual + x), the sum rounded to x's dtype first, as
`residual + x` is: the decoder layer's residual add and the next norm, one launch for three or four.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.engine.kernels import FusedOp, jit_cache

__all__ = ["add_rms_norm", "rms_norm"]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool) -> torch.Tensor:
    if centered:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).type_as(x)
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    total = residual + x
    return _norm(total, weight, eps, centered), total


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rows(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_cols, sx, sr, so, ss, eps,
                      HAS_RES: tl.constexpr, CENTERED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded as residual + x is
            tl.store(sum_ptr + row * ss + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if CENTERED:
            y = xf * rstd * w
        else:  # rounded to x's dtype, then the weight's product
            y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_rows


def _row_stride(x: torch.Tensor) -> int | None:
    """The stride between x's rows (its last dim unit-strided, the leading dims collapsing into one), else None:
    read from the tensor's metadata, no dispatch (a view per call is host work a launch-bound GPU pays)."""
    shape, stride = x.shape, x.stride()
    if stride[-1] != 1:
        return None
    if x.dim() < 2:
        return shape[-1]
    for i in range(x.dim() - 2):
        if shape[i] != 1 and stride[i] != stride[i + 1] * shape[i + 1]:
            return None
    return stride[-2]


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, centered: bool):
    import triton

    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        return _add_norm(x, residual, weight, eps, centered)  # (broadcasting: the composite's)
    n = x.shape[-1]
    weight = weight.contiguous()
    sx = _row_stride(x)
    if sx is None:
        x = x.contiguous()
        sx = n
    sr = sx
    if residual is not None:
        sr = _row_stride(residual)
        if sr is None:
            residual = residual.contiguous()
            sr = n
    out_dtype = x.dtype if centered else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = out if residual is None else torch.empty(
        x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    rows = x.numel() // n if n else 0
    block = triton.next_power_of_2(n)
    if rows:
        _kernels()[(rows,)](x, x if residual is None else residual, weight, out, total, n, sx, sr, n, n, eps,
                            HAS_RES=residual is not None, CENTERED=centered, BLOCK=block,
                            num_warps=4 if block <= 2048 else 8)
    return out if residual is None else (out, total)


_RMS = FusedOp("rms_norm(Tensor x, Tensor weight, float eps, bool centered) -> Tensor", _norm,
               lambda x, weight, eps, centered: _launch(x, None, weight, eps, centered))
_ADD_RMS = FusedOp("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool centered) -> (Tensor, Tensor)",
                   _add_norm, _launch)

rms_norm = _RMS.op
add_rms_norm = _ADD_RMS.op
