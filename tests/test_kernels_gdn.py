"""The tree-exact GDN layer's fused ops (ddtree.engine.kernels.gdn): each Triton kernel (in Triton's interpreter
without a GPU) computes its composite's values, and each op is one dispatch. That the composites are bitwise what
the layer ran before is the lossless tests' (tests/test_gdn_tree.py); their counts are tests/test_gdn_launches.py's."""

from __future__ import annotations

import random

import pytest
import torch

import ddtree
from ddtree.engine import gdn
from ddtree.engine.kernels import FusedOp
from ddtree.engine.kernels import gdn as kernels
from ddtree.engine.tree import tree_from_parents
from ddtree.engine.verification import tree_verification
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import ScriptedProposer, hf_greedy
from ddtree.testing.triton import interpreter
from ddtree.tiny import tiny_model

# a 9-node tree with branches (flat order, parents first); K = 4 reaches past the root for the shallow nodes
PARENTS = [-1, 0, 1, 2, 0, 4, 1, 6, 3]
# a DDTree-64-sized one (65 nodes: the kernels' 128-wide tiles, several blocks of rows and of the decay map)
BIG = [-1] + [random.Random(7).randrange(max(0, i - 4), i) for i in range(1, 65)]
KERNEL = 4
pytestmark = pytest.mark.gpu  # on a GPU (bench/device_all.sh) the kernels run for real; here, interpreted

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Equal up to float32 rounding (in bf16: a rare one-ulp step of a rounded value)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    else:
        diff = got.float() != want.float()
        assert diff.float().mean() <= 0.01, diff.float().mean()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def _meta(parents: list[int] = PARENTS) -> gdn.TreeMeta:
    tree = tree_from_parents(list(range(len(parents))), parents)
    with tree_verification(tree) as ctx:
        return gdn.tree_meta(ctx, KERNEL, torch.device("cpu"), {})


def _batch_meta(rows: list[list[int]]) -> gdn.TreeMeta:
    """The TreeMeta of a batch of trees (each row's parents), padded as a BatchTree pads: children of the root."""
    from ddtree.engine.batch_tree import BatchTree

    width = max(len(p) for p in rows)
    parents = torch.tensor([p + [0] * (width - len(p)) for p in rows])
    parents[:, 0] = -1
    depths = torch.zeros_like(parents)
    ancestors = torch.zeros(len(rows), width, width, dtype=torch.bool)
    for b in range(len(rows)):
        for i in range(width):
            p = int(parents[b, i])
            depths[b, i] = 0 if p < 0 else depths[b, p] + 1
            ancestors[b, i] = ancestors[b, p] if p >= 0 else False
            ancestors[b, i, i] = True
    valid = torch.arange(width)[None] < torch.tensor([len(p) for p in rows])[:, None]
    tree = BatchTree(torch.zeros_like(parents), parents, depths, valid, valid.sum(1), ancestors,
                     depth_bound=int(depths.max()))
    with tree_verification(tree) as ctx:
        return gdn.tree_meta(ctx, KERNEL, torch.device("cpu"))


BATCH = [PARENTS, [-1, 0, 1, 2, 3, 4], [-1]]  # a batch of three trees: branches, a chain past K, a lone root


def _both(name: str, args: tuple, mutated: tuple[int, ...], device: str) -> tuple[list, list]:
    """(the kernel's outputs, the composite's) on copies of the written arguments, the kernel's on `device`."""
    op = FusedOp.registry[name]
    want = [a.clone() if i in mutated else a for i, a in enumerate(args)]
    op.composite(*want)
    got = [(a.clone() if i in mutated else a) for i, a in enumerate(args)]
    got = [a.to(device) if isinstance(a, torch.Tensor) else a for a in got]
    op.run_triton(*got)
    return [got[i].cpu() for i in mutated], [want[i] for i in mutated]


def _one_op(name: str, args: tuple) -> None:
    """The op is one counted op (the one launch a GPU makes), its composite's ops uncounted."""
    with torch.inference_mode(), DispatchCount(stages=False, decompose=True) as c:
        FusedOp.registry[name](*args)
    assert c.total(c.ops, exclude=()) == 1 and c.kernel_names == {name: 1}, (dict(c.kernel_names), dict(c.view_names))


