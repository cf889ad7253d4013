"""Batched draft trees (ddtree.engine.batch_tree): each builder row by row against the single-stream definition
(ddtree.testing.reference.best_first_reference, chain and root trees), the batched walk against the reference walk,
the keyed sampler against softmax (scipy's chi-square) and a pure-Python splitmix64, and the ops a round dispatches
against the number of streams."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ddtree.engine import tree as tree_mod
from ddtree.engine.batch_tree import (
    BatchTree,
    batch_best_first,
    batch_chain_trees,
    batch_full_trees,
    batch_root_trees,
    batch_walk,
    keyed_choice,
    keyed_draft_choice,
    keyed_uniform,
    positions_after,
    with_sizes,
)
from ddtree.engine.tree import tree_size
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import best_first_reference, random_tree, walk_reference


def _logprobs(N: int, L: int, V: int, seed: int, kind: str) -> torch.Tensor:
    """[N, L, V] blocks that stress the definition: plain, ties (coarse steps), -inf, NaN and positive values."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(N, L, V, generator=g) * 3, dim=-1)
    if kind == "ties":
        lp = (lp * 2).round() / 2
    elif kind == "inf":
        lp = (lp * 2).round() / 2
        lp[lp < -3] = float("-inf")
    elif kind == "odd":
        lp[torch.rand(N, L, V, generator=g) < 0.1] = float("nan")
        lp[torch.rand(N, L, V, generator=g) < 0.05] = 0.5
        lp[:, -1] = float("-inf")  # a whole position without a candidate
    return lp


def _ancestors(parents: list[int]) -> tuple[list[list[bool]], list[list[int]]]:
    """The ancestor matrix and index of a tree, obviously."""
    n = len(parents)
    chains = []
    for a in range(n):
        up = [a]
        while parents[up[-1]] >= 0:
            up.append(parents[up[-1]])
        chains.append(up)
    return [[b in up for b in range(n)] for up in chains], chains


def _check_row(bt: BatchTree, i: int, tokens: list[int], parents: list[int], depths: list[int]) -> None:
    """Row i holds exactly this tree, then padding (parent 0, depth 1, token 0, invalid; ancestors itself and the
    root; ancestor index itself then the root)."""
    n, T = len(tokens), bt.width
    assert int(bt.sizes[i]) == n
    assert bt.valid[i].tolist() == [True] * n + [False] * (T - n)
    assert bt.tokens[i].tolist() == tokens + [0] * (T - n)
    assert bt.parents[i].tolist() == parents + [0] * (T - n)
    assert bt.depths[i].tolist() == depths + [1] * (T - n)
    anc, chains = _ancestors(parents + [0] * (T - n))
    assert bt.ancestors[i].tolist() == anc
    K = bt.depth_bound + 1
    assert max(depths) <= bt.depth_bound
    assert bt.ancestor_index()[i].tolist() == [(up + [0] * K)[:K] for up in chains]


@pytest.mark.parametrize("N", [1, 3, 5])
@pytest.mark.parametrize("kind", ["plain", "ties", "inf", "odd"])
def test_batch_best_first_rows_are_the_reference_trees(N, kind):
    """Each row is best_first_reference's tree of its stream, node for node (scores included), at budgets below,
    at and above the vocabulary and the prefixes that exist."""
    for case, (L, V, budget) in enumerate([(1, 50, 8), (3, 7, 10), (4, 3, 50), (6, 20, 16), (15, 40, 64)]):
        lp = _logprobs(N, L, V, seed=case, kind=kind)
        roots = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(case))
        bt = batch_best_first(roots, lp, budget)
        assert bt.width == 1 + tree_size(budget, L, V) and not bt.is_chain
        for i in range(N):
            ref = best_first_reference(int(roots[i]), lp[i], budget)
            _check_row(bt, i, ref.tokens.tolist(), ref.parents.tolist(), ref.depths.tolist())
            assert torch.equal(bt.scores[i], ref.scores)


