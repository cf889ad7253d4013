"""The attention and MLP tails as fused ops (ddtree.engine.kernels.attention): the composite is the arithmetic the
engine ran before, bitwise, and one dispatched op; the Triton kernel (Triton's interpreter without a GPU) computes
the composite's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine import kernels
from ddtree.engine.attention import merge_lse
from ddtree.engine.kernels import FusedOp
from ddtree.engine.kernels import attention as ka
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.triton import interpreter
from tests.test_kernels import _close


def _parts(g: torch.Generator, dtype: torch.dtype, B=2, kv=2, groups=3, n=5, D=24, device="cpu", strided=False):
    """Two parts as a split verification has them: o [B, kv, groups * n, D], lse [B, kv, groups * n] float32 (in
    [B, L, kv] storage, as the CPU's flash kernel returns it)."""
    L = groups * n
    outs = []
    for _ in range(2):
        if strided:  # a CUDA flash kernel's [B, L, kv, D] storage
            o = torch.randn(B, L, kv, D, generator=g).transpose(1, 2)
        else:
            o = torch.randn(B, kv, L, D, generator=g)
        lse = (3 * torch.randn(B, L, kv, generator=g)).transpose(1, 2)
        outs.append((o.to(device, dtype), lse.to(device)))
    return outs


def _gate(g: torch.Generator, dtype, B=2, n=5, H=6, D=24, device="cpu"):
    """The gate as the q projection's chunk leaves it: [B, n, H, D], every other D-block of [B, n, H, 2D]."""
    return torch.chunk(torch.randn(B, n, H, 2 * D, generator=g).to(device, dtype), 2, dim=-1)[1]


def _old_tail(parts, gate, heads, dtype):
    """The engine's arithmetic before the fused op: merge_lse, the transposing cast, the forward's gate (reshape:
    the engine's view where the parts allow one)."""
    out = merge_lse(parts)
    B, kv, L, D = out.shape
    out = out.reshape(B, heads, kv * L // heads, D).transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    if gate is None:
        return out
    gate = torch.sigmoid(gate.reshape(*gate.shape[:2], -1))
    return gate.mul_(out.reshape(gate.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_merge_attention_kernel_matches_composite(dtype, gated):
    g = torch.Generator().manual_seed(0)
    with interpreter() as device:
        for strided in (False, True):
            (o1, l1), (o2, l2) = _parts(g, dtype, n=2, device=device, strided=strided)  # 24 rows of 24
            gate = _gate(g, dtype, n=2, device=device) if gated else None
            got = FusedOp.registry["merge_attention"].run_triton(o1, l1, o2, l2, gate, 6, dtype)
            want = ka._merge_attention(o1, l1, o2, l2, gate, 6, dtype)
            assert got.is_contiguous()
            _close(got, want)


def test_merge_attention_kernel_mixed_dtypes():
    """bf16 part outputs merged into a float32 model dtype; and float64 parts: the composite (float64 merge)."""
    g = torch.Generator().manual_seed(2)
    with interpreter() as device:
        (o1, l1), (o2, l2) = _parts(g, torch.bfloat16, device=device, D=16)
        o2 = o2.float()
        got = FusedOp.registry["merge_attention"].run_triton(o1, l1, o2, l2, None, 6, torch.float32)
        _close(got, ka._merge_attention(o1, l1, o2, l2, None, 6, torch.float32))
        (o1, l1), (o2, l2) = _parts(g, torch.float64, device=device, D=16)
        got = FusedOp.registry["merge_attention"].run_triton(o1, l1, o2, l2, None, 6, torch.float64)
        assert torch.equal(got, ka._merge_attention(o1, l1, o2, l2, None, 6, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_composite(dtype):
    g = torch.Generator().manual_seed(1)
    with interpreter() as device:
        gate = (3 * torch.randn(2, 7, 300, generator=g)).to(device, dtype)
        up = torch.randn(2, 7, 300, generator=g).to(device, dtype)
        _close(FusedOp.registry["silu_mul"].run_triton(gate, up), F.silu(gate) * up)
        view = gate[..., :150]  # strided
        _close(FusedOp.registry["silu_mul"].run_triton(view, up[..., :150]), F.silu(view) * up[..., :150])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_tails_are_the_old_arithmetic_in_one_op(dtype):
    """The CPU implementations are bitwise the ops they replace, and one dispatched op each."""
    g = torch.Generator().manual_seed(3)
    parts = _parts(g, dtype)
    for gate in (None, _gate(g, dtype)):
        (o1, l1), (o2, l2) = parts
        with DispatchCount(stages=False) as c:
            got = ka.merge_attention(o1, l1, o2, l2, gate, 6, dtype)
        assert c.ops["other"] == 1
        assert torch.equal(got, _old_tail(parts, gate, 6, dtype))
    gate, up = torch.randn(3, 40, generator=g).to(dtype), torch.randn(3, 40, generator=g).to(dtype)
    with DispatchCount(stages=False) as c:
        got = ka.silu_mul(gate, up)
    assert c.ops["other"] == 1
    assert torch.equal(got, F.silu(gate) * up)


def test_autograd_and_graphs_take_the_composite():
    """A drafter in training records its MLP's backward: the composite's ops, no fused op (which has none)."""
    g = torch.Generator().manual_seed(4)
    gate = torch.randn(3, 8, generator=g, requires_grad=True)
    up = torch.randn(3, 8, generator=g)
    assert not kernels.fused(gate, up) and kernels.fused(gate.detach(), up)
    with DispatchCount(stages=False) as c:
        out = ka.silu_mul(gate, up)
    assert "silu_mul" not in c.names and out.grad_fn is not None
    out.sum().backward()
    want = torch.autograd.grad(F.silu(gate).mul(up).sum(), gate)[0]
    assert torch.equal(gate.grad, want)
    with torch.no_grad():
        assert ka.fused(gate, up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_split_is_the_split_then_the_gate(dtype):
    """`split_attention(base).gated`: the attention's output gated, bitwise, in one fused op after the two attention
    kernels (with a sink: the composite); None outside a verification (the caller gates the plain output)."""
    import random
    from types import SimpleNamespace

    from ddtree.engine import attention as A
    from ddtree.testing.reference import random_tree

    tree = random_tree(9, 50, random.Random(0))
    g = torch.Generator().manual_seed(5)
    H, hkv, n, kp = 4, 2, len(tree), 20
    q = torch.randn(1, n, H, 16, generator=g).transpose(1, 2).to(dtype)
    k, v = (torch.randn(1, hkv, kp + n, 16, generator=g).to(dtype) for _ in range(2))
    gate = _gate(g, dtype, B=1, n=n, H=H, D=16)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=H // hkv)
    fn = A.split_attention("sdpa")
    assert fn.gated(module, q, gate, k, v, None, scaling=0.25) is None
    for sink in (None, torch.randn(H, generator=g)):
        with A.tree_verification(tree, kp):
            out, _ = fn(module, q, k, v, None, scaling=0.25, s_aux=sink)
            with DispatchCount(stages=False) as c:
                got = fn.gated(module, q, gate, k, v, None, scaling=0.25, s_aux=sink)
        assert torch.equal(got, ka.gate_output(out, gate))
        assert (c.names["merge_attention"] == 1) == (sink is None)
