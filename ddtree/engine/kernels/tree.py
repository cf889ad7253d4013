"""DDTree's best-first tree build after the per-position top-k as one launch: `ddtree::tree_build`.

`ddtree.engine.tree.best_first_tensors` ranks each position's tokens (one top-k) and then builds the tree: depth by
depth, the candidate pairs' costs, a stable sort and the best `budget` (three ops a depth), then the tree's cells
(one global stable sort of the depths' lists) and their tokens, parents, depths, scores, ancestor index and ancestor
matrix (about 35 ops): about 85 ops at budget 64 and 15 positions, each a launch on a GPU without graphs (the views
aside). The composite here is exactly those ops (what
best_first_tensors ran before, bitwise; a compiled graph calls it directly); the Triton kernel does all of it in one
program of one launch:

* each sort is `tl.sort` of unique int64 keys (the float32 cost's bits << 32 | the index): costs are >= +0.0, so their
  bits order as they do, NaN (no candidate) is made one bit pattern above +inf and sorts last, and equal costs keep
  the index order, as torch's stable sort does;
* a depth's pairs read the depth above's list through a global scratch row (stored, `tl.debug_barrier()`, then the
  gathered load), and a pair's cost is the parent's plus the child's in float32, the composite's one rounding;
* the global selection keeps the best cells of the lists seen so far, merged one depth at a time (a sort of twice the
  tree's size), then sorts the chosen cells into the flat layout;
* a parent's flat index is the count of the tree's cells below the parent's cell (searchsorted's answer), the
  ancestor index repeated parent lookups (the root repeats past itself), the ancestor matrix zeros then a True at
  every (node, ancestor) pair, as the composite's scatter.

cost [L, budget] float32 (costs >= +0.0, NaN past the vocabulary), ranked [L, budget] long (the tokens by rank),
root (the root token, any integer tensor of one element), n (the tree's nodes, root included); returns (tokens,
parents, depths, scores, aidx, anc) as `best_first_tensors` documents.

`ddtree::batch_tree_build` is the same build for N streams at once (the batched round,
ddtree.engine.batch_tree.batch_best_first): cost, ranked [N, L, budget], roots [N], an optional size per stream (the
first sizes[i] nodes of the best-first order, the rest padding); outputs with a leading stream dimension. Its
composite is the composite above with that dimension (the same sums and stable sorts, row by row); on CUDA the same
kernel, one program a stream (`BATCHED`: each program's blocks offset by its stream), so a round is one launch
whatever N.
"""

from __future__ import annotations

import functools
import math
from functools import lru_cache

import torch

from ddtree.engine.kernels import FusedOp, jit_cache

__all__ = ["batch_tree_build", "tree_build"]