@pytest.mark.parametrize(("stacked", "parents"), [(False, PARENTS), (True, PARENTS), (False, BIG)],
                         ids=["flat", "stacked", "65_nodes"])
@DTYPES
def test_decays_kernel_matches_composite(dtype, stacked, parents):
    g = torch.Generator().manual_seed(0)
    meta = _meta(parents)
    n, bsz, hv = len(parents), 2, 3
    ab = (2 * torch.randn(bsz, n, 2 * hv, generator=g)).to(dtype)
    if stacked:  # (qwen3_next's layout: (B, T, 2, Hv) float32)
        ab = ab.float().view(bsz, n, 2, hv)
    gates = torch.full((bsz, hv, 2 * n + 2), float("nan"))
    gates[..., n] = torch.rand(hv, generator=g) * 8  # A, filled once
    gates[..., 2 * n + 1] = 1
    xy = torch.full((bsz, hv, 6 * n + 3), float("nan"))
    decays = torch.full((bsz * hv, n, n + 1), float("nan"))
    args = (ab, torch.zeros(1), meta.decay_map, meta.decay_mask, gates, xy, decays)
    with interpreter() as device:
        got, want = _both("gdn_decays", args, (4, 5, 6), device)
    _close(got[0], want[0])  # the softplus
    _close(got[1], want[1])  # X and Y: path sums
    # E = exp(c_i - c_j + log beta_j) from X . Y, terms of ~|c| each: a path sum's last bit is ~1e-5 of E
    _close(got[2], want[2], rtol=2e-4)
    assert (want[2] == 0).any() and (want[2] > 0).any()  # masked and unmasked entries both checked
    _one_op("gdn_decays", args)


@DTYPES
def test_decays_kernel_matches_composite_over_a_batch_of_trees(dtype):
    """A map and a mask per stream (a BatchTree's TreeMeta): each stream's rows read their own."""
    g = torch.Generator().manual_seed(0)
    meta = _batch_meta(BATCH)
    bsz, n, hv = len(BATCH), meta.decay_mask.shape[-2], 3
    ab = (2 * torch.randn(bsz, n, 2 * hv, generator=g)).to(dtype)
    gates = torch.full((bsz, hv, 2 * n + 2), float("nan"))
    gates[..., n] = torch.rand(hv, generator=g) * 8
    gates[..., 2 * n + 1] = 1
    xy = torch.full((bsz, hv, 6 * n + 3), float("nan"))
    decays = torch.full((bsz * hv, n, n + 1), float("nan"))
    args = (ab, torch.zeros(1), meta.decay_map, meta.decay_mask, gates, xy, decays)
    with interpreter() as device:
        got, want = _both("gdn_decays", args, (4, 5, 6), device)
    _close(got[0], want[0])
    _close(got[1], want[1])
    _close(got[2], want[2], rtol=2e-4)
    e = want[2].view(bsz, hv, n, n + 1)
    assert (e[0, :, 3, 1 + 4] == 0).all() and (e[1, :, 3, 1 + 2] > 0).all()  # 4 no ancestor of 3 in stream 0; 2 is in 1
    _one_op("gdn_decays", args)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@DTYPES
def test_conv_kernel_matches_composite_over_a_batch_of_trees(dtype, bias):
    """Each stream's own windows (a BatchTree's TreeMeta: bags per node and stream)."""
    g = torch.Generator().manual_seed(1)
    meta = _batch_meta(BATCH)
    bsz, n, channels = len(BATCH), meta.decay_mask.shape[-2], 40
    past = torch.randn(bsz, channels, KERNEL, generator=g).to(dtype).transpose(1, 2)
    mixed = torch.randn(bsz, n, channels, generator=g).to(dtype)
    taps = torch.randn(KERNEL, 1, 1, channels, generator=g)
    conv_bias = torch.randn(channels, generator=g) if bias else None
    extended = torch.zeros(bsz, KERNEL + n, channels, dtype=dtype)
    table = torch.empty(KERNEL, KERNEL + n, bsz, channels)
    out = torch.full((n, bsz, channels), float("nan")).view(n, -1)
    args = (past, mixed, taps, conv_bias, meta.conv_index, meta.conv_offsets, extended, table, out)
    with interpreter() as device:
        got, want = _both("gdn_conv", args, (6, 8), device)
    assert torch.equal(got[0], want[0])
    _close(got[1], want[1])
    # each stream's own windows, by hand: stream 1 (a chain) node 5 over nodes 2..5; stream 2's padding node 1 (a
    # child of the root) over the conv state's last two columns, the root and itself
    rows = torch.cat([past.float(), mixed.float()], dim=1)  # (B, K + T, C)
    shift = 0 if conv_bias is None else conv_bias
    for (b, i), window in (((1, 5), rows[1, KERNEL + 2: KERNEL + 6]),
                           ((2, 1), torch.cat([rows[2, 2:KERNEL], rows[2, KERNEL: KERNEL + 2]]))):
        ref = torch.nn.functional.silu((window * taps[:, 0, 0]).sum(0) + shift)
        torch.testing.assert_close(want[1].view(n, bsz, channels)[i, b], ref, rtol=1e-5, atol=1e-5)
    _one_op("gdn_conv", args)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@DTYPES
