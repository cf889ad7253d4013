"""Draft trees: the root (last committed token) plus proposed nodes, parents before children.

Every method proposes one: AR the root alone, DFlash a chain, DDTree the best-first
selection of `budget` prefixes under the drafter's per-position log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch


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


@lru_cache(maxsize=64)
def _rank_pairs(budget: int, prev: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent rank p, child rank r) pairs that can reach a depth's top `budget`: (p+1)(r+1) <= budget.

    Pairs (p', r') with p' <= p and r' <= r all score at least as high, so any other pair
    has `budget` better ones at the same depth and can never be selected. Only p < prev (the
    previous depth's list) and r < k (the top-k per position) exist. Cached on the device, so a
    round copies nothing from the host.
    """
    ps, rs = [], []
    for p in range(min(budget, prev)):
        width = min(budget // (p + 1), k)
        ps.append(torch.full((width,), p, dtype=torch.long))
        rs.append(torch.arange(width, dtype=torch.long))
    return torch.cat(ps).to(device), torch.cat(rs).to(device)


@lru_cache(maxsize=64)
def _depth_layout(budget: int, L: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per candidate of the flat (depth-major) list: its depth (1-based), and for depth >= 2 the offset of
    the previous depth's list. The sizes follow from (budget, L, k) alone, so this is built once, on the device."""
    sizes = [k]
    for _ in range(1, L):
        pairs = sum(min(budget // (p + 1), k) for p in range(min(budget, sizes[-1])))
        sizes.append(min(budget, pairs))
    depth = torch.repeat_interleave(torch.arange(1, L + 1), torch.tensor(sizes))
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    parent_start = torch.repeat_interleave(torch.tensor(starts[:-1], dtype=torch.long),
                                           torch.tensor(sizes[1:], dtype=torch.long))
    return depth.to(device), parent_start.to(device)


def best_first_tree(root: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` highest-scoring prefixes under cumulative draft log-probability.

    logprobs: [L, V] per-position log-probabilities (position d drafts depth d + 1).
    Vectorized per depth: top-k of each position, merged with the previous depth's best
    `budget` partial paths, then one stable global selection. Equal scores prefer the
    shallower node, then the earlier candidate, so the selection is a tree and deterministic.
    """
    dev = logprobs.device
    L, V = logprobs.shape
    k = min(budget, V)
    top_vals, top_toks = logprobs.float().topk(k, dim=-1)  # [L, k], sorted descending

    depth_scores, depth_tokens, depth_parent = [top_vals[0]], [top_toks[0]], [None]
    for d in range(1, L):
        prev = depth_scores[-1]
        p, r = _rank_pairs(budget, prev.shape[0], k, dev)
        cand = prev[p] + top_vals[d, r]
        keep = min(budget, cand.shape[0])
        s, order = cand.topk(keep)
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


def accepted_path(tree: DraftTree, choice: torch.Tensor) -> torch.Tensor:
    """Flat indices root→deepest consistent node (see `walk`), on the device."""
    return walk(tree, choice).path
