"""ddtree::tree_build: the composite is best_first_tensors' build after the top-k (the device build: tests/test_tree.py
checks it against the reference), one op; its Triton kernel (interpreted without a GPU: slow, so small trees here)
gives the composite's outputs bit for bit, ties, NaN, -inf and a vocabulary under the budget included."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import tree as tree_mod
from ddtree.engine.kernels import FusedOp
from ddtree.engine.tree import best_first_tensors, tree_size
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import best_first_reference
from ddtree.testing.triton import interpreter

pytestmark = pytest.mark.gpu  # on a GPU the kernel runs for real; here, interpreted


def _logprobs(L: int, V: int, seed: int, levels: int | None = 4, holes: bool = True) -> torch.Tensor:
    """Log-probabilities quantised to a few levels (ties within and across depths), NaN and -inf scattered in."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(L, V, generator=g) * 2, dim=-1)
    if levels:
        lp = (lp * levels).round() / levels
    if holes:
        lp[torch.rand(L, V, generator=g) < 0.1] = float("nan")
        lp[torch.rand(L, V, generator=g) < 0.1] = float("-inf")
    return lp


def _args(logprobs: torch.Tensor, budget: int, root: int = 3) -> tuple:
    L, V = logprobs.shape
    cost, ranked = tree_mod._ranked_costs(logprobs, budget)
    return cost, ranked, torch.tensor(root, device=logprobs.device), 1 + tree_size(budget, L, V)


def test_the_build_after_the_top_k_is_one_op():
    logprobs = _logprobs(6, 40, 0)
    best_first_tensors(torch.tensor(3), logprobs, 16)  # constants built once per device
    with DispatchCount(stages=False) as c:
        got = best_first_tensors(torch.tensor(3), logprobs, 16)
    assert c.names["tree_build"] == 1 and c.kernel_ops["other"] <= 12, dict(c.kernel_names)
    want = FusedOp.registry["tree_build"].composite(*_args(logprobs, 16))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ref = best_first_reference(3, logprobs, 16)
    assert torch.equal(got[0], ref.tokens) and torch.equal(got[1], ref.parents) and torch.equal(got[3], ref.scores)


# (L, V, budget, quantisation levels, NaN/-inf): ties everywhere, a vocabulary under the budget, a flat block (every
# cost equal), one depth, no holes; each well under 3 s interpreted
CASES = [(3, 7, 7, 4, True), (5, 5, 16, 2, True), (4, 40, 16, 4, True), (4, 12, 16, None, False),
         (3, 30, 32, 8, True), (1, 9, 7, 4, True), (3, 6, 16, 0.0, False)]


@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-V{c[1]}-b{c[2]}" for c in CASES])
def test_kernel_matches_composite(case):
    L, V, budget, levels, holes = case
    logprobs = _logprobs(L, V, sum(case[:3]), levels or None, holes)
    if levels == 0.0:
        logprobs = torch.zeros(L, V).log_softmax(-1)  # all tied
    with interpreter() as device:
        args = _args(logprobs.to(device), budget)
        got = FusedOp.registry["tree_build"].run_triton(*args)
        want = FusedOp.registry["tree_build"].composite(*args)
        for name, a, b in zip(("tokens", "parents", "depths", "scores", "aidx", "anc"), got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), name


@pytest.mark.slow
def test_kernel_at_budget_64():
    """budget 64 (the benchmarks' DDTree): 280 candidate pairs a depth, two depths (about 3 s interpreted)."""
    logprobs = _logprobs(2, 100, 5)
    with interpreter() as device:
        args = _args(logprobs.to(device), 64)
        got = FusedOp.registry["tree_build"].run_triton(*args)
        want = FusedOp.registry["tree_build"].composite(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the interpreter is too slow at these sizes)")
def test_the_kernel_on_cuda_at_real_budgets():
    """On a GPU, at the budgets DDTree runs (16 to 512, blocks of 16 and 32): the kernel passes its first-call check and
    gives the composite's trees bit for bit over random, tied and holed logits, through best_first_tensors too."""
    pytest.importorskip("triton")
    op = FusedOp.registry["tree_build"]
    for budget, L, V in ((16, 16, 1000), (64, 16, 5000), (256, 32, 5000), (512, 32, 3000), (512, 16, 300)):
        for seed, levels in enumerate((None, 8, 2)):
            logprobs = _logprobs(L, V, seed, levels, holes=seed > 0).cuda()
            if seed == 2:
                logprobs[:, V // 2:] = logprobs[:, : V - V // 2].flip(-1)  # ties everywhere
            args = _args(logprobs, budget)
            got = op.run_triton(*args)
            want = op.composite(*args)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (budget, L, V, seed)
            through = best_first_tensors(args[2], logprobs, budget)
            assert all(torch.equal(a, b) for a, b in zip(through, want, strict=True)), (budget, L, V, seed)
    assert op.state == "triton"


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64])
def test_kernel_compiles_for_sm90_without_a_gpu(budget, tmp_path):
    """The kernel through Triton's real compiler (not the interpreter, which is lax about types) to an sm_90 (H100 /
    H200) binary, single-stream and batched: no GPU needed, only Triton's NVIDIA backend (10-20 s a budget)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    code = f"""
import triton
from triton.backends.compiler import GPUTarget
from ddtree.engine.kernels import tree as kt
budget = {budget}
pairs = sum(budget // (p + 1) for p in range(budget))
meta = dict(kt._meta(budget, pairs, budget + 1))
warps = meta.pop("num_warps")
sig = {{name: "*i64" for name in ("ranked_ptr", "root_ptr", "prank_ptr", "crank_ptr", "tok_ptr", "par_ptr", "dep_ptr",
                                  "aidx_ptr", "cell_ptr")}}
sig.update(cost_ptr="*fp32", score_ptr="*fp32", grid_ptr="*fp32", anc_ptr="*i1", pair_ptr="*i32", L="i32", P="i32",
           n="i32", bound="i32", **{{k: "constexpr" for k in meta}})
fn = kt._kernels()
for batched in (False, True):  # ddtree::tree_build; ddtree::batch_tree_build with a size per stream
    consts = dict(meta, BATCHED=batched, HAS_SIZES=batched)
    sig.update(size_ptr="*i64" if batched else "constexpr", BATCHED="constexpr", HAS_SIZES="constexpr")
    if not batched:
        consts["size_ptr"] = None
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature={{name: sig[name] for name in fn.arg_names}},
                                                      constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={{"num_warps": warps}})
    assert "cubin" in kernel.asm
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
