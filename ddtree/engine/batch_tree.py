"""Draft trees of many streams at once (the batched round, ddtree.engine.batch): one padded tensor per field,
a row per stream, so a round's ops do not grow with the number of streams.

Builders (torch ops on the device, vectorised over streams, no host read): `batch_root_trees` (AR),
`batch_chain_trees` (DFlash chains), `batch_best_first` (DDTree: row i is `best_first_tree(roots[i], logprobs[i],
budget)`, node for node, optionally each stream at its own smaller budget; one fused op after the top-k, or on a CPU
one call of the C extension for every stream),
`batch_full_trees` (N trees of one node count given as tokens, parents and depths: the head methods' EAGLE-2 trees,
DDTree's pair trees: ddtree.engine.selector.batch_pair_tree),
`with_sizes` (cut rows to a prefix). `batch_walk` follows the target's choices in every stream with one host read.
`keyed_choice` samples at T > 0 with noise keyed by (stream seed, absolute position, token), so a stream's tokens do
not depend on the batch it runs in, and `keyed_draft_choice` couples a drafter's sampled chain to the same noise.
The device parts (`batch_best_first_tensors`, `batch_walk_tensors`, `keyed_choice`) trace as one graph
(torch.compile(fullgraph=True)); the walk's read is `read_walk`. Ops per round do not depend on N (tested)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ddtree.engine import tree as _tree  # its _hosttree: the C extension, or None where it is not compiled
from ddtree.engine.kernels import sampling
from ddtree.engine.kernels.sampling import _keyed_choice, keyed_uniform
from ddtree.engine.kernels.tree import _batch_ancestor_index, _batch_tree_build, batch_tree_build
from ddtree.engine.tree import DraftTree, _ranked_costs, tree_size

__all__ = ["BatchTree", "BatchWalk", "batch_best_first", "batch_best_first_tensors", "batch_tree_of_tensors",
           "batch_chain_trees", "batch_full_trees", "batch_root_trees", "batch_walk", "batch_walk_tensors", "read_walk",
           "keyed_choice", "keyed_draft_choice", "keyed_uniform", "positions_after", "with_sizes"]


@dataclass
class BatchTree:
    """N streams' trees, padded to T nodes. Row i is stream i's tree in DraftTree's flat order (node 0 the root,
    parents[i, j] < j). A padding node (valid False) is a child of the root at depth 1 holding token 0: every
    forward treats it as a node, the walk never accepts it.

    tokens, parents (root: -1), depths: long [N, T]; valid: bool [N, T] (the first sizes[i] nodes of row i);
    sizes: long [N]; ancestors: bool [N, T, T] (ancestors[i, a, b]: b is a or an ancestor of a; padding: self and
    the root); is_chain: every row a chain (the first sizes[i] nodes in order); depth_bound: host int, an upper
    bound on every depth. The builders here may hand out shared constants (cached per shape: a chain's parents, an
    unpadded tree's valid and sizes): a BatchTree's tensors are never written in place.

    aidx: long [N, T, depth_bound + 1] or None, the ancestor index (aidx[i, a, h]: the h-th ancestor of a, h = 0 a
    itself, the root repeating past it; padding: itself, then the root), which the builders here give and
    `batch_walk` builds where it is missing; scores: float32 [N, T] or None, cumulative draft log-probabilities
    (best-first trees; padding -inf), for inspection only."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    sizes: torch.Tensor
    ancestors: torch.Tensor
    is_chain: bool = False
    depth_bound: int = 0
    aidx: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def streams(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def ancestor_index(self) -> torch.Tensor:
        """`aidx`, built (and kept) where a tree came without it: O(N T depth), no host read."""
        if self.aidx is None:
            self.aidx = _batch_ancestor_index(self.parents, self.depth_bound)
        return self.aidx

    def row(self, i: int) -> DraftTree:
        """Stream i's tree alone (its valid nodes) as a DraftTree: for tests and inspection (reads the device)."""
        n = int(self.sizes[i])
        return DraftTree(self.tokens[i, :n], self.parents[i, :n], self.depths[i, :n],
                         None if self.scores is None else self.scores[i, :n], is_chain=self.is_chain,
                         depth_bound=self.depth_bound)


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


# ---------------------------------------------------------------------------------------------------- builders


def batch_root_trees(roots: torch.Tensor) -> BatchTree:
    """Every stream's tree is its root alone (AR): T = 1."""
    roots = roots.reshape(-1, 1).long()
    *rows, aidx = _const(_chain_rows, roots.shape[0], 1, roots.device)
    return BatchTree(roots, *rows, is_chain=True, depth_bound=0, aidx=aidx)


def batch_chain_trees(roots: torch.Tensor, tokens: torch.Tensor) -> BatchTree:
    """Each stream's root followed by its row of `tokens` [N, L] in a line (DFlash): T = L + 1, is_chain."""
    n, L = tokens.shape
    dev = tokens.device
    toks = torch.cat([roots.reshape(n, 1).to(dev, torch.long), tokens.long()], dim=1)
    *rows, aidx = _const(_chain_rows, n, L + 1, dev)
    return BatchTree(toks, *rows, is_chain=True, depth_bound=L, aidx=aidx)


@lru_cache(maxsize=64)
def _chain_rows(N: int, T: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """N full chains of T nodes: parents, depths, valid, sizes, ancestor matrix (as BatchTree orders them), then the
    ancestor index (aidx[a, h] = max(a - h, 0)); built once per shape and device (shared: never written)."""
    ar = torch.arange(T, device=device)
    rows = lambda t: t.expand(N, *t.shape).contiguous()  # noqa: E731
    anc = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    return (rows(ar - 1), rows(ar), torch.ones(N, T, dtype=torch.bool, device=device),
            torch.full((N,), T, dtype=torch.long, device=device), rows(anc), rows((ar[:, None] - ar).clamp_(min=0)))


def batch_full_trees(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                     scores: torch.Tensor | None = None, *, depth_bound: int) -> BatchTree:
    """N trees of T nodes each, every node real (no padding), given in flat order (tokens, parents (root -1, parents
    [i, j] < j), depths: long [N, T]; scores float32 [N, T] or None): the layout from the parents (ancestor index and
    matrix, O(N T depth), no host read). depth_bound: an upper bound on every depth (clamped to T - 1)."""
    N, T = tokens.shape
    dev = tokens.device
    aidx = _batch_ancestor_index(parents, min(depth_bound, T - 1))
    ancestors = torch.zeros(N, T, T, dtype=torch.bool, device=dev).scatter_(2, aidx, True)
    valid, sizes = _const(_chain_rows, N, T, dev)[2:4]  # every node valid (shared constants)
    return batch_tree_of_tensors(tokens, parents, depths, valid, sizes, ancestors, aidx, scores)


def batch_best_first(roots: torch.Tensor, logprobs: torch.Tensor, budget: int,
                     budgets: torch.Tensor | None = None, *, host: bool | None = None) -> BatchTree:
    """Every stream's DDTree at once: row i is `ddtree.engine.tree.best_first_tree(roots[i], logprobs[i], budget)`,
    the same nodes in the same flat order (`best_first_tensors`' ops with a stream dimension: one top-k, then
    `ddtree::batch_tree_build`, one launch on CUDA, three ops a depth and the layout elsewhere; no host read, shapes
    fixed by (N, budget, L, V); on a CPU where the C extension is compiled, one C call instead: `host`).
    T = 1 + tree_size(budget, L, V).

    logprobs: [N, L, V]. budgets: long [N] (each <= budget) or None: row i is then the tree of budgets[i] (its
    1 + tree_size(budgets[i], L, V) nodes in that tree's own flat order, then padding): the first budgets[i] nodes
    of the best-first order, which the build ranks anyway. host: as batch_best_first_tensors takes it."""
    if 1 + tree_size(budget, *logprobs.shape[1:]) == 1:
        return batch_root_trees(roots)
    return batch_tree_of_tensors(*batch_best_first_tensors(roots, logprobs, budget, budgets, host=host))


def batch_best_first_tensors(roots: torch.Tensor, logprobs: torch.Tensor, budget: int,
                             budgets: torch.Tensor | None = None, *, host: bool | None = None) -> tuple[torch.Tensor, ...]:
    """batch_best_first's tensors, as a compiled graph returns them (torch.compile(fullgraph=True): capturable):
    (tokens, parents, depths, valid, sizes, ancestors, aidx, scores); `batch_tree_of_tensors` makes the BatchTree.
    Needs a tree past the root (budget >= 1, L >= 1).

    host: build every row with the C extension in one call (`_batch_best_first_host`; None: on a CPU where it is
    compiled, as `ddtree.engine.tree.best_first_tree` takes it; the batched round passes False where its engine's
    options turn the `host_tree` branch off), or with the torch ops above. Both give the same tensors, bit for bit.
    Only a whole-budget build outside a traced graph takes the C call (budgets given, or torch.compile tracing: the
    torch ops)."""
    N, L, V = logprobs.shape
    n = 1 + tree_size(budget, L, V)
    dev = logprobs.device
    if budgets is None and not torch.compiler.is_compiling():
        if host is None:
            host = dev.type == "cpu" and hasattr(_tree._hosttree, "batch_best_first")
        if host:
            if not hasattr(_tree._hosttree, "batch_best_first"):
                raise RuntimeError("the C tree build (ddtree/engine/_hosttree.c) is not compiled, or is an older "
                                   "build without batch_best_first: rerun `make install`")
            built = _batch_best_first_host(roots, logprobs, budget, n)
            if built is not None:
                return built
    cost, ranked = _ranked_costs(logprobs, budget)
    sizes = None if budgets is None else budgets.to(dev, torch.long).clamp(0, n - 1) + 1
    build = _batch_tree_build if torch.compiler.is_compiling() else batch_tree_build  # one launch on CUDA
    tokens, parents, depths, scores, aidx, anc = build(cost, ranked, roots, sizes, n)
    if sizes is None:
        valid, sizes = _const(_chain_rows, N, n, dev)[2:4]  # every node valid (shared constants)
    else:
        valid = _const(_arange, n, dev) < sizes[:, None]
    return tokens, parents, depths, valid, sizes, anc, aidx, scores


def _batch_best_first_host(roots: torch.Tensor, logprobs: torch.Tensor, budget: int,
                           n: int) -> tuple[torch.Tensor, ...] | None:
    """batch_best_first_tensors in one C call (`batch_best_first` of ddtree/engine/_hosttree.c: the single-stream C
    build's search, row by row, into the batched layout), as tensors on the logits' device; None where a row's tree
    would not have n nodes (the C call's ValueError: the caller takes the torch ops)."""
    lp = logprobs.detach().cpu().float().contiguous().numpy()
    N, L, _ = lp.shape
    ints = np.empty((3, N, n), dtype=np.int64)  # tokens, parents, depths
    scores = np.empty((N, n), dtype=np.float32)
    aidx = np.empty((N, n, min(L, n - 1) + 1), dtype=np.int64)
    anc = np.empty((N, n, n), dtype=np.bool_)
    try:
        _tree._hosttree.batch_best_first(lp, budget, roots.detach().cpu().reshape(N).long().contiguous().numpy(),
                                         ints[0], ints[1], ints[2], scores, aidx, anc)
    except ValueError:
        return None
    dev = logprobs.device
    t = torch.from_numpy if dev.type == "cpu" else (lambda a: torch.from_numpy(a).to(dev))
    valid, sizes = _const(_chain_rows, N, n, dev)[2:4]  # every node valid (shared constants, as the torch ops')
    return t(ints[0]), t(ints[1]), t(ints[2]), valid, sizes, t(anc), t(aidx), t(scores)


def batch_tree_of_tensors(tokens, parents, depths, valid, sizes, ancestors, aidx, scores=None,
                          is_chain: bool = False) -> BatchTree:
    """The BatchTree of batch_best_first_tensors' outputs (or of a compiled call of it); depth_bound from aidx's
    shape."""
    return BatchTree(tokens, parents, depths, valid, sizes, ancestors, is_chain=is_chain,
                     depth_bound=aidx.shape[2] - 1, aidx=aidx, scores=scores)


def _const(fn, *args):
    """A cached constant (`fn` an lru_cache); traced (torch.compile), built in the graph without the cache wrapper."""
    return (fn.__wrapped__ if torch.compiler.is_compiling() else fn)(*args)


@lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


@lru_cache(maxsize=64)
def _hops_back(K: int, device: torch.device) -> torch.Tensor:
    """[K, K]: row d, the hops from a depth-d node up to its path's k-th node (d - k), then 0 (the node itself)."""
    ar = torch.arange(K, device=device)
    return (ar[:, None] - ar).clamp_(min=0)


def with_sizes(tree: BatchTree, sizes: torch.Tensor) -> BatchTree:
    """`tree` with row i cut to its first sizes[i] nodes (flat order: parents first, so a tree; at least the root):
    the rest become padding (parent 0, depth 1, token 0, valid False; ancestors self and the root). A chain stays a
    chain. No host read."""
    N, T = tree.tokens.shape
    dev = tree.tokens.device
    ar = _const(_arange, T, dev)
    keep = tree.valid & (ar < sizes.to(dev, torch.long).clamp(min=1)[:, None])
    pad_anc, pad_aidx = _const(_padding_constants, T, tree.depth_bound, dev)
    parents = torch.where(keep, tree.parents, 0)
    parents[:, :1] = -1
    return BatchTree(torch.where(keep, tree.tokens, 0), parents, torch.where(keep, tree.depths, 1), keep,
                     keep.sum(1), torch.where(keep[:, :, None], tree.ancestors, pad_anc),
                     is_chain=tree.is_chain, depth_bound=tree.depth_bound,
                     aidx=torch.where(keep[:, :, None], tree.ancestor_index(), pad_aidx),
                     scores=None if tree.scores is None else torch.where(keep, tree.scores, -math.inf))


@lru_cache(maxsize=64)
def _padding_constants(T: int, bound: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A padding node's ancestor matrix row (itself and the root) and ancestor index row (itself, then the root),
    for every flat position: [T, T] bool, [T, bound + 1] long."""
    ar = torch.arange(T, device=device)
    anc = (ar[:, None] == ar[None, :]) | (ar[None, :] == 0)
    aidx = torch.zeros(T, bound + 1, dtype=torch.long, device=device)
    aidx[:, 0] = ar
    return anc, aidx


# ---------------------------------------------------------------------------------------------------- the walk


def batch_walk(tree: BatchTree, choice: torch.Tensor) -> BatchWalk:
    """Every stream's `ddtree.engine.tree.walk` at once: root -> the deepest valid node whose every node past the root
    carries the target's choice at its parent. choice: long [N, T], choice[i, j] the target's token after node j of
    stream i. Torch ops on the device (`batch_walk_tensors`), then one host read for every stream's accepted tokens
    and bonus token (`read_walk`)."""
    path, lengths, next_root, packed = batch_walk_tensors(tree, choice)
    return BatchWalk(path, lengths, next_root, read_walk(packed, tree.streams))


def batch_walk_tensors(tree: BatchTree, choice: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """batch_walk's device part, no host read (capturable): (path, lengths, next_root, packed), the first three as
    BatchWalk has them; packed (long, 1-D) is what `read_walk` reads: each stream's accepted draft count [N], M
    tokens a stream, its root then the accepted drafts first [N * M], the bonus tokens [N] (a tree of the root
    alone: the bonus tokens only)."""
    N, T = tree.tokens.shape
    dev = choice.device
    if T == 1:
        nxt = choice[:, 0]
        _, zeros, _, ones = _const(_chain_rows, N, 1, dev)[:4]  # (the root alone: path [0], length 1)
        return zeros, ones, nxt, nxt
    if tree.is_chain:  # a chain's path is its prefix of matches
        hit = (tree.tokens[:, 1:] == choice[:, :-1]).logical_and_(tree.valid[:, 1:])
        k = hit.long().cumprod(1).sum(1)  # [N]: accepted drafts
        nxt = choice.gather(1, k[:, None])[:, 0]
        packed = torch.cat([k, tree.tokens.reshape(-1), nxt])
        return torch.minimum(_const(_arange, T, dev), k[:, None]), k + 1, nxt, packed
    aidx = tree.ancestor_index()
    K = aidx.shape[2]
    # a node matches: valid and its token the choice at its parent (the root: always)
    below = (tree.tokens[:, 1:] == choice.gather(1, tree.parents[:, 1:])).logical_and_(tree.valid[:, 1:])
    match = torch.cat([_const(_chain_rows, N, 1, dev)[2], below], dim=1)
    ok = match.gather(1, aidx.view(N, T * K)).view(N, T, K).all(dim=2)  # every ancestor-or-self matches
    # the deepest (one path a row); only the root: depth 0 everywhere, and argmax takes the first, the root
    end = (tree.depths * ok).argmax(dim=1, keepdim=True)  # [N, 1]
    depth = tree.depths.gather(1, end)[:, 0]  # [N]: accepted drafts
    up = aidx.gather(1, end[:, :, None].expand(N, 1, K))[:, 0]  # end, its parent, ..., the root, the root, ...
    path = up.gather(1, _const(_hops_back, K, dev).index_select(0, depth))  # root first, then the end repeated
    nxt = choice.gather(1, end)[:, 0]
    packed = torch.cat([depth, tree.tokens.gather(1, path).view(-1), nxt])
    return path, depth + 1, nxt, packed


def read_walk(packed: torch.Tensor, N: int) -> list[list[int]]:
    """The round's one host read: per stream its accepted draft tokens then the bonus token, from
    batch_walk_tensors' packed tensor."""
    return walk_lists(packed.tolist(), N)


def walk_lists(host: list[int], N: int) -> list[list[int]]:
    """read_walk's lists from the packed tensor's values already on the host (a read that carries more with it)."""
    if len(host) == N:  # the roots alone: the bonus tokens
        return [[t] for t in host]
    m = (len(host) - 2 * N) // N
    return [host[N + i * m + 1: N + i * m + 1 + host[i]] + [host[N + N * m + i]] for i in range(N)]


# ---------------------------------------------------------------------------------------------------- sampling

def keyed_choice(logits: torch.Tensor, temperature: float, seeds: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """The target's token after each node, sampled from softmax(logits / temperature) with noise keyed by the stream
    and the absolute position, not drawn from a generator: argmax(logits * (1 / temperature) + Gumbel(u)), u =
    keyed_uniform(seeds, positions, V) (ddtree.engine.kernels.sampling: `ddtree::keyed_choice`, one launch on CUDA).
    logits [N, T, V], seeds long [N] (one per stream), positions long [N, T]: the absolute position (index in the
    stream's sequence) the chosen token takes (`positions_after`). Temperature 0: the argmax. (NaN logits: the
    kernel never picks them, the composite's argmax does.)

    A stream's choices do not depend on the other streams, and nodes at the same position share noise: the token
    committed at each position is a function of (seed, position, the committed prefix), so every method commits what
    AR sampling with the same seed commits (only one node a depth lies on the accepted path)."""
    if temperature <= 0:
        return logits.argmax(-1)
    op = _keyed_choice if torch.compiler.is_compiling() else sampling.keyed_choice
    return op(logits, seeds.to(logits.device, torch.long), positions.to(logits.device, torch.long), 1.0 / temperature)


def keyed_draft_choice(logits: torch.Tensor, temperature: float, seeds: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """A drafter's sampled chain, coupled to the target: the same keyed noise at the same absolute positions
    (`keyed_choice` on the drafter's logits [N, L, V], positions [N, L] the drafted tokens' own). Where the drafter's
    distribution is the target's, the draft is the target's sample; only the target's samples are committed, so the
    coupling costs nothing in exactness and raises acceptance."""
    return keyed_choice(logits, temperature, seeds, positions)


def positions_after(root_positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The absolute position of the token chosen after each node: its root's position (long [N]) + depth + 1."""
    return root_positions.to(depths.device, torch.long)[:, None] + depths + 1
