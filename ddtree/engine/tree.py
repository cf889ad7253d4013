"""Draft trees: the root (last committed token) plus proposed nodes, parents before children.

Every method proposes one: AR the root alone, DFlash a chain, DDTree the best-first
selection of `budget` prefixes under the drafter's per-position log-probabilities.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ddtree.engine.host import host_branch

try:  # the host tree build in C (setup.py compiles it where a compiler is found)
    from ddtree.engine import _hosttree
except ImportError:  # not compiled: the pure-Python builds give the same trees
    _hosttree = None

_F32 = struct.Struct("f")  # the host heap's float32 rounding


@dataclass
class DraftTree:
    """Flat tree. Index 0 is the root; parents[i] < i for every node i >= 1; parents[0] = -1.

    Siblings must carry distinct tokens (the walk follows the one child matching the target).
    scores are cumulative draft log-probabilities (0 for the root), for inspection only.
    """

    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long
    depths: torch.Tensor  # [n] long
    scores: torch.Tensor | None = None
    is_chain: bool = False
    depth_bound: int | None = None  # an upper bound on the depth, known without a host read
    _anc: torch.Tensor | None = field(default=None, repr=False)
    _aidx: torch.Tensor | None = field(default=None, repr=False)
    # (tokens, parents, depths, ancestor index) as NumPy arrays when the tree was built on the host (a CPU
    # device): the walk then runs there too
    _host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    # (tokens, first child, next sibling) as lists (-1: none; children in flat order), where the host build had
    # them: the greedy walk's index
    _walk_index: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def ancestor_index(self) -> torch.Tensor:
        """aidx[i, k] = the k-th ancestor of i (k = 0: i itself; the root once past it): long [n, bound + 1].

        O(n * depth) and built on the device without a host read: the depth bound is known on the host.
        """
        if self._aidx is not None:
            return self._aidx
        n = len(self)
        dev = self.tokens.device
        bound = self.depth_bound if self.depth_bound is not None else int(self.depths.max())
        if self.is_chain:
            hops = torch.arange(bound + 1, device=dev)
            self._aidx = (torch.arange(n, device=dev)[:, None] - hops[None, :]).clamp_(min=0)
            return self._aidx
        parent = self.parents.clamp(min=0)
        cols = [torch.arange(n, device=dev)]
        for _ in range(bound):
            cols.append(parent[cols[-1]])
        self._aidx = torch.stack(cols, dim=1)
        return self._aidx

    def ancestor_matrix(self) -> torch.Tensor:
        """anc[i, j] = j is i or an ancestor of i (bool [n, n]); computed once per tree."""
        if self._anc is not None:
            return self._anc
        n = len(self)
        dev = self.tokens.device
        if self.is_chain:
            self._anc = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
            return self._anc
        anc = torch.zeros(n, n, dtype=torch.bool, device=dev)
        self._anc = anc.scatter_(1, self.ancestor_index(), True)
        return self._anc


def root_tree(root: torch.Tensor) -> DraftTree:
    dev = root.device
    z = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(root.reshape(1).long(), torch.full_like(z, -1), z, is_chain=True, depth_bound=0)


def chain_tree(root: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
    """root followed by `tokens` in a line (DFlash)."""
    toks = torch.cat([root.reshape(1).long(), tokens.reshape(-1).long()])
    n = toks.shape[0]
    ar = torch.arange(n, device=toks.device)
    return DraftTree(toks, ar - 1, ar, is_chain=True, depth_bound=n - 1)


def tree_from_parents(tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor,
                      device: torch.device | str | None = None) -> DraftTree:
    """Build a tree from explicit lists (scripted proposers, tests). Validates the structure."""
    toks = torch.as_tensor(tokens, dtype=torch.long, device=device)
    par = torch.as_tensor(parents, dtype=torch.long, device=device)
    n = toks.shape[0]
    if par.shape[0] != n or n == 0 or int(par[0]) != -1:
        raise ValueError("tree needs parents[0] == -1 and one parent per token")
    pl = par.tolist()
    depth = [0] * n
    seen: set[tuple[int, int]] = set()
    tl = toks.tolist()
    for i in range(1, n):
        if not 0 <= pl[i] < i:
            raise ValueError(f"node {i}: parent {pl[i]} must precede it")
        if (pl[i], tl[i]) in seen:
            raise ValueError(f"node {i}: duplicate sibling token {tl[i]}")
        seen.add((pl[i], tl[i]))
        depth[i] = depth[pl[i]] + 1
    is_chain = pl == list(range(-1, n - 1))
    return DraftTree(toks, par, torch.tensor(depth, dtype=torch.long, device=toks.device), is_chain=is_chain,
                     depth_bound=max(depth))


# the host build prunes candidates from this budget on (bench/bench_tree.py --pair toy: a loss at 16, even at
# 64, 1.3-1.7x faster at 256 on the toy drafter's own blocks)
PRUNE_MIN_BUDGET = 128
# up to this budget the host build is a best-first heap (_best_first_heap), above it the per-depth passes
HEAP_MAX_BUDGET = 64


@lru_cache(maxsize=4096)  # the host build prunes: many (prev) sizes per budget
def _pair_lists(budget: int, prev: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parent rank p, child rank r) pairs that can reach a depth's top `budget`: (p+1)(r+1) <= budget.

    Pairs (p', r') with p' <= p and r' <= r all score at least as high, so any other pair
    has `budget` better ones at the same depth and can never be selected. Only p < prev (the
    previous depth's list) and r < k (the top-k per position) exist.
    """
    ps, rs = [], []
    for p in range(min(budget, prev)):
        width = min(budget // (p + 1), k)
        ps += [p] * width
        rs += range(width)
    return tuple(ps), tuple(rs)


@lru_cache(maxsize=64)
def _rank_pairs(budget: int, prev: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """_pair_lists on the device, cached there: a round copies nothing from the host."""
    ps, rs = _pair_lists(budget, prev, k)
    return torch.tensor(ps, dtype=torch.long, device=device), torch.tensor(rs, dtype=torch.long, device=device)


@lru_cache(maxsize=4096)
def _rank_pairs_host(budget: int, prev: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    ps, rs = _pair_lists(budget, prev, k)
    return np.asarray(ps, dtype=np.int64), np.asarray(rs, dtype=np.int64)


@lru_cache(maxsize=64)
def _layout_host(budget: int, L: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate of the flat (depth-major) list: its depth (1-based), and for depth >= 2 the offset of
    the previous depth's list. The sizes follow from (budget, L, k) alone, so this is built once."""
    sizes = [k]
    for _ in range(1, L):
        sizes.append(min(budget, len(_pair_lists(budget, sizes[-1], k)[0])))
    depth = np.repeat(np.arange(1, L + 1, dtype=np.int64), sizes)
    starts = np.cumsum([0] + sizes[:-1])
    return depth, np.repeat(starts[:-1].astype(np.int64), sizes[1:])


@lru_cache(maxsize=64)
def _depth_layout(budget: int, L: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """_layout_host on the device, built once there."""
    return tuple(torch.from_numpy(a).to(device) for a in _layout_host(budget, L, k))


def best_first_tree(root: torch.Tensor, logprobs: torch.Tensor, budget: int, *, host: bool | None = None) -> DraftTree:
    """The `budget` highest-scoring prefixes under cumulative draft log-probability.

    logprobs: [L, V] per-position log-probabilities (position d drafts depth d + 1).
    Per depth: top-k of each position, merged with the previous depth's best `budget` partial paths
    (a stable descending sort: equal scores keep the earlier candidate), then one stable global
    selection. Equal scores prefer the shallower node, then the earlier candidate, so the selection
    is a tree and deterministic. Nodes are in flat depth-major order, by score within a depth.

    host: build on the host (default on a CPU device: a few hundred tiny torch ops cost more than the
    arithmetic) or with torch ops on the logits' device (default elsewhere: no host read). On a CPU where the
    extension was compiled the build is one C call that takes each row's ranks itself (`_best_first_rows`), or
    where that cannot match torch.topk exactly (ties, NaN) one from topk's lists (`_best_first_native`); without
    it a heap or per-depth passes in Python and NumPy. All give the same tree.
    """
    if host is None:
        host = host_branch("host_tree", logprobs.device)
    if host and _hosttree is not None and logprobs.device.type == "cpu":
        tree = _best_first_rows(root, logprobs, budget)
        if tree is not None:
            return tree  # else a rank it read is not unique (a tie, a NaN): torch.topk's own order, below
    top_vals, top_toks = logprobs.float().topk(min(budget, logprobs.shape[1]), dim=-1)  # [L, k], sorted descending
    if not host:
        return _best_first_device(root, top_vals, top_toks, budget)
    if _hosttree is not None:
        return _best_first_native(root, top_vals, top_toks, budget)
    if budget <= HEAP_MAX_BUDGET:
        return _best_first_heap(root, top_vals, top_toks, budget)
    return _best_first_host(root, top_vals, top_toks, budget)


def _best_first_device(root: torch.Tensor, top_vals: torch.Tensor, top_toks: torch.Tensor, budget: int) -> DraftTree:
    dev = top_vals.device
    L, k = top_vals.shape
    depth_scores, depth_tokens, depth_parent = [top_vals[0]], [top_toks[0]], [None]
    for d in range(1, L):
        prev = depth_scores[-1]
        p, r = _rank_pairs(budget, prev.shape[0], k, dev)
        cand = prev[p] + top_vals[d, r]
        s, order = torch.sort(cand, descending=True, stable=True)
        keep = min(budget, cand.shape[0])
        s, order = s[:keep], order[:keep]
        depth_scores.append(s)
        depth_tokens.append(top_toks[d, r[order]])
        depth_parent.append(p[order])

    all_scores = torch.cat(depth_scores)
    n_sel = min(budget, all_scores.shape[0])
    order = torch.sort(all_scores, descending=True, stable=True).indices[:n_sel]
    pick = order.sort().values  # the selected candidates in flat (depth-major) order: no masked gather, no sync
    selected = torch.zeros_like(all_scores, dtype=torch.bool).index_fill_(0, order, True)
    # flat order: depth-major, candidate order within a depth; root takes index 0
    flat = torch.cumsum(selected.long(), 0)
    depth_all, parent_start = _depth_layout(budget, L, k, dev)
    parent_all = torch.zeros_like(depth_all)  # depth 1: the root
    if L > 1:
        parent_all[depth_scores[0].shape[0]:] = flat[parent_start + torch.cat(depth_parent[1:])]
    par = parent_all[pick]
    dep = depth_all[pick]
    tok = torch.cat(depth_tokens)[pick]
    sc = all_scores[pick]
    z = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.cat([root.reshape(1).long().to(dev), tok]),
        parents=torch.cat([z - 1, par]),
        depths=torch.cat([z, dep]),
        scores=torch.cat([z.float(), sc]),
        is_chain=False,
        depth_bound=min(L, budget),
    )


def _best_first_host(root: torch.Tensor, top_vals: torch.Tensor, top_toks: torch.Tensor, budget: int,
                     prune: bool = True) -> DraftTree:
    """_best_first_device step for step in NumPy (same float32 sums, same stable orders), plus the
    tree's ancestor index and matrix, which the walk, the tree mask and the GDN layers read.

    With log-probabilities (every value <= 0) it also prunes: once `budget` candidates are known, one
    scoring no more than the budget-th best of them has `budget` candidates ahead of it in the global
    order (higher, or equal and earlier), and so does every descendant (adding a value <= 0 never
    raises a float sum). Neither can be selected, so they are dropped before the sort, and the depths
    stop where nothing is left: the same selection with fewer candidates. It pays from a budget of
    PRUNE_MIN_BUDGET (a few hundred candidates a depth); below, its extra steps cost about what they save.
    (prune=False: never, for bench/bench_tree.py.)
    """
    tv, tt = top_vals.cpu().numpy(), top_toks.cpu().numpy()
    L, k = tv.shape
    # rows are sorted descending: column 0 holds each row's maximum
    prune = prune and budget >= PRUNE_MIN_BUDGET and bool(tv[:, 0].max() <= 0)
    worst = -tv[0][:budget]  # minus the `budget` best scores so far, ascending (values only: the threshold)
    depth_scores, depth_tokens, depth_parent = [tv[0]], [tt[0]], []
    for d in range(1, L):
        p, r = _rank_pairs_host(budget, depth_scores[-1].shape[0], k)
        cand = depth_scores[-1][p] + tv[d, r]
        if prune and worst.shape[0] >= budget:
            live = np.flatnonzero(cand > -worst[budget - 1])
            if live.shape[0] == 0:
                break  # nothing here can be selected, and nothing deeper either
            order = live[np.argsort(-cand[live], kind="stable")[:budget]]
        else:
            order = np.argsort(-cand, kind="stable")[:budget]
        depth_scores.append(cand[order])
        depth_tokens.append(tt[d, r[order]])
        depth_parent.append(p[order])
        if prune:  # two sorted runs: the stable sort (timsort) merges them
            worst = np.sort(np.concatenate([worst, -depth_scores[-1]]), kind="stable")[:budget]
    all_scores = np.concatenate(depth_scores)
    order = np.argsort(-all_scores, kind="stable")[:budget]
    pick = np.sort(order)
    selected = np.zeros(all_scores.shape[0], dtype=np.int64)
    selected[order] = 1
    flat = np.cumsum(selected)
    sizes = [s.shape[0] for s in depth_scores]
    depth_all = np.repeat(np.arange(1, len(sizes) + 1, dtype=np.int64), sizes)
    parent_all = np.zeros_like(depth_all)  # depth 1: the root
    if len(sizes) > 1:
        parent_start = np.repeat(np.cumsum([0] + sizes[:-2]).astype(np.int64), sizes[1:])
        parent_all[sizes[0]:] = flat[parent_start + np.concatenate(depth_parent)]
    parents = np.concatenate([[-1], parent_all[pick]])
    depths = np.concatenate([[0], depth_all[pick]])
    tokens = np.concatenate([[int(root)], np.concatenate(depth_tokens)[pick]])
    return _host_tree(tokens, parents, depths, np.concatenate([[0.0], all_scores[pick]]).astype(np.float32),
                      top_vals.device)


def _best_first_heap(root: torch.Tensor, top_vals: torch.Tensor, top_toks: torch.Tensor, budget: int) -> DraftTree:
    """The same tree as _best_first_device, by best-first search: `budget` pops from a heap, not a pass per depth.

    A candidate is (depth d, its parent's rank p among the selected nodes of depth d - 1, its own child rank
    r), scored in float32 like the other builds. The global order of the other builds is (score descending,
    shallower first, then the per-depth list order, which is (p, r) among equal scores): that is the heap key
    (-score, d, p, r). A node's next sibling (r + 1) and its first child (rank 0) are pushed when it is popped;
    both come after it in that order, so no candidate is missed. The selected nodes of a depth are a prefix
    of its list, so a node's rank p is its pop order within its depth. Cheaper than the per-depth passes for a
    small budget (PRUNE_MIN_BUDGET and HEAP_MAX_BUDGET: bench/bench_tree.py --pair toy).
    """
    tv, tt = top_vals.cpu().tolist(), top_toks.cpu().tolist()  # floats hold the float32 values exactly
    L, k = len(tv), len(tv[0])
    # a float32 sum: the double sum of two float32 values rounded once to float32 is the float32 sum (53 >= 2 * 24
    # + 2 bits: double rounding is harmless for addition)
    pack, unpack = _F32.pack, _F32.unpack  # float -> float32 -> float, as np.float32 but a third of the cost
    pop, push = heapq.heappop, heapq.heappush
    heap = [(-tv[0][0], 1, 0, 0)]
    ranks: list[list[int]] = [[] for _ in range(L + 1)]  # per depth: the selected nodes, in pop order
    parent_of, token_of, score_of = [], [], []
    while heap and len(score_of) < budget:
        neg, d, p, r = pop(heap)
        parent = ranks[d - 1][p] if d > 1 else -1
        score = -neg
        ranks[d].append(len(score_of))
        parent_of.append(parent), token_of.append(tt[d - 1][r]), score_of.append(score)
        if r + 1 < k:
            base = score_of[parent] if parent >= 0 else 0.0
            push(heap, (-unpack(pack(base + tv[d - 1][r + 1]))[0], d, p, r + 1))
        if d < L:
            push(heap, (-unpack(pack(score + tv[d][0]))[0], d + 1, len(ranks[d]) - 1, 0))
    # flat order: depth-major, pop order within a depth; the root takes index 0
    order = [node for level in ranks[1:] for node in level]
    flat = [0] * len(order)
    for i, node in enumerate(order, 1):
        flat[node] = i
    parents = [-1] + [flat[parent_of[v]] if parent_of[v] >= 0 else 0 for v in order]
    depths = [0] + [d for d, level in enumerate(ranks) for _ in level]
    tokens = [int(root)] + [token_of[v] for v in order]
    scores = [0.0] + [score_of[v] for v in order]
    return _host_tree_from_lists(tokens, parents, depths, scores, top_vals.device)


def _native_outputs(budget: int, L: int) -> tuple[np.ndarray, ...]:
    """The arrays the C build writes: tokens, parents, depths, first child, next sibling; scores; ancestor index;
    ancestor matrix (flat, at their largest)."""
    cap = budget + 1
    return (np.empty((5, cap), dtype=np.int64), np.empty(cap, dtype=np.float32),
            np.empty(cap * (L + 1), dtype=np.int64), np.empty(cap * cap, dtype=np.bool_))


def _best_first_native(root: torch.Tensor, top_vals: torch.Tensor, top_toks: torch.Tensor, budget: int) -> DraftTree:
    """_best_first_heap's tree in one C call (ddtree/engine/_hosttree.c), with the ancestor index and matrix and the
    greedy walk's child lists. Any budget: the heap is O(budget log budget)."""
    vals = np.ascontiguousarray(top_vals.cpu().numpy(), dtype=np.float32)
    toks = np.ascontiguousarray(top_toks.cpu().numpy(), dtype=np.int64)
    L, k = vals.shape
    out = _native_outputs(budget, L)
    n, bound = _hosttree.best_first(vals, toks, L, k, budget, int(root), *out)
    return _native_tree(out, n, bound, top_vals.device)


def _best_first_rows(root: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree | None:
    """best_first_tree on a CPU in one C call from the log-probabilities themselves: each row's ranks are taken there
    as the search reads them, exactly torch.topk's where what it reads is unique (distinct values, no NaN, no -inf);
    None where not (the caller then takes torch.topk)."""
    lp = np.ascontiguousarray(logprobs.detach().numpy(), dtype=np.float32)
    L, V = lp.shape
    out = _native_outputs(budget, L)
    found = _hosttree.best_first_rows(lp, L, V, budget, int(root), *out)
    return None if found is None else _native_tree(out, *found, logprobs.device)


def _native_tree(out: tuple[np.ndarray, ...], n: int, bound: int, dev: torch.device) -> DraftTree:
    """The DraftTree of the C build's arrays (`_native_outputs`) holding n nodes of depth up to bound."""
    ints, scores, aidx, anc = out
    tokens, parents, depths, first, sibling = ints[:, :n]
    aidx = aidx[: n * (bound + 1)].reshape(n, bound + 1)
    cpu = dev.type == "cpu"
    t = torch.from_numpy if cpu else (lambda a: torch.from_numpy(a).to(dev))  # (a no-op .to costs ~1.4 us)
    return DraftTree(tokens=t(tokens), parents=t(parents), depths=t(depths), scores=t(scores[:n]), is_chain=False,
                     depth_bound=bound, _anc=t(anc[: n * n].reshape(n, n)), _aidx=t(aidx),
                     _host=(tokens, parents, depths, aidx) if cpu else None,
                     _walk_index=(tokens.tolist(), first.tolist(), sibling.tolist()) if cpu else None)


def _child_lists(parents: list[int]) -> tuple[list[int], list[int]]:
    """(first child, next sibling) of every node (-1: none), children in flat order."""
    first, sibling = [-1] * len(parents), [-1] * len(parents)
    for i in range(len(parents) - 1, 0, -1):  # backwards: each parent ends with its smallest child first
        sibling[i] = first[parents[i]]
        first[parents[i]] = i
    return first, sibling


def _host_tree_from_lists(tokens: list[int], parents: list[int], depths: list[int], scores: list[float],
                          dev: torch.device) -> DraftTree:
    """_host_tree from the heap's lists, plus the greedy walk's child lists from the same lists (`_walk_index`:
    a fifth of the walk's own cost, which otherwise rebuilds them from the arrays)."""
    tree = _host_tree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64),
                      np.asarray(depths, dtype=np.int64), np.asarray(scores, dtype=np.float32), dev)
    if tree._host is not None:
        tree._walk_index = (tokens, *_child_lists(parents))
    return tree


def _host_tree(tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, scores: np.ndarray,
               dev: torch.device) -> DraftTree:
    """A DraftTree from host arrays (flat order), with its ancestor index and matrix built on the host."""
    n = tokens.shape[0]
    bound = int(depths.max())
    cols = [np.arange(n)]
    up = np.maximum(parents, 0)
    for _ in range(bound):
        cols.append(up[cols[-1]])
    aidx = np.stack(cols, axis=1)
    anc = np.zeros((n, n), dtype=np.bool_)
    anc[np.arange(n)[:, None], aidx] = True
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731 - a no-op move on the CPU
    return DraftTree(tokens=t(tokens), parents=t(parents), depths=t(depths), scores=t(scores), is_chain=False,
                     depth_bound=bound, _anc=t(anc), _aidx=t(aidx),
                     _host=(tokens, parents, depths, aidx) if dev.type == "cpu" else None)


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, n, past + n): the cached prefix and a node's ancestors are visible."""
    n = len(tree)
    dev = tree.tokens.device
    mask = torch.full((1, 1, n, past + n), torch.finfo(dtype).min, dtype=dtype, device=dev)
    mask[..., :past] = 0
    mask[0, 0, :, past:].masked_fill_(tree.ancestor_matrix(), 0)
    return mask


@dataclass
class Walk:
    """The accepted path of one round, read from the device once."""

    path: torch.Tensor  # flat indices root→end, on the device
    path_list: list[int]  # the same on the host
    tokens: list[int]  # accepted draft tokens (path[1:]) then the target's token after the end
    next_root: torch.Tensor  # device scalar: the target's token after the end


def walk(tree: DraftTree, choice: torch.Tensor) -> Walk:
    """Follow the target's choices: root→deepest node whose every token equals the target's choice at its parent.

    choice[i] is the target's token after node i (argmax, or a sample at T > 0). Siblings are
    distinct, so the consistent nodes form one path. Exactly one host read: it decides the path and
    brings its tokens and the bonus token along.
    """
    dev = choice.device
    n = len(tree)
    if n == 1:
        return Walk(torch.zeros(1, dtype=torch.long, device=dev), [0], [int(choice[0])], choice[0])
    if tree.is_chain:
        hit = (tree.tokens[1:] == choice[:-1]).long().cumprod(0).sum()
        host = torch.cat([hit.view(1), tree.tokens[1:], choice]).tolist()
        k = host[0]
        return Walk(torch.arange(k + 1, device=dev), list(range(k + 1)), host[1: k + 1] + [host[n + k]], choice[k])
    if tree._walk_index is not None and dev.type == "cpu":
        return _walk_lists(tree._walk_index, choice)
    if tree._host is not None and dev.type == "cpu":
        return _walk_host(tree._host, choice)
    aidx = tree.ancestor_index()
    match = tree.tokens == choice[tree.parents.clamp(min=0)]
    match[0] = True
    ok = match[aidx].all(dim=1)  # every ancestor-or-self matches
    end = torch.where(ok, tree.depths, -1).argmax().view(1)  # 1-d: a 0-d index tensor would be read on the host
    up = aidx.index_select(0, end)[0]  # end, its parent, …, root, root, …
    m = up.shape[0]
    host = torch.cat([end, tree.depths.index_select(0, end), up, tree.tokens[up], choice.index_select(0, end)]).tolist()
    e, d = host[0], host[1]
    path_list = host[2: 3 + d][::-1]
    tokens = host[2 + m: 3 + m + d][::-1][1:] + [host[-1]]
    return Walk(aidx[e, : d + 1].flip(0), path_list, tokens, choice[e])


def _child(tokens: list[int], first: list[int], sibling: list[int], node: int, token: int) -> int:
    """node's child carrying `token` (siblings carry distinct tokens: at most one does), or -1."""
    child = first[node]
    while child >= 0 and tokens[child] != token:
        child = sibling[child]
    return child


def _walk_lists(index: tuple[list[int], list[int], list[int]], choice: torch.Tensor) -> Walk:
    """walk() on a host-built tree with its child lists (`DraftTree._walk_index`): follow the matching child from the
    root, in Python lists (a handful of steps: cheaper than the NumPy passes over every node)."""
    tokens, first, sibling = index
    want = choice.tolist()
    path, node = [0], 0
    while (child := _child(tokens, first, sibling, node, want[node])) >= 0:
        path.append(child)
        node = child
    return Walk(torch.tensor(path), path, [tokens[i] for i in path[1:]] + [want[node]], choice[node])


def _walk_host(host: tuple[np.ndarray, ...], choice: torch.Tensor) -> Walk:
    """walk() on a host-built tree of a CPU target: the same steps in NumPy (no device, no read to pay for)."""
    tokens, parents, depths, aidx = host
    c = choice.numpy()
    match = tokens == c[np.maximum(parents, 0)]
    match[0] = True
    end = int(np.argmax(np.where(match[aidx].all(axis=1), depths, -1)))
    path = aidx[end, : depths[end] + 1][::-1].copy()
    return Walk(torch.from_numpy(path), path.tolist(), tokens[path[1:]].tolist() + [int(c[end])], choice[end])


def greedy_walk_rows(tree: DraftTree, argmax) -> Walk:
    """walk(tree, argmax of every node's logits), asking `argmax(nodes)` only for the nodes the walk reaches.

    The walk reaches a node only through its parent's argmax, so it needs the target's choice at its own path
    alone. Each ask is a batch: the node the walk stands on and its chain of best children (each node's first
    child in flat order: the drafter's likeliest continuation, which the walk usually follows); a walk that
    leaves the chain asks again from where it left. Host-built trees only (`tree._host`).
    """
    if tree._walk_index is not None:
        tokens, first, sibling = tree._walk_index
    else:
        tokens = tree._host[0].tolist()
        first, sibling = _child_lists(tree._host[1].tolist())
    choice: dict[int, int] = {}
    path, node = [0], 0
    while True:
        if node not in choice:
            batch = [node]
            while first[batch[-1]] >= 0:
                batch.append(first[batch[-1]])
            choice.update(zip(batch, argmax(batch), strict=True))
        nxt = _child(tokens, first, sibling, node, choice[node])
        if nxt < 0:
            break
        path.append(nxt)
        node = nxt
    toks = [tokens[i] for i in path[1:]] + [choice[node]]
    return Walk(torch.tensor(path, dtype=torch.long), path, toks, torch.tensor(choice[node], dtype=torch.long))


def accepted_path(tree: DraftTree, choice: torch.Tensor) -> torch.Tensor:
    """Flat indices root→deepest consistent node (see `walk`), on the device."""
    return walk(tree, choice).path
