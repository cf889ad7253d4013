"""TF32 on a CPU: float32 matmuls with their inputs rounded to TF32's 10 mantissa bits, as a GPU computes them under
`torch.set_float32_matmul_precision("high")` (products of the rounded inputs, float32 accumulation).

`with TF32():` rounds both inputs of every float32 `mm`, `bmm`, `baddbmm`, `addmm`, `addbmm` and `matmul` that reaches
the dispatcher (a linear layer's `addmm` included; not sdpa's fused kernels, as on a GPU, where the flash and
memory-efficient kernels take no float32); `rounded(t)` is the rounding alone. Tests of what the engine computes
under a user's matmul precision (tests/test_gdn_tree.py).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TF32", "rounded"]

_MATMULS = frozenset({"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "dot", "mv", "addmv"})
_DROP = 0x1FFF  # the 13 low mantissa bits of float32's 23 that TF32 does not keep


def rounded(t: torch.Tensor) -> torch.Tensor:
    """`t` (float32) rounded to the nearest value with 10 mantissa bits (ties away from zero), as TF32 reads it."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~_DROP).view(torch.float32).view(t.shape)


class TF32(TorchDispatchMode):
    """Float32 matmuls with TF32-rounded inputs while active; `calls`: how many it rounded."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            first = 1 if name in ("baddbmm", "addmm", "addbmm", "addmv") else 0  # (the added term is not a product)
            args = list(args)
            for i in (first, first + 1):
                a = args[i]
                if isinstance(a, torch.Tensor) and a.dtype == torch.float32:
                    args[i] = rounded(a)
                    self.calls += 1
        return func(*args, **kwargs)
