"""What the engine may read of a target's weights directly: plain tensors, and nothing else.

The engine fuses or concatenates a few of a target's weights (the tree-exact GDN's `[W_a; -W_b]`, a norm's weight in
a fused op, a projection's weight in the lean forward's `F.linear`). A quantized checkpoint replaces them: torchao
keeps `nn.Linear` with a tensor-subclass weight (`Int8Tensor`: `aten.neg` not implemented), optimum-quanto's
`QLinear` subclasses `nn.Linear` and keeps a float `weight` its forward does not use, transformers' FP8 and HQQ
layers hold packed integers and scales. Reading any of those weights computes a wrong answer or fails; calling the
module computes what the quantized model computes. So every direct read asks `plain` / `plain_linear` first and
calls the module where they say no (docs/targets.md): the plain weights of an unquantized target keep their fused
paths (the same ops a round), a quantized one runs its own kernels.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["plain", "plain_linear"]

_PLAIN = (torch.Tensor, nn.Parameter)


def plain(tensor: torch.Tensor | None) -> bool:
    """Whether `tensor` is a plain dense tensor (None counts: no bias), not a quantized subclass."""
    return tensor is None or type(tensor) in _PLAIN


def plain_linear(layer: nn.Module) -> bool:
    """Whether `layer` is exactly `nn.Linear` over plain weights, without accelerate's hooks: its forward is
    `F.linear(x, layer.weight, layer.bias)`, so the engine may read the weights itself."""
    return (type(layer) is nn.Linear and plain(layer.weight) and plain(layer.bias)
            and "_hf_hook" not in layer.__dict__)
