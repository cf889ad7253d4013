"""ddtree::norm_rope: the composite is the lean forward's per-head norm then RopeTables (bitwise), and its Triton
kernel (interpreted without a GPU) computes the composite's values."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.forward import RopeTables, _rope_tables
from ddtree.engine.kernels import FusedOp
from ddtree.engine.kernels import norm as kn
from ddtree.engine.kernels.rope import norm_rope
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.triton import interpreter

pytestmark = pytest.mark.gpu  # on a GPU the kernel runs for real; here, interpreted


def _inputs(dtype, centered, rotary=16, d=32, device="cpu"):
    g = torch.Generator().manual_seed(3)
    proj = torch.randn(2, 5, 3, 2 * d, generator=g)  # a gated q projection: the query is its first half (strided)
    x = proj.to(device, dtype)[..., :d]
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device) if centered else torch.randn(d, generator=g).to(device, dtype)
    pos = torch.arange(7, 12)[None].expand(2, 5).float()
    freqs = pos[..., None] * (1.0 / 1e4 ** (torch.arange(0, rotary, 2).float() / rotary))
    emb = torch.cat([freqs, freqs], -1)
    tables = _rope_tables(emb.cos().to(device, dtype), emb.sin().to(device, dtype), d)
    rows = (tables[0].transpose(1, 2), tables[1].transpose(1, 2), tables[2])
    return x, w, tables, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False])
def test_composite_is_the_norm_then_rope_tables(dtype, centered):
    x, w, tables, rows = _inputs(dtype, centered, rotary=16)  # partial rotary: 16 of 32 dims
    want = RopeTables.apply(kn._norm(x, w, 1e-6, centered).transpose(1, 2), tables).transpose(1, 2)
    with DispatchCount(stages=False) as c:
        got = norm_rope(x, w, 1e-6, centered, rows[0], rows[1], rows[2])
    assert torch.equal(got, want)
    assert c.kernel_ops["other"] == 1 and c.ops["other"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False])
def test_kernel_matches_composite(dtype, centered):
    with interpreter() as device:
        x, w, _, rows = _inputs(dtype, centered, rotary=32, device=device)
        args = (x, w, 1e-6, centered, rows[0], rows[1], rows[2])
        got = FusedOp.registry["norm_rope"].run_triton(*args)
        want = FusedOp.registry["norm_rope"].composite(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6)
        else:
            assert (got != want).float().mean() <= 0.02
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
