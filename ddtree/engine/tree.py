"""Draft trees: the root (last committed token) plus proposed nodes, parents before children.

Every method proposes one: AR the root alone, DFlash a chain, DDTree the best-first
selection of `budget` prefixes under the drafter's per-position log-probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ddtree.engine.kernels.tree import _ancestor_index, _ancestor_matrix, _tree_build, tree_build

try:  # the host tree build in C (setup.py compiles it where a compiler is found)
    from ddtree.engine import _hosttree
except ImportError:  # not compiled: the torch build gives the same trees
    _hosttree = None


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
    # where the tree was built on the host (a CPU's C build): (tokens, first child, next sibling) as lists (-1: none;
    # children in flat order), the host walk's index
    _host: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False)
    # a chain whose tokens were sampled (T > 0): draft_probs[i] the distribution node i + 1's token was drawn from
    # ([L, V] on the device; 0 where it could not be drawn), which the loop verifies by rejection (`rejection_walk`)
    draft_probs: torch.Tensor | None = field(default=None, repr=False)

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
        self._aidx = _ancestor_index(self.parents, bound)
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
        self._anc = _ancestor_matrix(self.ancestor_index())
        return self._anc


def root_tree(root: torch.Tensor) -> DraftTree:
    dev = root.device
    z = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(root.reshape(1).long(), torch.full_like(z, -1), z, is_chain=True, depth_bound=0)


def chain_tree(root: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
    """root followed by `tokens` in a line (DFlash). draft_probs: [L, V], the rows `tokens` were sampled from (a
    chain drafted at T > 0: verified by `rejection_walk`), or None (verified by the target's choices: `walk`)."""
    toks = torch.cat([root.reshape(1).long(), tokens.reshape(-1).long()])
    n = toks.shape[0]
    ar = torch.arange(n, device=toks.device)
    return DraftTree(toks, ar - 1, ar, is_chain=True, depth_bound=n - 1, draft_probs=draft_probs)


def chain_tensors(root: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """chain_tree's (tokens, parents, depths) and its ancestor matrix, as a compiled graph returns them (MTP's chain,
    a DFlash2 selector's walk): `DraftTree(*t[:3], is_chain=True, depth_bound=n - 1, _anc=t[3])`."""
    toks = torch.cat([root.reshape(1).long(), tokens.reshape(-1).long()])
    n = toks.shape[0]
    ar = torch.arange(n, device=toks.device)
    return toks, ar - 1, ar, torch.ones(n, n, dtype=torch.bool, device=toks.device).tril_()


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


def best_first_tree(root: torch.Tensor, logprobs: torch.Tensor, budget: int, *, host: bool | None = None) -> DraftTree:
    """The `budget` best prefixes under cumulative draft log-probability, as a tree (DDTree's proposal).

    logprobs: [L, V] per-position log-probabilities (position d drafts depth d + 1). The tree is the one
    ddtree.testing.reference.best_first_reference defines (ties, NaN and -inf included: NaN counts as -inf, a positive
    value as 0, equal values rank by token id, equal scores prefer the shallower node, then the earlier parent, then the
    lower rank); nodes are in flat depth-major order, best first within a depth.

    host: build with the C extension on the host (None: on a CPU where it is compiled: one call, and the tree carries
    the host walk's child lists; an engine whose options turn the `host_tree` branch off passes False), or with torch
    ops on the logits' device (`best_first_tensors`: every other device, and a CPU without the extension). Both give
    the same tree.
    """
    if host is None:
        host = _hosttree is not None and logprobs.device.type == "cpu"
    if host:
        if _hosttree is None:
            raise RuntimeError("the C tree build (ddtree/engine/_hosttree.c) is not compiled: rerun `make install`")
        return _best_first_host(root, logprobs, budget)
    return tree_of_tensors(*best_first_tensors(root, logprobs, budget))


def tree_of_tensors(tokens, parents, depths, scores, aidx, anc) -> DraftTree:
    """The DraftTree of best_first_tensors' outputs (or of a compiled call of it: ddtree.engine.compiled)."""
    return DraftTree(tokens, parents, depths, scores, depth_bound=aidx.shape[1] - 1, _aidx=aidx, _anc=anc)


def tree_size(budget: int, L: int, V: int) -> int:
    """Nodes of a best-first tree besides the root: `budget`, or every prefix where fewer exist."""
    total, width = 0, 1
    for _ in range(L):
        width = min(width * min(budget, V), budget)
        total += width
        if total >= budget:
            return budget
    return total


@lru_cache(maxsize=64)
def _token_ids(V: int, device: torch.device) -> torch.Tensor:
    """best_first_tensors' token ids (the top-k keys' low bits), built once per device."""
    return torch.arange(V, device=device)


def best_first_tensors(root: torch.Tensor, logprobs: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """best_first_tree in torch ops on the logits' device: (tokens, parents, depths, scores, ancestor index, ancestor
    matrix). No host read, and shapes fixed by (budget, L, V): capturable (torch.compile(fullgraph=True), CUDA graphs).

    Each position's ranks: one top-k over keys (the value's magnitude bits, token id), unique and ordered as the
    definition orders ranks. Costs are minus log-probabilities (never -0.0: a radix sort would put it first; NaN marks
    no candidate and sorts last). Then depth by depth, three ops: the pairs' costs (parent's + child's, float32 as the
    definition), a stable sort (equal costs keep the pair order, which is the definition's), and the best `budget` are
    the next depth's list. A depth's best `budget` contain every node of it the tree selects (any other has `budget`
    better ones at that depth), and the children of nodes outside it are outside too. The tree is then the first nodes
    of one stable sort of all depths' lists (root first, depth-major: equal costs prefer the shallower), laid out
    depth-major. Everything after the top-k is one fused op, `ddtree::tree_build` (ddtree.engine.kernels.tree: those
    torch ops on a CPU and inside a compiled graph, one Triton launch on CUDA).
    """
    L, V = logprobs.shape
    cost, ranked = _ranked_costs(logprobs, budget)
    n = 1 + tree_size(budget, L, V)
    return (_tree_build if torch.compiler.is_compiling() else tree_build)(cost, ranked, root, n)


def _ranked_costs(logprobs: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """best_first_tensors' ranks: each position's best `budget` costs and tokens, ([L, budget] float32, long); over
    the last dimension, so [N, L, V] gives [N, L, budget] (ddtree.engine.batch_tree)."""
    V = logprobs.shape[-1]
    # traced (ddtree.engine.compiled): the constants become the graph's own, built without the cache wrapper
    token_id = (_token_ids.__wrapped__ if torch.compiler.is_compiling() else _token_ids)(V, logprobs.device)
    cost = torch.nan_to_num(logprobs.float(), nan=-math.inf, posinf=0.0, neginf=-math.inf).clamp_(max=0.0).abs_()
    key = cost.view(torch.int32).long()  # a cost >= +0.0: its bits order as it does
    key.bitwise_left_shift_(32).bitwise_or_(token_id)  # (in place: a full row of int64 is the build's largest write)
    ranked = key.topk(min(budget, V), dim=-1, largest=False).values & 0xFFFFFFFF  # [L, k]: the tokens, ranks 0..k-1
    cost = cost.gather(-1, ranked)
    if V < budget:  # ranks past the vocabulary: nothing
        cost = torch.nn.functional.pad(cost, (0, budget - V), value=math.nan)
        ranked = torch.nn.functional.pad(ranked, (0, budget - V))
    return cost, ranked


def _best_first_host(root: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """best_first_tree in one C call (ddtree/engine/_hosttree.c), with the ancestor index and matrix and the host walk's
    child lists."""
    lp = logprobs.detach().cpu().float().contiguous().numpy()
    L, cap = lp.shape[0], budget + 1
    ints, scores = np.empty((5, cap), dtype=np.int64), np.empty(cap, dtype=np.float32)
    aidx, anc = np.empty(cap * (L + 1), dtype=np.int64), np.empty(cap * cap, dtype=np.bool_)
    n, bound = _hosttree.best_first(lp, budget, int(root), ints, scores, aidx, anc)
    tokens, parents, depths, first, sibling = ints[:, :n]
    dev = logprobs.device
    cpu = dev.type == "cpu"
    t = torch.from_numpy if cpu else (lambda a: torch.from_numpy(a).to(dev))  # (a no-op .to costs ~1.4 us)
    return DraftTree(tokens=t(tokens), parents=t(parents), depths=t(depths), scores=t(scores[:n]), depth_bound=bound,
                     _anc=t(anc[: n * n].reshape(n, n)), _aidx=t(aidx[: n * (bound + 1)].reshape(n, bound + 1)),
                     _host=(tokens.tolist(), first.tolist(), sibling.tolist()) if cpu else None)


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

    choice[i] is the target's token after node i (argmax, or a sample at T > 0). Siblings are distinct, so the
    consistent nodes form one path. A tree built on the host walks there (`host_walk`); any other in torch ops on the
    device with exactly one host read, which decides the path and brings its tokens and the bonus token along.
    """
    if tree._host is not None:
        want = choice.tolist()
        return host_walk(tree, lambda nodes: [want[i] for i in nodes])
    dev = choice.device
    n = len(tree)
    if n == 1:
        return Walk(torch.zeros(1, dtype=torch.long, device=dev), [0], [int(choice[0])], choice[0])
    if tree.is_chain:  # a chain's path is its prefix of matches: fewer ops than the general case
        hit = (tree.tokens[1:] == choice[:-1]).long().cumprod(0).sum()
        host = torch.cat([hit.view(1), tree.tokens[1:], choice]).tolist()
        k = host[0]
        return Walk(torch.arange(k + 1, device=dev), list(range(k + 1)), host[1: k + 1] + [host[n + k]], choice[k])
    aidx = tree.ancestor_index()
    match = tree.tokens == choice[tree.parents.clamp(min=0)]
    match[:1].fill_(True)  # the root
    ok = match[aidx].all(dim=1)  # every ancestor-or-self matches
    end = torch.where(ok, tree.depths, -1).argmax().view(1)  # 1-d: a 0-d index tensor would be read on the host
    up = aidx.index_select(0, end)[0]  # end, its parent, …, root (node 0), root, …
    m = up.shape[0]
    host = torch.cat([up, tree.tokens[up], choice.index_select(0, end)]).tolist()
    e = host[0]
    d = host.index(0) if e else 0  # the end's depth: where the root first comes (it ends the chain)
    path_list = host[: 1 + d][::-1]
    tokens = host[m: m + 1 + d][::-1][1:] + [host[-1]]
    return Walk(up[: d + 1].flip(0), path_list, tokens, choice[e])


def rejection_walk(tree: DraftTree, logits: torch.Tensor, temperature: float,
                   generator: torch.Generator | None = None) -> Walk:
    """Speculative sampling of a sampled chain (`tree.draft_probs` set): the round's tokens follow the target's
    distribution p = softmax(logits / temperature) (`logits` [L + 1, V]: row i the target's after node i).

    Drafted token x_i, drawn from q_i = draft_probs[i - 1], is accepted while u_i < p_{i-1}(x_i) / q_i(x_i) (u_i
    uniform; as u_i q_i(x_i) < p_{i-1}(x_i)); at the first rejection, after k accepted tokens, the next token is a
    sample of norm(max(0, p_k - q_{k+1})), and after the whole chain one of p_L (q_{L+1} = 0: the same formula).
    Each drafted token is accepted with probability sum_x min(p, q), where a match with an independent target sample
    (`walk`) has sum_x p q. On the device with one host read (the accepted length, the chain's tokens and the next
    token), nothing copied to it. `ddtree.testing.reference.rejection_reference` is the slow obvious rule."""
    q = tree.draft_probs
    L = q.shape[0]
    p = torch.softmax(logits.float() / temperature, dim=-1)  # as the loop's _choose
    drafted = tree.tokens[1:, None]
    u = torch.rand(L, generator=generator, device=p.device)
    ok = u * q.gather(1, drafted)[:, 0] < p[:-1].gather(1, drafted)[:, 0]
    k = ok.long().cumprod(0).sum().view(1)  # accepted drafts (1-d: a 0-d index tensor would be read on the host)
    left = torch.nn.functional.pad(q, (0, 0, 0, 1)).index_select(0, k)  # q_{k+1} (zeros past the chain)
    pk = p.index_select(0, k)
    residual = (pk - left).clamp_(min=0.0)
    # p_k <= q_{k+1} everywhere means p_k = q_{k+1}: no rejection in exact arithmetic, a rounding one draws from p_k
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pk)
    nxt = torch.multinomial(residual, 1, generator=generator).view(1)
    n = L + 1
    host = torch.cat([k, tree.tokens[1:], nxt]).tolist()
    a = host[0]
    return Walk(torch.arange(a + 1, device=p.device), list(range(a + 1)), host[1: a + 1] + [host[n]], nxt[0])


def host_walk(tree: DraftTree, ask) -> Walk:
    """walk() of a tree built on the host (`tree._host`), asking `ask(nodes)` for the target's choice after each of
    `nodes` only where the walk needs it: its own path (a greedy verification then runs the head on those rows alone).

    Each ask is a batch: the node the walk stands on and its chain of first children (the drafter's likeliest
    continuation, which the walk usually follows); a walk that leaves the chain asks again from where it left.
    """
    tokens, first, sibling = tree._host
    choice: dict[int, int] = {}
    path, node = [0], 0
    while True:
        if node not in choice:
            batch = [node]
            while first[batch[-1]] >= 0:
                batch.append(first[batch[-1]])
            choice.update(zip(batch, ask(batch), strict=True))
        child, want = first[node], choice[node]
        while child >= 0 and tokens[child] != want:  # siblings carry distinct tokens: at most one matches
            child = sibling[child]
        if child < 0:
            break
        path.append(child)
        node = child
    toks = [tokens[i] for i in path[1:]] + [choice[node]]
    return Walk(torch.tensor(path, dtype=torch.long), path, toks, torch.tensor(choice[node], dtype=torch.long))


def accepted_path(tree: DraftTree, choice: torch.Tensor) -> torch.Tensor:
    """Flat indices root→deepest consistent node (see `walk`), on the device."""
    return walk(tree, choice).path
