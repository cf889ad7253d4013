"""Draft trees: each build (the C build of a CPU, the torch build of every other device) against the slow reference,
ties, -inf and NaN included; the walks against the reference walk; the torch build's op count and capturability; the C
build's refusal of wrong arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddtree.engine import tree as tree_mod
from ddtree.engine.tree import (
    accepted_path,
    best_first_tensors,
    best_first_tree,
    chain_tree,
    host_walk,
    root_tree,
    tree_from_parents,
    tree_size,
    walk,
)
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import best_first_reference, random_tree, walk_reference

BUILDS = ["c", "torch"]
needs_c = pytest.mark.skipif(tree_mod._hosttree is None, reason="the C tree build is not compiled here")


def _build(kind: str, root: int, logprobs: torch.Tensor, budget: int):
    return best_first_tree(torch.tensor(root), logprobs, budget, host=kind == "c")


def _cases(seed: int) -> list[torch.Tensor]:
    """Log-probability blocks that stress the definition: ties, bf16 steps, -inf, NaN, positive values, tiny sizes."""
    g = torch.Generator().manual_seed(seed)
    lsm = lambda x: torch.log_softmax(x, dim=-1)  # noqa: E731
    cases = [lsm(torch.randn(L, V, generator=g) * 3) for L, V in ((1, 50), (3, 7), (15, 200))]
    cases += [lsm(torch.zeros(6, 5)), lsm(torch.randn(15, 64, generator=g)).bfloat16().float()]  # ties / bf16 ties
    peaky = torch.randn(15, 300, generator=g)  # a trained drafter's shape, with flat deep rows
    peaky[torch.arange(15), torch.randint(0, 300, (15,), generator=g)] += 14
    peaky[9:, :] = 0
    cases.append(lsm(peaky))
    hole = lsm(torch.randn(15, 100, generator=g))
    hole[3, :] = float("-inf")  # one finite value: its -inf ranks follow in token order
    hole[3, 5] = 0
    hole[7, :60] = float("-inf")
    cases.append(hole)
    nan = lsm(torch.randn(8, 90, generator=g) * 2)
    nan[torch.rand(8, 90, generator=g) < 0.2] = float("nan")  # NaN counts as -inf
    nan[2] = float("nan")
    nan[4, 10:] = float("-inf")
    cases.append(nan)
    cases.append((torch.randn(5, 40, generator=g) * 2).round())  # not log-probabilities: positive values count as 0
    ties = lsm((torch.randn(15, 1000, generator=g) * 4).round() / 4)  # ties across the C build's blocks of 32
    cases += [ties, torch.randn(2, 1, generator=g).log_softmax(-1), torch.randn(1, 9, generator=g)]
    return cases


def _ancestry(parents: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """The ancestor matrix and each node's ancestors (self first), by walking up the parent links."""
    n = len(parents)
    anc, chains = torch.zeros(n, n, dtype=torch.bool), []
    for i in range(n):
        chain, j = [], i
        while j >= 0:
            anc[i, j] = True
            chain.append(j)
            j = parents[j]
        chains.append(chain)
    return anc, chains


def _assert_is_reference(got, ref, what) -> None:
    for name in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), (name, what)
    anc, chains = _ancestry(ref.parents.tolist())
    assert torch.equal(got.ancestor_matrix(), anc), what
    aidx = got.ancestor_index().tolist()
    assert got.depth_bound >= max(len(c) for c in chains) - 1
    for row, chain in zip(aidx, chains, strict=True):
        assert row == (chain + [0] * len(row))[: len(row)], what  # the root repeats past itself


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("budget", [1, 2, 7, 64, 300])
def test_every_build_is_the_reference(build, budget):
    """The C build and the torch build give the reference's tree exactly: tokens, parents, depths, float32 scores,
    ancestry; ties, -inf, NaN and positive values included."""
    if build == "c" and tree_mod._hosttree is None:
        pytest.skip("the C tree build is not compiled here")
    for i, logprobs in enumerate(_cases(budget)):
        got = _build(build, 3, logprobs, budget)
        _assert_is_reference(got, best_first_reference(3, logprobs, budget), (i, tuple(logprobs.shape)))
        L, V = logprobs.shape
        assert len(got) == 1 + tree_size(budget, L, V)


