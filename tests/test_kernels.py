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
    the composite (auto) or raises (strict). What a check found belongs to the engine's `KernelChecks`: a kernel that
    failed under an auto engine's checks is checked again under a later strict engine's, and raises there (it does
    not silently run the composite), while the auto engine keeps its fall-back. Run here through the implementation
    itself, on CPU tensors."""
    from ddtree.engine import kernels

    op = FusedOp("check_demo(Tensor x) -> Tensor", lambda x: x + 1, lambda x: x + 2)
    x = torch.zeros(3)
    monkeypatch.setattr("ddtree.engine.kernels._has_triton", lambda: True)
    with kernels.checking(kernels.KernelChecks("strict")), pytest.raises(RuntimeError, match="disagrees"):
        op._cuda(x)
    auto = kernels.KernelChecks("auto")
    with kernels.checking(auto):
        assert torch.equal(op._cuda(x), x + 1) and op.state == "composite"
        assert torch.equal(op._cuda(x), x + 1)
    strict = kernels.KernelChecks("strict")
    with kernels.checking(strict), pytest.raises(RuntimeError, match="disagrees .*kernels=strict"):
        op._cuda(x)  # a later strict engine is not given the auto engine's fall-back
    assert auto.checked["check_demo"] == {kernels.check_key((x,)): False} and auto.state["check_demo"] == "composite"
    assert not strict.checked.get("check_demo") and kernels.active().state.get("check_demo") is None  # theirs alone
    with kernels.checking(kernels.KernelChecks("composite")):
        assert torch.equal(op._cuda(x), x + 1) and op.state == "composite"  # never a kernel
    with kernels.checking(kernels.KernelChecks()):
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
    """timed=True: after the first-call check, each new set of argument shapes and integer arguments (a loop bound)
    times both implementations, each from a drained queue, alternating, TIMING_REPEATS times, and keeps the faster by
    the medians: the real selection code (FusedOp._cuda, kernels.compare) with the clock stubbed (CUDA events need a
    GPU): each timing returns the next of a scripted list, and the queue's drains are recorded."""
    from ddtree.engine import kernels

    monkeypatch.setattr("ddtree.engine.kernels._has_triton", lambda: True)
    ran, events = [], []
    op = FusedOp("timed_demo(Tensor x, int steps) -> Tensor", lambda x, steps: ran.append("composite") or x + 1,
                 lambda x, steps: ran.append("kernel") or x + 1, timed=True)
    script: dict[str, list[float]] = {}

    def elapsed(fn, args, runs):
        side = "kernel" if fn is op.launch else "composite"
        events.append(side)
        return script[side].pop(0)

    monkeypatch.setattr(kernels, "_drain", lambda: events.append("drain"))
    monkeypatch.setattr(kernels, "_elapsed_us", elapsed)
    n = kernels.TIMING_REPEATS
    x = torch.zeros(4)
    op._cuda(x, 3)  # the first call: the check
    assert op.state == "triton" and not op.timings
    # the kernel is faster in the median, slower in the mean (one outlier): the median decides
    script.update(kernel=[1.0] * (n - 1) + [1000.0], composite=[2.0] * n)
    ran.clear()
    op._cuda(x, 3)
    assert events == ["drain", "kernel", "drain", "composite"] * n  # each side from a drained queue, alternating
    assert op.timings[((4,), 3)] == (1.0, 2.0) and op.faster[((4,), 3)] is True and ran[-1] == "kernel"
    # another loop bound is another key: timed again (the composite faster there)
    script.update(kernel=[5.0] * n, composite=[2.0] * n)
    op._cuda(x, 9)
    assert op.faster[((4,), 9)] is False and ran[-1] == "composite"
    ran.clear()
    events.clear()
    op._cuda(x, 3)
    op._cuda(x, 9)
    assert ran == ["kernel", "composite"] and not events  # decided once per key


def test_the_first_call_check_is_per_dtype_and_tile(monkeypatch):
    """A kernel is checked against the composite at each dtype and tile it first meets (the GDN solve first runs at
    one node: its 128-node tile must be checked too), not once per op: a kernel wrong only on large tiles, or only in
    bf16, is caught there and the composite runs for that key alone."""
    from ddtree.engine.kernels import check_key

    monkeypatch.setattr("ddtree.engine.kernels._has_triton", lambda: True)
    checks = []

    def kernel(x):
        checks.append((x.dtype, x.shape[0]))
        return x + (2 if x.shape[0] > 64 or x.dtype == torch.bfloat16 else 1)  # wrong on big tiles and in bf16

    op = FusedOp("tile_demo(Tensor x) -> Tensor", lambda x: x + 1, kernel)
    small, big = torch.zeros(2), torch.zeros(65)
    assert torch.equal(op._cuda(small), small + 1) and op.checked == {check_key((small,)): True}
    op._cuda(torch.zeros(13))  # the same tile (16): no second check
    assert len(op.checked) == 1 and checks == [(torch.float32, 2), (torch.float32, 13)]
    assert torch.equal(op._cuda(big), big + 1)  # 128: checked, disagrees, the composite runs there
    assert op.checked[check_key((big,))] is False and op.state == "composite"
    assert torch.equal(op._cuda(torch.zeros(100)), torch.ones(100))  # (the same tile: the composite, unchecked)
    half = torch.zeros(1, dtype=torch.bfloat16)
    assert torch.equal(op._cuda(half), half + 1) and op.checked[check_key((half,))] is False
    checks.clear()
    assert torch.equal(op._cuda(small), small + 1) and checks == [(torch.float32, 2)]  # float32, tile 16: the kernel
    assert check_key((small, None, 16, 1.0)) != check_key((small, small, 16, 1.0)) != check_key((small, small, 1, 1.0))


def test_a_launch_runs_under_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: each launch (check, timing, run) is made under the first tensor's
    device (`torch.cuda.device`), or a device map across GPUs would launch on the wrong one."""
    from ddtree.engine import kernels

    monkeypatch.setattr(kernels, "_has_triton", lambda: True)
    guarded, entered = [], []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.pop()

    class OnDevice:  # what _on_device reads of a CUDA tensor
        is_cuda, device = True, torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", Guard)
    assert kernels._on_device(OnDevice()).device == torch.device("cuda", 1)
    monkeypatch.setattr(kernels, "_on_device", lambda t: Guard(t.device))
    op = FusedOp("device_demo(Tensor x) -> Tensor", lambda x: x + 1, lambda x: guarded.append(list(entered)) or x + 1)
    x = torch.zeros(3)
    op._cuda(x)
    op._cuda(x)
    assert guarded == [[x.device], [x.device]]  # the check's launch and the run's, each inside the guard