def test_batch_best_first_with_a_budget_per_stream():
    """budgets[i] < budget: row i is the reference tree of budgets[i] (its own flat order), then padding."""
    N, L, V, budget = 6, 5, 9, 24
    lp = _logprobs(N, L, V, seed=7, kind="ties")
    roots = torch.arange(N)
    budgets = torch.tensor([0, 1, 5, 24, 13, 2])
    bt = batch_best_first(roots, lp, budget, budgets)
    for i in range(N):
        if budgets[i] == 0:
            _check_row(bt, i, [i], [-1], [0])
            continue
        ref = best_first_reference(i, lp[i], int(budgets[i]))
        _check_row(bt, i, ref.tokens.tolist(), ref.parents.tolist(), ref.depths.tolist())
        assert torch.equal(bt.scores[i, : len(ref)], ref.scores)


needs_c_batch = pytest.mark.skipif(not hasattr(tree_mod._hosttree, "batch_best_first"),
                                   reason="the C tree build is not compiled here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits (float32 as int32: -0.0 and NaN payloads compared too)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@needs_c_batch
@pytest.mark.parametrize("N", [1, 3, 5])
def test_the_c_batched_build_is_the_torch_build_bit_for_bit(N):
    """batch_best_first_tensors' one C call (a CPU's default) gives the torch ops' tensors (the composite
    `_batch_tree_build` after `_ranked_costs`) bit for bit, dtypes and shapes included, and row by row the single-stream
    C build's tree: ties, -inf, NaN, positive values and signed zeros; trees cut by the depth (V = 5) and by the
    budget. (Each build is also checked against the reference: here and in tests/test_tree.py.)"""
    from ddtree.engine.batch_tree import _batch_best_first_host, batch_best_first_tensors
    from ddtree.engine.kernels.tree import _batch_tree_build
    from ddtree.engine.tree import _best_first_host, _ranked_costs

    for case, (L, V, kind) in enumerate([(L, V, kind) for L in (1, 3, 15) for V in (5, 300)
                                         for kind in ("plain", "ties", "inf", "odd", "zeros")]):
        lp = _logprobs(N, L, V, seed=case, kind="ties" if kind == "zeros" else kind)
        if kind == "zeros":  # exact zeros of either sign and positive values (read as 0) among ties
            g = torch.Generator().manual_seed(case)
            lp[torch.rand(N, L, V, generator=g) < 0.2] = -0.0
            lp[torch.rand(N, L, V, generator=g) < 0.1] = 0.0
            lp[torch.rand(N, L, V, generator=g) < 0.1] = 0.25
        roots = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(case))
        for budget in (1, 4, 16, 64):
            n = 1 + tree_size(budget, L, V)
            what = (N, L, V, kind, budget)
            got = batch_best_first_tensors(roots, lp, budget)
            assert _batch_best_first_host(roots, lp, budget, n) is not None, what  # (the C call, not a fallback)
            torch_ops = batch_best_first_tensors(roots, lp, budget, host=False)
            composite = _batch_tree_build(*_ranked_costs(lp, budget), roots, None, n)
            tokens, parents, depths, valid, sizes, anc, aidx, scores = got
            for name, a, b in zip(("tokens", "parents", "depths", "scores", "aidx", "anc"),
                                  (tokens, parents, depths, scores, aidx, anc), composite, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
                assert torch.equal(_bits(a), _bits(b)), (what, name)
            for a, b in zip(got, torch_ops, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what
            assert valid.all() and sizes.tolist() == [n] * N
            for i in range(N):
                one = _best_first_host(roots[i], lp[i], budget)
                assert len(one) == n, what
                assert tokens[i].tolist() == one.tokens.tolist() and parents[i].tolist() == one.parents.tolist()
                assert depths[i].tolist() == one.depths.tolist() and torch.equal(_bits(scores[i]), _bits(one.scores))
                assert torch.equal(anc[i], one.ancestor_matrix())
                assert torch.equal(aidx[i, :, : one.depth_bound + 1], one.ancestor_index())
                assert not aidx[i, :, one.depth_bound + 1:].any()  # past the tree's depth: the root


@needs_c_batch
def test_the_c_batched_build_refuses_wrong_arrays():
    """Wrong dtypes, shapes and layouts, and outputs of another node count than the tree's: a TypeError / ValueError
    naming the argument, never a misread."""
    batch_best_first = tree_mod._hosttree.batch_best_first
    N, L, V, budget = 2, 3, 4, 6
    n = 1 + tree_size(budget, L, V)
    lp = _logprobs(N, L, V, seed=0, kind="plain").numpy()
    roots = np.arange(N, dtype=np.int64)

    def outs(n=n, W=min(L, n - 1) + 1, **change):
        arrays = {"tokens": np.empty((N, n), np.int64), "parents": np.empty((N, n), np.int64),
                  "depths": np.empty((N, n), np.int64), "scores": np.empty((N, n), np.float32),
                  "aidx": np.empty((N, n, W), np.int64), "anc": np.empty((N, n, n), np.bool_)}
        arrays.update(change)
        return list(arrays.values())

    assert batch_best_first(lp, budget, roots, *outs()) is None  # the right arrays
    bad = [
        ((lp[0], budget, roots, *outs()), ValueError, "'logprobs' must have 3 dimension"),
        ((lp.astype(np.float64), budget, roots, *outs()), TypeError, "'logprobs' must be float32"),
        ((lp, 0, roots, *outs()), ValueError, "budget must be in"),
        ((lp, budget, roots[:1], *outs()), ValueError, "'roots' must have 2 entries"),
        ((lp, budget, roots.astype(np.int32), *outs()), TypeError, "'roots' must be int64"),
        ((lp, budget, roots, *outs(n=budget + 2)), ValueError, "'tokens' must have"),
        ((lp, budget, roots, *outs(n=n - 1)), ValueError, "row 0's tree has 7 nodes, the outputs 6"),
        ((lp, budget, roots, *outs(W=L + 2)), ValueError, "'aidx' must have 4 entries along dimension 2"),
        ((lp, budget, roots, *outs(scores=np.empty((n, N), np.float32).T)), ValueError, "'scores' must be C-contig"),
        ((lp, budget, roots, *outs(anc=np.empty((N, n, n), np.uint8))), TypeError, "'anc' must be bool"),
    ]
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            batch_best_first(*args)


def test_the_batched_build_takes_the_torch_ops_where_asked_or_where_no_c_build_serves(monkeypatch):
    """host=False, a budget per stream, and a CPU without the C extension: the torch ops (the same tensors)."""
    from ddtree.engine import batch_tree

    lp, roots = _logprobs(2, 4, 9, seed=3, kind="ties"), torch.tensor([1, 2])
    want = batch_tree.batch_best_first_tensors(roots, lp, 12)
    calls = []
    real = batch_tree._batch_best_first_host
    monkeypatch.setattr(batch_tree, "_batch_best_first_host", lambda *a: calls.append(1) or real(*a))
    for kw in ({"host": False}, {"budgets": torch.tensor([12, 12])}):
        got = batch_tree.batch_best_first_tensors(roots, lp, 12, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and not calls
    monkeypatch.setattr(tree_mod, "_hosttree", None)
    got = batch_tree.batch_best_first_tensors(roots, lp, 12)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and not calls
    with pytest.raises(RuntimeError, match="make install"):
        batch_tree.batch_best_first_tensors(roots, lp, 12, host=True)


def test_chain_and_root_trees_and_cuts():
    """Chains: root then the row's tokens in a line; roots alone; with_sizes cuts rows to a prefix, padding the rest
    (a chain stays a chain)."""
    roots, toks = torch.tensor([4, 5, 6]), torch.tensor([[1, 2, 3], [3, 2, 1], [0, 0, 0]])
    chains = batch_chain_trees(roots, toks)
    assert chains.is_chain and chains.depth_bound == 3
    for i in range(3):
        _check_row(chains, i, [int(roots[i])] + toks[i].tolist(), [-1, 0, 1, 2], [0, 1, 2, 3])
    ar = batch_root_trees(roots)
    assert ar.is_chain and ar.width == 1 and ar.depth_bound == 0
    for i in range(3):
        _check_row(ar, i, [int(roots[i])], [-1], [0])
    cut = with_sizes(chains, torch.tensor([1, 3, 4]))
    assert cut.is_chain
    _check_row(cut, 0, [4], [-1], [0])
    _check_row(cut, 1, [5, 3, 2], [-1, 0, 1], [0, 1, 2])
    _check_row(cut, 2, [6, 0, 0, 0], [-1, 0, 1, 2], [0, 1, 2, 3])
    lp = _logprobs(2, 4, 6, seed=1, kind="plain")
    tree = batch_best_first(torch.tensor([1, 2]), lp, 12)
    cut = with_sizes(tree, torch.tensor([5, 13]))
    ref = best_first_reference(1, lp[0], 12)
    _check_row(cut, 0, ref.tokens[:5].tolist(), ref.parents[:5].tolist(), ref.depths[:5].tolist())
    assert torch.equal(cut.tokens[1], tree.tokens[1]) and int(cut.sizes[1]) == 13


def _stack(trees) -> BatchTree:
    """DraftTrees of different sizes as one BatchTree, padded, built in Python (the layout's definition)."""
    T = max(len(t) for t in trees)
    rows = [(t.tokens.tolist(), t.parents.tolist(), t.depths.tolist()) for t in trees]
    pad = lambda xs, v: xs + [v] * (T - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(r[0], 0) for r in rows])
    parents = torch.tensor([pad(r[1], 0) for r in rows])
    depths = torch.tensor([pad(r[2], 1) for r in rows])
    sizes = torch.tensor([len(t) for t in trees])
    valid = torch.arange(T)[None] < sizes[:, None]
    anc = torch.tensor([_ancestors(pad(r[1], 0))[0] for r in rows])
    return BatchTree(tokens, parents, depths, valid, sizes, anc, depth_bound=int(depths.max()))


def _following(tree: BatchTree, rng: random.Random, V: int) -> torch.Tensor:
    """Random choices [N, T] that follow a random root-to-node path of each row (any node, padding included), then
    differ from every child at its end (the walk's answer is known only to the reference)."""
    N, T = tree.tokens.shape
    choice = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    for i in range(N):
        node = rng.randrange(T)
        while parents[i][node] >= 0:
            choice[i, parents[i][node]] = tokens[i][node]
            node = parents[i][node]
    return choice


@pytest.mark.parametrize("N", [1, 3, 5])
def test_batch_walk_is_the_reference_walk_per_stream(N):
    """batch_walk against walk_reference on each row's valid tree, on best-first, random, chain and cut trees, with
    choices that follow the trees deep; padding nodes never accepted, even where their token 0 is the choice."""
    rng = random.Random(N)
    V = 5
    trees = [batch_best_first(torch.arange(N), _logprobs(N, 6, V, seed=N, kind="ties"), 20),
             _stack([random_tree(rng.randrange(1, 15), V, rng, root=i) for i in range(N)]),
             batch_chain_trees(torch.arange(N), torch.randint(0, 2, (N, 6))),
             batch_root_trees(torch.arange(N))]
    trees += [with_sizes(trees[0], torch.randint(1, 22, (N,))), with_sizes(trees[2], torch.randint(1, 8, (N,))),
              batch_best_first(torch.arange(N), _logprobs(N, 4, V, seed=9, kind="plain"), 12, torch.randint(0, 13, (N,)))]
    for tree in trees:
        for _ in range(12):
            choice = _following(tree, rng, V)
            if rng.random() < 0.3:
                choice[:, 0] = 0  # padding's token at the root
            w = batch_walk(tree, choice)
            assert w.path.shape == (N, tree.depth_bound + 1)
            for i in range(N):
                path, tokens = walk_reference(tree.row(i), choice[i])
                assert w.tokens[i] == tokens
                assert w.path[i].tolist() == path + [path[-1]] * (tree.depth_bound + 1 - len(path))
                assert int(w.lengths[i]) == len(path) and int(w.next_root[i]) == tokens[-1]


def test_best_first_and_walk_ops_do_not_grow_with_streams():
    """A round's tree side (DDTree: batch_best_first, with and without a budget per stream; DFlash: a chain; AR: the
    roots) and its walk dispatch the same ops at 1 and 8 streams, and read the device once (the walk's): on the path
    a CUDA run takes (the torch ops; a CPU's C build reads its logits on the host)."""
    L, V, budget = 15, 256, 64
    builds = {"ddtree": lambda roots, lp: batch_best_first(roots, lp, budget, host=False),
              "ddtree-budgets": lambda roots, lp: batch_best_first(roots, lp, budget, roots + 5),
              "chain": lambda roots, lp: batch_chain_trees(roots, lp[:, :, 0].long()),
              "ar": lambda roots, lp: batch_root_trees(roots)}
    for name, build in builds.items():
        counts = []
        for N in (1, 8):
            lp = _logprobs(N, L, V, seed=0, kind="plain")
            roots = torch.zeros(N, dtype=torch.long)
            T = build(roots, lp).width
            choice = torch.randint(0, V, (N, T))
            batch_walk(build(roots, lp), choice)  # constants built once
            with DispatchCount(stages=False) as ops:
                batch_walk(build(roots, lp), choice)
            assert ops.total(ops.syncs, exclude=()) == 1, (name, dict(ops.sync_names))
            counts.append(ops.total(ops.ops, exclude=()))
        assert counts[0] == counts[1], (name, counts)


MASK = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_keyed_uniform_is_splitmix64():
    """The noise is the documented splitmix64 hash in unsigned 64-bit arithmetic (Python integers): the int64 ops
    wrap and shift as unsigned ones, negative seeds and large positions included."""
    gold = 0x9E3779B97F4A7C15
    seeds, positions = torch.tensor([0, 7, -3, 2**40]), torch.tensor([[0, 1], [5, 10**9], [3, 3], [2**33, 17]])
    u = keyed_uniform(seeds, positions, 6)
    for i, s in enumerate(seeds.tolist()):
        for p in range(2):
            state = _splitmix((_splitmix((s * gold + positions[i, p].item()) & MASK) + gold) & MASK)
            want = [((_splitmix((state + _splitmix(v + gold)) & MASK) >> 41) + 0.5) / 2**23 for v in range(6)]
            assert u[i, p].tolist() == want


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_keyed_choice_samples_softmax(temperature):
    """A keyed sample follows softmax(logits / T) (scipy's chi-square; fixed seeds: a fixed verdict): over positions
    of one stream, and over streams at one position; a -inf logit is never drawn."""
    V, n = 8, 6000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    logits[5] = float("-inf")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    draws = [keyed_choice(logits.expand(1, n, V), temperature, torch.tensor([11]), torch.arange(n)[None])[0],
             keyed_choice(logits.expand(n, 1, V), temperature, torch.arange(n) * 7 + 1, torch.full((n, 1), 42))[:, 0]]
    for draw in draws:
        obs = torch.bincount(draw, minlength=V).double()
        assert obs[5] == 0
        keep = probs > 0
        assert chisquare(obs[keep].numpy(), (probs[keep] / probs[keep].sum() * n).numpy()).pvalue > 1e-3


def test_keyed_choice_does_not_depend_on_the_batch():
    """A stream's samples are the same alone and among 6 others (other seeds, logits, positions); they differ with
    the seed and with the position; temperature 0 is the argmax; the drafter's coupled choice is the same noise."""
    g = torch.Generator().manual_seed(0)
    V, T = 50, 9
    logits = torch.randn(7, T, V, generator=g)
    seeds = torch.tensor([5, 1, 2, 3, 4, 6, 7])
    positions = torch.randint(0, 1000, (7, T), generator=g)
    alone = keyed_choice(logits[:1], 1.0, seeds[:1], positions[:1])
    batch = keyed_choice(logits, 1.0, seeds, positions)
    assert torch.equal(alone[0], batch[0])
    assert torch.equal(keyed_draft_choice(logits, 1.0, seeds, positions), batch)
    u = keyed_uniform(torch.tensor([5, 6]), torch.tensor([[0, 1], [0, 1]]), V)
    assert not torch.equal(u[0, 0], u[0, 1]) and not torch.equal(u[0, 0], u[1, 0])
    assert torch.equal(keyed_choice(logits, 0.0, seeds, positions), logits.argmax(-1))
    from ddtree.engine.kernels import sampling

    chunk, sampling._CHUNK = sampling._CHUNK, 100  # the composite in passes of rows: the same samples
    try:
        assert torch.equal(keyed_choice(logits, 1.0, seeds, positions), batch)
    finally:
        sampling._CHUNK = chunk
    flat = keyed_uniform(torch.arange(40), torch.arange(40)[:, None] * 3, 500).flatten()
    assert 0 < float(flat.min()) and float(flat.max()) < 1 and abs(float(flat.mean()) - 0.5) < 0.01


def test_keyed_sampling_commits_what_ar_sampling_commits():
    """The property the keyed noise is for: a bigram target decoded by DDTree trees and by coupled sampled chains
    (the drafter a different bigram) commits, stream by stream, exactly the tokens AR sampling with the same seeds
    commits."""
    V, N, T_, steps = 12, 4, 0.9, 30
    g = torch.Generator().manual_seed(1)
    target = torch.randn(V, V, generator=g) * 2  # logits of the next token given the last
    drafter = target + torch.randn(V, V, generator=g)
    seeds = torch.tensor([3, 1, 4, 1 << 35])
    start = torch.tensor([0, 5, 5, 11])

    def ar() -> list[list[int]]:
        out, last = [[] for _ in range(N)], start.clone()
        for pos in range(1, steps + 1):
            last = keyed_choice(target[last][:, None], T_, seeds, torch.full((N, 1), pos))[:, 0]
            for i in range(N):
                out[i].append(int(last[i]))
        return out

    def speculative(method: str, L: int = 4) -> list[list[int]]:
        out, roots, pos = [[] for _ in range(N)], start.clone(), torch.zeros(N, dtype=torch.long)
        while min(len(o) for o in out) < steps:
            if method == "chain":  # the drafter samples its chain with the target's noise
                toks, last = [], roots
                for d in range(L):
                    last = keyed_draft_choice(drafter[last][:, None], T_, seeds, pos[:, None] + d + 1)[:, 0]
                    toks.append(last)
                tree = batch_chain_trees(roots, torch.stack(toks, 1))
            else:  # DDTree on the drafter's marginals along its greedy path
                lps, last = [], roots
                for _ in range(L):
                    lp = torch.log_softmax(drafter[last] / T_, -1)
                    lps.append(lp)
                    last = lp.argmax(-1)
                tree = batch_best_first(roots, torch.stack(lps, 1), 10)
            choice = keyed_choice(target[tree.tokens], T_, seeds, positions_after(pos, tree.depths))
            w = batch_walk(tree, choice)
            for i in range(N):
                out[i] += w.tokens[i]
            roots, pos = w.next_root, pos + w.lengths
        return [o[:steps] for o in out]

    want = ar()
    assert speculative("chain") == want
    assert speculative("tree") == want


@pytest.mark.gpu  # on a GPU the kernel runs for real; here, interpreted
def test_keyed_choice_kernel_is_the_composite():
    """ddtree::keyed_choice's Triton kernel gives the composite's samples (float32 and bf16 logits, -inf, large and
    negative seeds and positions, a vocabulary over one block), and is one op a round whatever the streams."""
    from ddtree.engine.kernels import FusedOp
    from ddtree.testing.triton import interpreter

    op = FusedOp.registry["keyed_choice"]
    g = torch.Generator().manual_seed(0)
    with interpreter() as device:
        for N, T, V, dtype in ((3, 5, 50, torch.float32), (2, 3, 2500, torch.bfloat16), (1, 1, 7, torch.float32)):
            logits = (torch.randn(N, T, V, generator=g) * 2).to(dtype)
            logits[0, 0, :3] = float("-inf")
            seeds = torch.randint(-(2**62), 2**62, (N,), generator=g)
            positions = torch.randint(0, 2**40, (N, T), generator=g)
            args = (logits.to(device), seeds.to(device), positions.to(device), 1 / 0.7)
            assert torch.equal(op.run_triton(*args), op.composite(*args))
        # strided views: every other stream's seed, a slice of the nodes
        logits, seeds = torch.randn(3, 6, 40, generator=g).to(device), torch.arange(6, device=device)
        args = (logits[:, 1:4], seeds[::2], torch.arange(18, device=device).view(3, 6)[:, 1:4], 2.0)
        assert torch.equal(op.run_triton(*args), op.composite(*args))
    for N in (1, 8):
        args = torch.zeros(N, 4, 9), 0.8, torch.arange(N), torch.zeros(N, 4, dtype=torch.long)
        with DispatchCount(stages=False) as ops:
            keyed_choice(*args)
        assert ops.names["keyed_choice"] == 1 and ops.total(ops.kernel_ops, exclude=()) == 1, dict(ops.kernel_names)


@pytest.mark.gpu  # on a GPU the kernel runs for real; here, interpreted
@pytest.mark.parametrize("case", [(3, 3, 7, 7), (2, 2, 5, 8)], ids=lambda c: "N{}-L{}-V{}-b{}".format(*c))
def test_batch_tree_build_kernel_is_the_composite(case):
    """ddtree::batch_tree_build's kernel (tree_build_kernel, a program a stream) gives the batched composite's outputs
    bit for bit (ties, NaN, -inf), with and without a size per stream."""
    from ddtree.engine import batch_tree
    from ddtree.engine.kernels import FusedOp
    from ddtree.testing.triton import interpreter

    N, L, V, budget = case
    op = FusedOp.registry["batch_tree_build"]
    lp = _logprobs(N, L, V, seed=sum(case), kind="odd" if L > 1 else "ties")
    n = 1 + tree_size(budget, L, V)
    with interpreter() as device:
        cost, ranked = batch_tree._ranked_costs(lp.to(device), budget)
        roots = torch.arange(N, device=device) + 3
        for sizes in (None, torch.tensor([1, n, 3, 2][:N], device=device)):
            got, want = op.run_triton(cost, ranked, roots, sizes, n), op.composite(cost, ranked, roots, sizes, n)
            for name, a, b in zip(("tokens", "parents", "depths", "scores", "aidx", "anc"), got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_batched_round_traces_as_one_graph(backend):
    """torch.compile(fullgraph=True) of a batched round's tree side (the build, keyed choices, the walk's device part):
    one graph, no break, no recompile across logits, and the eager results bit for bit (dynamo's trace alone; with
    inductor's kernels, slow)."""
    import torch._dynamo.utils as dynamo_utils

    from ddtree.engine.batch_tree import batch_best_first_tensors, batch_tree_of_tensors, batch_walk_tensors

    table = torch.randn(30, 30, generator=torch.Generator().manual_seed(0))

    def round_(roots, logprobs, seeds, root_positions):
        tree = batch_tree_of_tensors(*batch_best_first_tensors(roots, logprobs, 16))
        choice = keyed_choice(table[tree.tokens], 0.8, seeds, positions_after(root_positions, tree.depths))
        return batch_walk_tensors(tree, choice)

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(round_, fullgraph=True, dynamic=False, backend=backend)
    for seed in range(3):
        args = (torch.arange(4), _logprobs(4, 5, 30, seed, "ties"), torch.arange(4) + seed, torch.tensor([3, 9, 4, 7]))
        got, want = compiled(*args), round_(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_full_trees_take_their_layout_from_the_parents():
    """batch_full_trees: N random trees of one node count (parents first) as one BatchTree, every node valid; its
    ancestor matrix and index those of a walk up the parents."""
    rng = random.Random(3)
    trees = [random_tree(9, 6, rng, root=i) for i in range(4)]
    stack = lambda f: torch.stack([f(t) for t in trees])  # noqa: E731
    bound = max(int(t.depths.max()) for t in trees)
    full = batch_full_trees(stack(lambda t: t.tokens), stack(lambda t: t.parents), stack(lambda t: t.depths),
                            depth_bound=bound)
    assert not full.is_chain and full.width == 9 and full.depth_bound == bound
    for i, t in enumerate(trees):
        _check_row(full, i, t.tokens.tolist(), t.parents.tolist(), t.depths.tolist())