@needs_c
def test_the_c_build_is_the_reference_on_random_blocks_with_nan():
    """The C build against the reference (not against itself) over random sizes, NaN and -inf scattered in."""
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        L, V = int(torch.randint(1, 17, (1,), generator=g)), int(torch.randint(1, 400, (1,), generator=g))
        logprobs = torch.log_softmax(torch.randn(L, V, generator=g) * (0.5 + trial % 4), dim=-1)
        if trial % 3 == 0:  # a trained drafter's peaked rows, rounded: ties
            logprobs[torch.arange(L), torch.randint(0, V, (L,), generator=g)] += 12
            logprobs = (logprobs * 8).round() / 8
        logprobs[torch.rand(L, V, generator=g) < 0.1 * (trial % 3)] = float("nan")
        logprobs[torch.rand(L, V, generator=g) < 0.1] = float("-inf")
        for budget in (1, 9, 64, 65):
            ref = best_first_reference(5, logprobs, budget)
            _assert_is_reference(_build("c", 5, logprobs, budget), ref, (trial, L, V, budget))


def test_the_c_tree_build_is_compiled():
    """`make install` compiles ddtree/engine/_hosttree.c (setup.py); where a C compiler exists it must be there, and
    current (the batched round's `batch_best_first` too), or every CPU round pays the torch build (several times slower
    there) without saying so."""
    import shutil

    if tree_mod._hosttree is None and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch build serves")
    assert tree_mod._hosttree is not None, "ddtree/engine/_hosttree.c is not compiled: rerun `make install`"
    assert hasattr(tree_mod._hosttree, "batch_best_first"), "an older build of _hosttree.c: rerun `make install`"


@needs_c
def test_the_c_build_refuses_wrong_arrays():
    """Wrong dtypes, layouts, shapes and sizes: a TypeError / ValueError naming the argument, never a misread."""
    best_first = tree_mod._hosttree.best_first
    lp = torch.log_softmax(torch.randn(4, 50), dim=-1).numpy()
    budget, cap = 8, 9

    def outs(**change):
        arrays = {"ints": np.empty((5, cap), np.int64), "scores": np.empty(cap, np.float32),
                  "aidx": np.empty(cap * 5, np.int64), "anc": np.empty(cap * cap, np.bool_)}
        arrays.update(change)
        return list(arrays.values())

    assert best_first(lp, budget, 1, *outs())[0] == cap  # the right arrays: budget nodes and the root
    bad = [
        ((lp.astype(np.float64), budget, 1, *outs()), TypeError, "'logprobs' must be float32"),
        ((lp[:, ::2], budget, 1, *outs()), ValueError, "'logprobs' must be C-contiguous"),
        ((lp[0], budget, 1, *outs()), ValueError, "'logprobs' must have 2 dimension"),
        ((lp[:, :0], budget, 1, *outs()), ValueError, "'logprobs' must be \\[L, V\\]"),
        ((lp.tolist(), budget, 1, *outs()), TypeError, "'logprobs' must be a NumPy array"),
        ((lp, 0, 1, *outs()), ValueError, "budget must be in"),
        ((lp, 2**24 + 1, 1, *outs()), ValueError, "budget must be in"),
        ((lp, budget, 1, *outs(ints=np.empty((5, cap), np.int32))), TypeError, "'ints' must be int64"),
        ((lp, budget, 1, *outs(ints=np.empty((5, cap + 1), np.int64))), ValueError, "'ints' must have 9 entries"),
        ((lp, budget, 1, *outs(ints=np.empty((cap, 5), np.int64).T)), ValueError, "'ints' must be C-contiguous"),
        ((lp, budget, 1, *outs(scores=np.empty(cap, np.float64))), TypeError, "'scores' must be float32"),
        ((lp, budget, 1, *outs(aidx=np.empty(cap * 4, np.int64))), ValueError, "'aidx' must have 45 entries"),
        ((lp, budget, 1, *outs(anc=np.empty(cap * cap, np.uint8))), TypeError, "'anc' must be bool"),
        ((lp, budget, 1, *outs(anc=np.empty(cap * cap, np.bool_)[::-1])), ValueError, "'anc' must be C-contiguous"),
        ((lp, budget, 1, *outs(scores=bytes(4 * cap))), TypeError, "'scores' must be a writable"),
    ]
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            best_first(*args)