@lru_cache(maxsize=64)
def _selection_constants(budget: int, L: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tree build's constants, built once per device: (parent rank p, child rank r) of the candidates a depth
    keeps, the root's list, depth 1's list tail, each candidate's parent cell, -1.

    A depth's candidates are pairs (p, r): the p-th best node of the depth above and its child of rank r. Only pairs
    with (p + 1)(r + 1) <= budget can be among a depth's best `budget`: every (p', r') <= (p, r) is at least as good
    (both lists are sorted) and comes earlier (p-major), and there are (p + 1)(r + 1) of them. Listed p-major: the
    definition's order among equal scores (the parent earlier, then the lower rank); the first `budget` are (0, r)."""
    ps, rs = [], []
    for p in range(budget):
        ps += [p] * (budget // (p + 1))
        rs += range(budget // (p + 1))
    nothing = torch.full((len(ps),), math.nan, device=device)  # NaN: no candidate (sorts last)
    root_list = nothing.clone()  # the depth-0 list: the root (cost 0), then nothing
    root_list[0] = 0.0
    tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    parent_rank = tensor(ps)
    parent_cell = torch.arange(0, L * budget, budget, device=device)[:, None] + parent_rank  # [L, pairs]: at depth d + 1
    return parent_rank, tensor(rs), root_list, nothing[budget:], parent_cell, tensor([-1])


def _tree_build(cost: torch.Tensor, ranked: torch.Tensor, root: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The composite: best_first_tensors' ops from the ranks' costs on (see its docstring), the batched composite's
    with one stream."""
    return tuple(t[0] for t in _batch_tree_build(cost[None], ranked[None], root.reshape(1), None, n))


def _ancestor_index(parents: torch.Tensor, bound: int) -> torch.Tensor:
    """aidx[i, h] = the h-th ancestor of i (the root repeats past it), h <= bound: by doubling, three ops a doubling."""
    up = parents.clamp(min=0)
    hops = torch.stack([torch.arange(parents.shape[0], device=parents.device), up], dim=1)  # hops 0 and 1
    far = up  # the hops.shape[1] / 2-th ancestor
    while hops.shape[1] <= bound:  # hops w.. 2w - 1 of i: hops 0.. w - 1 of its w-th ancestor
        far = far[far]
        hops = torch.cat([hops, hops[far]], dim=1)
    return hops if hops.shape[1] == bound + 1 else hops[:, : bound + 1]


def _ancestor_matrix(aidx: torch.Tensor) -> torch.Tensor:
    n = aidx.shape[0]
    return torch.zeros(n, n, dtype=torch.bool, device=aidx.device).scatter_(1, aidx, True)


def _batch_tree_build(cost: torch.Tensor, ranked: torch.Tensor, roots: torch.Tensor, sizes: torch.Tensor | None,
                      n: int) -> tuple[torch.Tensor, ...]:
    """The composite, N streams at once (cost, ranked [N, L, budget], roots [N]; outputs [N, ...]): best_first_tensors'
    ops after the top-k (see its docstring) with a stream dimension, the same float32 sums and stable sorts row by
    row (`_tree_build` is its one-stream call). sizes (long [N], each 1..n) or None: row i keeps
    the first sizes[i] cells of the best-first order (the tree of budget sizes[i] - 1, in its own flat layout), the
    rest padding (token 0, parent 0, depth 1, score -inf; ancestors itself and the root)."""
    N, L, budget = cost.shape
    dev = cost.device
    # traced (ddtree.engine.compiled): the constants become the graph's own, built without the cache wrapper
    constants = _selection_constants.__wrapped__ if torch.compiler.is_compiling() else _selection_constants
    parent_rank, child_rank, root_list, tail, parent_cell, minus_one = constants(budget, L, dev)
    P = parent_rank.shape[0]
    child_cost = cost.index_select(2, child_rank).unbind(1)  # L x [N, P]
    # depth 1: the root's children by rank (its first `budget` pairs are (0, r), pair j of rank j: child_rank maps j to j)
    lists, pairs = [root_list.expand(N, P), torch.cat([cost[:, 0], tail.expand(N, -1)], dim=1)], [child_rank.expand(N, P)]
    for d in range(1, L):
        best, pair = torch.sort(lists[-1].index_select(1, parent_rank) + child_cost[d], dim=1, stable=True)
        lists.append(best)
        pairs.append(pair)
    grid = torch.stack(lists, dim=1)[:, :, :budget].reshape(N, -1)  # cell d * budget + j: the j-th best of depth d
    order = torch.sort(grid, dim=1, stable=True).indices[:, :n]  # the best-first order (root first)
    if sizes is not None:  # past a row's size: a cell past every cell (sorted last)
        real = torch.arange(n, device=dev) < sizes[:, None]
        order = torch.where(real, order, (L + 1) * budget)
    cells = order.sort(dim=1).values  # the tree's cells, depth-major: the flat layout
    pair = torch.stack(pairs, dim=1)[:, :, :budget]  # [N, L, budget]: the pair behind each cell of depths 1..L
    below = cells[:, 1:] - budget  # the nodes' cells in `pair`
    if sizes is not None:
        below = below.clamp(max=L * budget - 1)
    tokens = torch.cat([roots.reshape(N, 1).to(dev, torch.long),
                        ranked.gather(2, child_rank[pair]).view(N, -1).gather(1, below)], dim=1)
    parent_of = parent_cell.expand(N, L, P).gather(2, pair).view(N, -1).gather(1, below)
    # a parent's flat index: its place in cells
    parents = torch.cat([minus_one.expand(N, 1), torch.searchsorted(cells, parent_of)], dim=1)
    depths = torch.div(cells, budget, rounding_mode="floor")
    if sizes is None:
        scores = 0.0 - grid.gather(1, cells)
    else:
        scores = torch.where(real, 0.0 - grid.gather(1, cells.clamp(max=(L + 1) * budget - 1)), -math.inf)
        tokens = torch.where(real, tokens, 0)
        parents = torch.where(real, parents, 0)
        parents[:, :1] = -1
        depths = torch.where(real, depths, 1)
    aidx = _batch_ancestor_index(parents, min(L, n - 1))
    return tokens, parents, depths, scores, aidx, torch.zeros(N, n, n, dtype=torch.bool, device=dev).scatter_(2, aidx, True)


def _batch_ancestor_index(parents: torch.Tensor, bound: int) -> torch.Tensor:
    """_ancestor_index with a stream dimension: aidx[i, a, h] the h-th ancestor of node a of row i (the root repeating
    past it), h <= bound, long [N, T, bound + 1], contiguous."""
    N, T = parents.shape
    up = parents.clamp(min=0)
    hops = torch.stack([torch.arange(T, device=parents.device).expand(N, T), up], dim=2)  # hops 0 and 1
    if bound == 0:
        return hops[:, :, :1].contiguous()
    far = up  # the hops.shape[2] / 2-th ancestor
    while hops.shape[2] <= bound:  # hops w.. 2w - 1 of a (at most hop `bound`): hops 0.. w - 1 of its w-th ancestor
        w = hops.shape[2]
        far = far.gather(1, far)
        hops = torch.cat([hops, hops.gather(1, far[:, :, None].expand(N, T, min(w, bound + 1 - w)))], dim=2)
    return hops


@jit_cache()
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tree_build_kernel(cost_ptr, ranked_ptr, root_ptr, prank_ptr, crank_ptr,
                          tok_ptr, par_ptr, dep_ptr, score_ptr, aidx_ptr, anc_ptr,
                          grid_ptr, pair_ptr, cell_ptr, size_ptr, L, P, n, bound,
                          B: tl.constexpr, PP: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr,
                          ZB: tl.constexpr, BATCHED: tl.constexpr, HAS_SIZES: tl.constexpr):
        LAST: tl.constexpr = 0x7FFFFFFFFFFFFFFF  # past every key: padding
        if BATCHED:  # one program a stream (ddtree::batch_tree_build; ddtree::tree_build: one program, no offsets)
            pid = tl.program_id(0).to(tl.int64)
            cost_ptr += pid * L * B
            ranked_ptr += pid * L * B
            root_ptr += pid
            tok_ptr += pid * n
            par_ptr += pid * n
            dep_ptr += pid * n
            score_ptr += pid * n
            aidx_ptr += pid * n * (bound + 1)
            anc_ptr += pid * n * n
            grid_ptr += pid * (L + 1) * B
            pair_ptr += pid * L * B
            cell_ptr += pid * n
        if HAS_SIZES:  # the stream's own node count (the rest padding)
            size = tl.load(size_ptr + tl.program_id(0)).to(tl.int32)
        else:
            size = n
        LOW: tl.constexpr = 0x7FFFFFFF  # the index bits (indices < 2 ** 31; an int32 mask, no unsigned constant)
        NAN_BITS: tl.constexpr = 0x7FC00000
        NAN_KEY: tl.constexpr = 0x7FC0000000000000  # NaN_BITS << 32
        # grid (scratch) [L + 1, B] float32: each depth's best B costs (row 0: the root, then NaN); pairs (scratch)
        # [L, B] int32: the pair behind each cell of depths 1..L; cells (scratch) [n]: the tree's cells in order
        j = tl.arange(0, NB)
        in_row = j < B
        nan = tl.full([NB], NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(grid_ptr + j, tl.where(j == 0, 0.0, nan), mask=in_row)
        tl.store(grid_ptr + B + j, tl.load(cost_ptr + j, mask=in_row, other=0.0), mask=in_row)
        tl.store(pair_ptr + j, j.to(tl.int32), mask=in_row)  # depth 1: pair j is the root's child of rank j
        tl.debug_barrier()

        # depth by depth: the pairs' costs (parent's + child's), sorted; the best B are the next depth's list
        q = tl.arange(0, PP)
        in_pairs = q < P
        prank = tl.load(prank_ptr + q, mask=in_pairs, other=0)
        crank = tl.load(crank_ptr + q, mask=in_pairs, other=0)
        for d in range(1, L):
            row = d * B  # (at most 32 * 512: int32 is wide enough)
            parent = tl.load(grid_ptr + row + prank, mask=in_pairs, other=0.0)
            child = tl.load(cost_ptr + row + crank, mask=in_pairs, other=0.0)
            v = parent + child
            bits = tl.where(v != v, NAN_BITS, v.to(tl.int32, bitcast=True))  # NaN: one pattern, above +inf
            key = tl.where(in_pairs, (bits.to(tl.int64) << 32) | q, LAST)  # unique keys ordered as a stable sort
            key = tl.sort(key)
            best = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            tl.store(grid_ptr + row + B + q, best, mask=q < B)
            tl.store(pair_ptr + row + q, (key & LOW).to(tl.int32), mask=q < B)
            tl.debug_barrier()

        # the tree's cells: the best NB of all cells (key: cost, cell), kept across the depths; then in cell order
        m = tl.arange(0, 2 * NB)
        kept = tl.where(m == 0, 0, tl.where(m < B, m.to(tl.int64) | NAN_KEY, LAST))  # depth 0, sorted
        jm = m - NB
        in_new = (m >= NB) & (jm < B)
        for d in range(1, L + 1):
            cell = d * B + jm
            v = tl.load(grid_ptr + cell, mask=in_new, other=0.0)
            bits = tl.where(v != v, NAN_BITS, v.to(tl.int32, bitcast=True))
            new = tl.where(in_new, (bits.to(tl.int64) << 32) | cell, LAST)
            kept = tl.sort(tl.where(m < NB, kept, new))
        cells = tl.sort(tl.where(m < size, kept & LOW, LAST))
        tl.store(cell_ptr + m, cells, mask=m < n)
        tl.debug_barrier()

        # the nodes: token, depth, score, and the parent's flat index (the count of cells below the parent's cell);
        # padding (past size): token 0, parent 0, depth 1, score -inf
        i = tl.arange(0, NB)
        live = i < n
        real = i < size
        node = real & (i > 0)
        c = tl.load(cell_ptr + i, mask=real, other=0)
        depth = c // B
        above = tl.maximum(depth - 1, 0) * B
        pair = tl.load(pair_ptr + above + c % B, mask=node, other=0)
        crank_i = tl.load(crank_ptr + pair, mask=node, other=0)
        prank_i = tl.load(prank_ptr + pair, mask=node, other=0)
        token = tl.load(ranked_ptr + above + crank_i, mask=node, other=0)
        token = tl.where(i == 0, tl.load(root_ptr).to(tl.int64), token)
        parent_cell = (above + prank_i).to(tl.int32)  # (cells < 2 ** 31: compared in int32, a tile of KB columns)
        count = tl.zeros([NB], tl.int32)
        for k0 in range(0, n, KB):
            k = k0 + tl.arange(0, KB)
            ck = tl.load(cell_ptr + k, mask=k < size, other=LOW).to(tl.int32)
            count += tl.sum((ck[None, :] < parent_cell[:, None]).to(tl.int32), axis=1)
        score = 0.0 - tl.load(grid_ptr + c, mask=real, other=0.0)
        tl.store(tok_ptr + i, token, mask=live)
        tl.store(par_ptr + i, tl.where(i == 0, -1, tl.where(real, count, 0)).to(tl.int64), mask=live)
        tl.store(dep_ptr + i, tl.where(real, depth, 1), mask=live)
        tl.store(score_ptr + i, tl.where(real, score, float("-inf")), mask=live)

        # the ancestor matrix's zeros, then (after the barrier: parents and zeros written) the ancestor index and a
        # True at each (node, ancestor)
        total = n * n
        for z0 in range(0, total, ZB):
            z = z0 + tl.arange(0, ZB)
            tl.store(anc_ptr + z, tl.zeros([ZB], tl.int1), mask=z < total)
        tl.debug_barrier()
        width = bound + 1
        cur = i.to(tl.int64)
        for h in range(0, width):
            tl.store(aidx_ptr + i * width + h, cur, mask=live)
            tl.store(anc_ptr + i * n + cur, tl.full([NB], 1, tl.int1), mask=live)
            cur = tl.maximum(tl.load(par_ptr + cur, mask=live, other=0), 0)

    return tree_build_kernel


def _launch(cost: torch.Tensor, ranked: torch.Tensor, root: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    L, budget = cost.shape
    if (cost.dtype != torch.float32 or ranked.dtype != torch.long or ranked.shape != cost.shape
            or not cost.is_contiguous() or not ranked.is_contiguous() or root.numel() != 1 or not 1 <= n <= budget + 1
            or budget > 1024):
        return _tree_build(cost, ranked, root, n)  # other layouts, and trees past one program's registers: the composite
    dev = cost.device
    parent_rank, child_rank = _selection_constants(budget, L, dev)[:2]
    pairs = parent_rank.shape[0]
    bound = min(L, n - 1)
    root = root.reshape(1).to(dev, torch.long)
    long = functools.partial(torch.empty, dtype=torch.long, device=dev)
    tokens, parents, depths, aidx, cells = long(n), long(n), long(n), long(n, bound + 1), long(n)
    scores = torch.empty(n, dtype=torch.float32, device=dev)
    anc = torch.empty(n, n, dtype=torch.bool, device=dev)
    grid = torch.empty((L + 1) * budget, dtype=torch.float32, device=dev)
    pair = torch.empty(L * budget, dtype=torch.int32, device=dev)
    _kernels()[(1,)](cost, ranked, root, parent_rank, child_rank, tokens, parents, depths, scores, aidx, anc, grid,
                     pair, cells, None, L, pairs, n, bound, BATCHED=False, HAS_SIZES=False, **_meta(budget, pairs, n))
    return tokens, parents, depths, scores, aidx, anc


@lru_cache(maxsize=64)
def _meta(budget: int, pairs: int, n: int) -> dict[str, int]:
    """The kernel's block sizes (powers of 2, at least 16) and warps: PP over the candidate pairs, NB over a depth's
    list and the tree, KB the columns of the parent count's [NB, KB] tile, ZB the ancestor matrix's zeros. (Cached:
    not to be changed.)"""
    import triton

    nb = max(16, triton.next_power_of_2(max(budget, n)))
    pp = max(16, triton.next_power_of_2(pairs))
    return {"B": budget, "PP": pp, "NB": nb, "KB": max(16, min(nb, 4096 // nb)), "ZB": 1024,
            "num_warps": 4 if pp <= 1024 else 8 if pp <= 4096 else 16}


_TREE_BUILD = FusedOp("tree_build(Tensor cost, Tensor ranked, Tensor root, int n) -> "
                      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _tree_build, _launch,
                      timed=True)  # (one program's sorts against ~85 launches: the faster one runs, per budget)

tree_build = _TREE_BUILD.op


def _batch_launch(cost: torch.Tensor, ranked: torch.Tensor, roots: torch.Tensor, sizes: torch.Tensor | None,
                  n: int) -> tuple[torch.Tensor, ...]:
    """The batched build: tree_build_kernel, one program a stream."""
    N, L, budget = cost.shape
    if (cost.dtype != torch.float32 or ranked.dtype != torch.long or ranked.shape != cost.shape
            or not cost.is_contiguous() or not ranked.is_contiguous() or roots.numel() != N
            or not 1 <= n <= budget + 1 or budget > 1024 or (sizes is not None and sizes.shape != (N,))):
        return _batch_tree_build(cost, ranked, roots, sizes, n)
    dev = cost.device
    parent_rank, child_rank = _selection_constants(budget, L, dev)[:2]
    pairs = parent_rank.shape[0]
    bound = min(L, n - 1)
    roots = roots.reshape(N).to(dev, torch.long)
    sizes = None if sizes is None else sizes.to(dev, torch.long).contiguous()
    long = functools.partial(torch.empty, dtype=torch.long, device=dev)
    tokens, parents, depths, aidx, cells = long(N, n), long(N, n), long(N, n), long(N, n, bound + 1), long(N, n)
    scores = torch.empty(N, n, dtype=torch.float32, device=dev)
    anc = torch.empty(N, n, n, dtype=torch.bool, device=dev)
    grid = torch.empty(N, (L + 1) * budget, dtype=torch.float32, device=dev)
    pair = torch.empty(N, L * budget, dtype=torch.int32, device=dev)
    if N:
        _kernels()[(N,)](cost, ranked, roots, parent_rank, child_rank, tokens, parents, depths, scores, aidx, anc,
                         grid, pair, cells, sizes, L, pairs, n, bound, BATCHED=True, HAS_SIZES=sizes is not None,
                         **_meta(budget, pairs, n))
    return tokens, parents, depths, scores, aidx, anc


_BATCH_TREE_BUILD = FusedOp("batch_tree_build(Tensor cost, Tensor ranked, Tensor roots, Tensor? sizes, int n) -> "
                            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _batch_tree_build, _batch_launch,
                            timed=True)  # (as tree_build: N programs' sorts against ~85 launches)

batch_tree_build = _BATCH_TREE_BUILD.op