def test_conv_kernel_matches_composite(dtype, bias):
    g = torch.Generator().manual_seed(1)
    meta = _meta()
    n, bsz, channels = len(PARENTS), 2, 40
    state = torch.randn(bsz, channels, KERNEL + 1, generator=g).to(dtype)
    past = state[..., -KERNEL:].transpose(1, 2)  # the conv state's last K columns token-major (a strided view)
    mixed = torch.randn(bsz, n, channels, generator=g).to(dtype)
    taps = torch.randn(KERNEL, 1, 1, channels, generator=g)
    conv_bias = torch.randn(channels, generator=g) if bias else None
    extended = torch.zeros(bsz, KERNEL + n, channels, dtype=dtype)
    table = torch.empty(KERNEL, KERNEL + n, bsz, channels)
    out = torch.full((n, bsz, channels), float("nan")).view(n, -1)
    args = (past, mixed, taps, conv_bias, meta.conv_index, meta.conv_offsets, extended, table, out)
    with interpreter() as device:
        got, want = _both("gdn_conv", args, (6, 8), device)
    assert torch.equal(got[0], want[0])  # the rows the commit reads: copies, bitwise
    _close(got[1], want[1])
    _one_op("gdn_conv", args)


def test_qk_norm_kernel_matches_composite():
    g = torch.Generator().manual_seed(2)
    bsz, n, hk, per, dk = 2, 7, 2, 3, 32
    conv = torch.randn(n, bsz, 2 * hk * dk + 24, generator=g)  # as tree_layer's conv buffer: q, k, then v columns
    qk = conv.transpose(0, 1)[..., :2 * hk * dk].view(bsz, n, 2, hk, 1, dk)
    keys = torch.full((bsz, hk, per, 2, n, dk), float("nan"))
    rows = keys.permute(0, 4, 3, 1, 2, 5)  # (B, T, 2, Hk, Hv/Hk, dk) of the keys buffer
    args = (qk, torch.full((dk,), dk ** -0.5), 1e-6 / dk, rows)
    with interpreter() as device:
        got, want = _both("gdn_qk_norm", args, (3,), device)
    _close(got[0], want[0])
    _one_op("gdn_qk_norm", args)


@DTYPES
def test_gated_norm_kernel_matches_composite(dtype):
    g = torch.Generator().manual_seed(3)
    bsz, hv, n, dv = 2, 2, 5, 24
    core = torch.randn(bsz, hv, n, dv, generator=g)
    z = (2 * torch.randn(bsz, n, hv * dv, generator=g)).to(dtype)
    weight = 1 + 0.1 * torch.randn(dv, generator=g)
    gate = torch.empty(bsz, n, hv * dv, dtype=dtype)
    out = torch.full((bsz, n, hv, dv), float("nan")).to(dtype)
    args = (core, z, weight, 1e-6 * dv, gate, out)
    with interpreter() as device:
        got, want = _both("gdn_gated_norm", args, (5,), device)
    _close(got[0], want[0])
    _one_op("gdn_gated_norm", args)


@pytest.mark.parametrize(("prefix", "parents", "coupled"), [(True, PARENTS, False), (False, PARENTS, False),
                                                            (True, BIG, False), (True, BIG, True)],
                         ids=["state", "no_state", "65_nodes", "65_nodes_coupled"])
