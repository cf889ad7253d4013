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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def ancestor_matrix(self) -> torch.Tensor:
        """anc[i, j] = j is i or an ancestor of i (bool [n, n]); computed once per tree."""
        if self._anc is not None:
            return self._anc
        n = len(self)
        dev = self.tokens.device
        if self.is_chain:
            self._anc = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
            return self._anc
        anc = torch.eye(n, dtype=torch.bool, device=dev)
        parent = self.parents.clamp(min=0)
        rows = torch.arange(n, device=dev)
        hop = rows
        bound = self.depth_bound if self.depth_bound is not None else int(self.depths.max())
        # after d hops every ancestor within distance d is marked; the depth bounds the distance
        for _ in range(bound):
            hop = parent[hop]
            anc[rows, hop] = True
        self._anc = anc
        return anc


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


@lru_cache(maxsize=32)
def _rank_pairs(budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent rank p, child rank r) pairs that can reach a depth's top `budget`: (p+1)(r+1) <= budget.

    Pairs (p', r') with p' <= p and r' <= r all score at least as high, so any other pair
    has `budget` better ones at the same depth and can never be selected.
    """
    ps, rs = [], []
    for p in range(budget):
        width = budget // (p + 1)
        ps.append(torch.full((width,), p, dtype=torch.long))
        rs.append(torch.arange(width, dtype=torch.long))
    return torch.cat(ps), torch.cat(rs)


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
    p_idx, r_idx = _rank_pairs(budget)
    p_idx, r_idx = p_idx.to(dev), r_idx.to(dev)

    depth_scores, depth_tokens, depth_parent = [top_vals[0]], [top_toks[0]], [None]
    for d in range(1, L):
        prev = depth_scores[-1]
        p, r = p_idx, r_idx
        if prev.shape[0] < budget or k < budget:  # small vocabularies: drop pairs past the lists
            ok = (p_idx < prev.shape[0]) & (r_idx < k)
            p, r = p_idx[ok], r_idx[ok]
        cand = prev[p] + top_vals[d, r]
        keep = min(budget, cand.shape[0])
        s, order = cand.topk(keep)
        depth_scores.append(s)
        depth_tokens.append(top_toks[d, r[order]])
        depth_parent.append(p[order])

    sizes = [s.shape[0] for s in depth_scores]
    all_scores = torch.cat(depth_scores)
    n_sel = min(budget, all_scores.shape[0])
    order = torch.sort(all_scores, descending=True, stable=True).indices[:n_sel]
    selected = torch.zeros_like(all_scores, dtype=torch.bool)
    selected[order] = True
    # flat order: depth-major, candidate order within a depth; root takes index 0
    flat = torch.cumsum(selected.long(), 0)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    parents, depths = [], []
    for d, size in enumerate(sizes):
        if d == 0:
            parents.append(torch.zeros(size, dtype=torch.long, device=dev))
        else:
            parents.append(flat[offsets[d - 1] + depth_parent[d]])
        depths.append(torch.full((size,), d + 1, dtype=torch.long, device=dev))
    par = torch.cat(parents)[selected]
    dep = torch.cat(depths)[selected]
    tok = torch.cat(depth_tokens)[selected]
    sc = all_scores[selected]
    z = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.cat([root.reshape(1).long().to(dev), tok]),
        parents=torch.cat([z - 1, par]),
        depths=torch.cat([z, dep]),
        scores=torch.cat([z.float(), sc]),
        is_chain=False,
        depth_bound=L,
    )


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, n, past + n): the cached prefix and a node's ancestors are visible."""
    n = len(tree)
    dev = tree.tokens.device
    mask = torch.full((1, 1, n, past + n), torch.finfo(dtype).min, dtype=dtype, device=dev)
    mask[..., :past] = 0
    mask[0, 0, :, past:].masked_fill_(tree.ancestor_matrix(), 0)
    return mask


def accepted_path(tree: DraftTree, choice: torch.Tensor) -> torch.Tensor:
    """Flat indices root→deepest node whose every token equals the target's choice at its parent.

    choice[i] is the target's token after node i (argmax, or a sample at T > 0). Siblings are
    distinct, so the consistent nodes form one path; one host read decides its end.
    """
    if len(tree) == 1:
        return torch.zeros(1, dtype=torch.long, device=choice.device)
    if tree.is_chain:
        hit = (tree.tokens[1:] == choice[:-1]).long()
        k = int(hit.cumprod(0).sum())
        return torch.arange(k + 1, device=choice.device)
    match = tree.tokens == choice[tree.parents.clamp(min=0)]
    match[0] = True
    anc = tree.ancestor_matrix()
    ok = ~(anc & ~match.unsqueeze(0)).any(dim=1)  # every ancestor-or-self matches
    end = int(torch.where(ok, tree.depths, -1).argmax())
    return torch.nonzero(anc[end], as_tuple=False).flatten()
