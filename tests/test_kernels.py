"""The fused ops (ddtree.engine.kernels): the composite is what the engine ran before, and the Triton kernel (in
Triton's interpreter without a GPU, ddtree.testing.triton) computes the composite's values."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.kernels import FusedOp
from ddtree.engine.kernels import norm as kn
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.triton import interpreter

pytestmark = pytest.mark.gpu  # on a GPU (bench/device_all.sh) the kernels run for real; here, interpreted


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the last bits of a float32 reduction's order (rounded to bf16: a rare one-ulp step)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        diff = got.float() != want.float()
        assert diff.float().mean() <= 0.01, diff.float().mean()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False])
def test_rms_norm_kernel_matches_composite(dtype, centered):
    g = torch.Generator().manual_seed(0)
    with interpreter() as device:
        x = torch.randn(2, 3, 4, 96, generator=g).to(device, dtype)
        r = torch.randn(2, 3, 4, 96, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(device) if centered else torch.randn(96, generator=g).to(device, dtype)
        view = x[..., :48]  # a strided view (a gated q projection's query half)
        for args in ((x, w, 1e-6, centered), (view, w[:48], 1e-6, centered)):
            _close(FusedOp.registry["rms_norm"].run_triton(*args), kn._norm(*args))
        got = FusedOp.registry["add_rms_norm"].run_triton(x, r, w, 1e-6, centered)
        want = kn._add_norm(x, r, w, 1e-6, centered)
        assert torch.equal(got[1], want[1])  # the residual sum: one rounding, bitwise
        _close(got[0], want[0])


def test_rms_norm_composite_is_the_lean_norm():
    """The CPU implementation is bitwise the arithmetic it replaces, and one dispatched op."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g).bfloat16()
    r = torch.randn(3, 7, 64, generator=g).bfloat16()
    scale = 1 + torch.randn(64, generator=g)
    with DispatchCount(stages=False) as c:
        got, total = kn.add_rms_norm(x, r, scale, 1e-6, True)
    assert c.kernel_ops["other"] == 1
    assert torch.equal(total, r + x)
    assert torch.equal(got, torch.nn.functional.rms_norm((r + x).float(), (64,), scale, 1e-6).bfloat16())


def test_cuda_first_call_checks_the_kernel(monkeypatch):
    """The CUDA implementation's first call runs the kernel against the composite: a disagreeing kernel falls back to
    the composite (auto) or raises (strict). Run here through the implementation itself, on CPU tensors."""
    op = FusedOp("check_demo(Tensor x) -> Tensor", lambda x: x + 1, lambda x: x + 2)
    x = torch.zeros(3)
    monkeypatch.setattr("ddtree.engine.kernels._has_triton", lambda: True)
    monkeypatch.setenv("DDTREE_KERNELS", "strict")
    with pytest.raises(RuntimeError, match="disagrees"):
        op._cuda(x)
    monkeypatch.setenv("DDTREE_KERNELS", "auto")
    assert torch.equal(op._cuda(x), x + 1) and op.state == "composite"
    assert torch.equal(op._cuda(x), x + 1)
    good = FusedOp("check_demo_ok(Tensor x) -> Tensor", lambda x: x + 1, lambda x: x + 1)
    assert torch.equal(good._cuda(x), x + 1) and good.state == "triton"
    good.launch = lambda x: (_ for _ in ()).throw(RuntimeError("no kernel for this shape"))  # a later shape fails
    assert torch.equal(good._cuda(x), x + 1) and good.state == "composite"


def test_row_stride_reads_views_without_copies():
    x = torch.zeros(2, 3, 4, 32)
    assert kn._row_stride(x) == 32
    assert kn._row_stride(x[..., :16]) == 32  # a chunk of the last dim: rows 32 apart
    assert kn._row_stride(x.transpose(1, 2)) is None  # leading dims that do not collapse
    assert kn._row_stride(x[:1]) == 32
    assert kn._row_stride(x[:, :1]) is None  # rows 32 apart within a batch, 384 across
    assert kn._row_stride(torch.zeros(7)) == 7


def test_a_timed_kernel_runs_only_where_it_was_faster(monkeypatch):
    """timed=True: after the first-call check, each new set of argument shapes times both implementations and keeps
    the faster (the timer stubbed here: CUDA events need a GPU)."""
    monkeypatch.setattr("ddtree.engine.kernels._has_triton", lambda: True)
    ran = []
    op = FusedOp("timed_demo(Tensor x) -> Tensor", lambda x: ran.append("composite") or x + 1,
                 lambda x: ran.append("kernel") or x + 1, timed=True)
    speed = {"kernel": 5.0, "composite": 3.0}  # us: the kernel is slower on small inputs, faster on large
    monkeypatch.setattr("ddtree.engine.kernels._micros",
                        lambda fn, args: speed["kernel" if fn is op.launch else "composite"] * args[0].numel())
    small, large = torch.zeros(2), torch.zeros(8)
    op._cuda(small)  # the first call: the check
    assert op.state == "triton"
    ran.clear()
    op._cuda(small)
    assert op.faster[((2,),)] is False and ran[-1] == "composite"
    speed.update(kernel=1.0)
    op._cuda(large)
    assert op.faster[((8,),)] is True and ran[-1] == "kernel"
    assert op.timings[((8,),)] == (8.0, 24.0)
    ran.clear()
    op._cuda(small)
    assert ran == ["composite"]  # decided once per shape