def test_delta_rule_kernel_matches_composite(prefix, parents, coupled):
    """The solve, its products and the output, on a tree's real E (gdn_decays' composite) and l2-normalised keys.
    coupled: nearly equal keys, no decay, beta ~ 1 (every ancestor weighs ~1 in the solve): a step too few of the
    kernel's iteration leaves the deepest nodes visibly wrong."""
    g = torch.Generator().manual_seed(4)
    meta = _meta(parents)
    n, bsz, hv, dk, dv = len(parents), 1, 2, 32, 24
    gates = torch.empty(bsz, hv, 2 * n + 2)
    gates[..., n] = torch.rand(hv, generator=g) * (0.01 if coupled else 4)
    gates[..., 2 * n + 1] = 1
    decays = torch.empty(bsz * hv, n, n + 1)
    ab = torch.full((bsz, n, 2 * hv), -8.0) if coupled else torch.randn(bsz, n, 2 * hv, generator=g)
    kg_args = (ab, torch.zeros(1), meta.decay_map, meta.decay_mask, gates, torch.empty(bsz, hv, 6 * n + 3), decays)
    FusedOp.registry["gdn_decays"].composite(*kg_args)
    keys = torch.randn(bsz * hv, 2 * n, dk, generator=g)
    if coupled:
        keys = torch.randn(bsz * hv, 1, dk, generator=g) + 0.05 * keys
    keys = torch.nn.functional.normalize(keys, dim=-1)
    conv = torch.randn(n, bsz, hv * dv + 8, generator=g)  # value: a strided view of the conv buffer, as tree_layer's
    value = conv.transpose(0, 1)[..., 8:].view(bsz, n, hv, dv).transpose(1, 2)
    state = 0.3 * torch.randn(bsz * hv, dk, dv, generator=g) if prefix else None
    args = (keys, value, state, decays, torch.empty(bsz, hv, 2 * n, n), torch.empty(bsz, hv, 2 * n, dv),
            torch.full((bsz, hv, n, dv), float("nan")), torch.full((bsz, hv, n, dv), float("nan")), meta.depth_bound)
    with interpreter() as device:
        got, want = _both("gdn_delta_rule", args, (6, 7), device)
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    _one_op("gdn_delta_rule", args)


def test_delta_rule_over_128_nodes_runs_the_composite():
    """Past the kernel's tiles (a tree of more than 128 nodes) the CUDA implementation is the composite: bitwise."""
    g = torch.Generator().manual_seed(5)
    n, hv, dk, dv = 129, 1, 16, 16
    decays = torch.rand(hv, n, n + 1, generator=g).tril(1) * 0.5
    keys = torch.nn.functional.normalize(torch.randn(hv, 2 * n, dk, generator=g), dim=-1)
    value = torch.randn(1, hv, n, dv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g)
    args = (keys, value, state, decays, torch.empty(1, hv, 2 * n, n), torch.empty(1, hv, 2 * n, dv),
            torch.empty(1, hv, n, dv), torch.empty(1, hv, n, dv), n - 1)
    got, want = _both("gdn_delta_rule", args, (6, 7), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.slow
def test_engine_with_the_triton_kernels_is_lossless(monkeypatch):
    """The layer's five fused ops run by their Triton kernels (the interpreter on a CPU) through a whole generation on
    a tiny hybrid: fp32 greedy output equals HF's (what a GPU runs, end to end; ~15 s in the interpreter)."""
    calls = dict.fromkeys(("decays", "conv", "qk_norm", "delta_rule", "gated_norm"), 0)
    for name in calls:
        def run(*args, _op=FusedOp.registry[f"gdn_{name}"], _name=name):
            calls[_name] += 1
            return _op.run_triton(*args)
        monkeypatch.setattr(kernels, name, run)
    with interpreter() as device:
        target = tiny_model("qwen3_5_text", seed=8, vocab_size=64).to(device)
        ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(4)).to(device)
        ref = hf_greedy(target, ids, 24)
        res = ddtree.generate(target, None, ids, max_new_tokens=24, proposer=ScriptedProposer(ref, 64, seed=1))
    assert res.output_ids == ref
    assert max(res.acceptance_lengths) >= 4 and min(calls.values()) >= 3 * res.rounds, calls