def _choices(tree, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Random target choices, mostly the first child's token where there is one: some walks go deep."""
    choice = torch.randint(0, vocab, (len(tree),), generator=g)
    parents, tokens, seen = tree.parents.tolist(), tree.tokens.tolist(), set()
    for i in range(1, len(tree)):
        if parents[i] not in seen and torch.rand(1, generator=g) < 0.7:
            choice[parents[i]] = tokens[i]
        seen.add(parents[i])
    return choice


@pytest.mark.parametrize("build", BUILDS)
def test_walks_are_the_reference_walk(build):
    """walk() of a host-built tree (the host walk) and of a device-built one (torch ops) follow the reference walk."""
    if build == "c" and tree_mod._hosttree is None:
        pytest.skip("the C tree build is not compiled here")
    g = torch.Generator().manual_seed(0)
    for budget in (1, 4, 64, 200):
        logprobs = torch.log_softmax(torch.randn(8, 6, generator=g) * 2, dim=-1)
        tree = _build(build, 2, logprobs, budget)
        assert (tree._host is not None) == (build == "c")
        for _ in range(25):
            choice = _choices(tree, 6, g)
            w = walk(tree, choice)
            path, tokens = walk_reference(tree, choice)
            assert w.path_list == path and w.path.tolist() == path and w.tokens == tokens
            assert int(w.next_root) == tokens[-1]
            assert accepted_path(tree, choice).tolist() == path


def test_the_device_walk_of_any_tree_is_the_reference_walk():
    rng, g = random.Random(2), torch.Generator().manual_seed(1)
    trees = [random_tree(n, 6, rng) for n in (2, 9, 40)]
    trees += [chain_tree(torch.tensor(1), torch.tensor([2, 3, 4])), root_tree(torch.tensor(3))]
    trees.append(tree_from_parents([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4]))
    for tree in trees:
        assert tree._host is None
        for _ in range(20):
            choice = _choices(tree, 6, g)
            w = walk(tree, choice)
            assert (w.path_list, w.tokens) == walk_reference(tree, choice)
            assert w.path.tolist() == w.path_list


@needs_c
def test_the_host_walk_asks_only_for_rows_it_needs():
    """host_walk asks each row at most once, and for the rows of its path; it walks as the reference does."""
    g = torch.Generator().manual_seed(3)
    for budget in (4, 64, 200):
        tree = best_first_tree(torch.tensor(2), torch.log_softmax(torch.randn(10, 7, generator=g) * 2, -1), budget)
        for _ in range(40):
            logits = torch.randn(len(tree), 7, generator=g)
            logits[0, int(tree.tokens[1])] += 3  # some walks go deep
            asked = []

            def argmax(nodes, logits=logits, asked=asked):
                asked.extend(nodes)
                return logits[nodes].argmax(-1).tolist()

            w = host_walk(tree, argmax)
            assert (w.path_list, w.tokens) == walk_reference(tree, logits.argmax(-1))
            assert set(w.path_list) <= set(asked) and len(asked) == len(set(asked))


def test_the_device_build_is_a_few_ops_a_depth_with_fixed_shapes_and_no_host_read():
    """DDTree's tree on a GPU, budget 64, block 16: the ranks' ops and one fused build, 12 ops (ancestry included; 205
    before this build, 3 a depth plus ~50 before ddtree::tree_build), none reading the device, and the same op
    sequence and shapes whatever the logits (capturable)."""
    L, budget, root = 15, 64, torch.tensor(1)
    g = torch.Generator().manual_seed(0)
    runs = []
    for V, scale in ((1024, 3.0), (1024, 0.0), (32, 1.0)):
        logprobs = torch.log_softmax(torch.randn(L, V, generator=g) * scale, dim=-1)
        best_first_tree(root, logprobs, budget, host=False)  # constants built once per device
        with DispatchCount(stages=False, sequence=True) as ops:
            tree = best_first_tree(root, logprobs, budget, host=False)
            tree.ancestor_index(), tree.ancestor_matrix()  # built with the tree: no op here
        assert ops.total(ops.syncs, exclude=()) == 0, dict(ops.sync_names)
        runs.append(ops.sequence)
    assert len(runs[0]) <= 12, len(runs[0])
    assert runs[0] == runs[1]  # ties everywhere or none: the same ops on the same shapes
    assert len(runs[2]) <= len(runs[0]) + 2  # a vocabulary under the budget pads its ranks


def _compiled_equals_eager(backend: str) -> None:
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(best_first_tensors, fullgraph=True, dynamic=False, backend=backend)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        logprobs = torch.log_softmax(torch.randn(15, 300, generator=g) * 3, dim=-1)
        logprobs[2, i] = float("nan")
        if i == 2:
            logprobs = logprobs.bfloat16().float()  # ties
        got, want = compiled(torch.tensor(4), logprobs, 64), best_first_tensors(torch.tensor(4), logprobs, 64)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1  # one graph, no recompile across logits
    torch._dynamo.reset()


def test_the_device_build_traces_as_one_graph():
    """torch.compile(fullgraph=True) of the device build: one graph, no break, no recompile (dynamo's trace alone)."""
    _compiled_equals_eager("eager")


@pytest.mark.slow
def test_the_device_build_compiles_with_inductor():
    """The same with inductor's kernels (minutes on a small CPU): the compiled tree is the eager one, bit for bit."""
    _compiled_equals_eager("inductor")
