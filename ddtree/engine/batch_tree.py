"""Draft trees of many streams at once (the batched round, ddtree.engine.batch): one padded tensor per field,
a row per stream, so a round's ops do not grow with the number of streams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchTree", "BatchWalk"]


@dataclass
class BatchTree:
    """N streams' trees, padded to T nodes. Row i is stream i's tree in DraftTree's flat order (node 0 the root,
    parents[i, j] < j). A padding node (valid False) is a child of the root at depth 1 holding token 0: every
    forward treats it as a node, the walk never accepts it.

    tokens, parents (root: -1), depths: long [N, T]; valid: bool [N, T] (the first sizes[i] nodes of row i);
    sizes: long [N]; ancestors: bool [N, T, T] (ancestors[i, a, b]: b is a or an ancestor of a; padding: self and
    the root); is_chain: every row a chain (the first sizes[i] nodes in order); depth_bound: host int, an upper
    bound on every depth."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    sizes: torch.Tensor
    ancestors: torch.Tensor
    is_chain: bool = False
    depth_bound: int = 0

    @property
    def streams(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass
class BatchWalk:
    """The accepted paths of one batched round, read from the device once for every stream.

    path: long [N, K] flat node indices root first, padded with the path's last node; lengths: long [N] nodes on
    each path (root included: tokens committed = lengths); next_root: long [N] the target's token after each path's
    end; tokens: host lists, per stream the accepted draft tokens then the bonus token."""

    path: torch.Tensor
    lengths: torch.Tensor
    next_root: torch.Tensor
    tokens: list[list[int]]


# ---- interim builders (a loop over streams), replaced by the vectorised ones
from ddtree.engine.tree import best_first_tree, chain_tree, root_tree, walk  # noqa: E402

def _stack(trees):
    n = len(trees); T = max(len(t) for t in trees); dev = trees[0].tokens.device
    tok = torch.zeros(n, T, dtype=torch.long, device=dev); par = torch.zeros(n, T, dtype=torch.long, device=dev)
    dep = torch.ones(n, T, dtype=torch.long, device=dev); val = torch.zeros(n, T, dtype=torch.bool, device=dev)
    anc = torch.zeros(n, T, T, dtype=torch.bool, device=dev)
    for i, t in enumerate(trees):
        m = len(t); tok[i, :m] = t.tokens; par[i, :m] = t.parents; dep[i, :m] = t.depths; val[i, :m] = True
        anc[i, :m, :m] = t.ancestor_matrix()
        for j in range(m, T):
            anc[i, j, j] = True; anc[i, j, 0] = True
    par[:, 0] = -1; dep[:, 0] = 0
    return BatchTree(tok, par, dep, val, val.sum(1), anc, is_chain=all(t.is_chain for t in trees),
                        depth_bound=int(dep.max())), trees

def batch_root_trees(roots):
    return _stack([root_tree(r) for r in roots])[0]

def batch_chain_trees(roots, toks):
    t, trees = _stack([chain_tree(r, x) for r, x in zip(roots, toks)]); t._trees = trees; return t

def batch_best_first(roots, logprobs, budget):
    t, trees = _stack([best_first_tree(r, lp, budget, host=False) for r, lp in zip(roots, logprobs)]); return t

def batch_walk(tree, choice):
    paths, toks, roots = [], [], []
    for i in range(tree.streams):
        m = int(tree.sizes[i])
        from ddtree.engine.tree import DraftTree
        d = DraftTree(tree.tokens[i, :m], tree.parents[i, :m], tree.depths[i, :m], depth_bound=int(tree.depths[i,:m].max()))
        w = walk(d, choice[i, :m])
        paths.append(w.path_list); toks.append(w.tokens); roots.append(int(w.next_root))
    K = max(len(p) for p in paths)
    path = torch.tensor([p + [p[-1]] * (K - len(p)) for p in paths])
    return BatchWalk(path, torch.tensor([len(p) for p in paths]), torch.tensor(roots), toks)

