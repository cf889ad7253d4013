"""Proposers over a DFlash2 drafter's candidate selector (ddtree.engine.drafter.dflash2): the chain the serving
engines draft (method=dflash) and DDTree's two scorings (method=ddtree scoring=marginal|pair).

* chain: the selector's walk from the anchor: at each position the candidate maximising S_t(prev, .) (T = 0), or
  a sample of softmax(S_t(prev, .) / T) over the candidates (T > 0); the token taken is the next predecessor.
* marginal: today's DDTree best-first tree over the per-position distributions (the drafter's logits with its
  multiplier and soft cap).
* pair: a best-first tree whose children know their parent: a child b of a node with token a at position t scores
  log p_t(b | a), the drafter's distribution with position t's candidates' logits replaced by S_t(a, .)
  (pair_logprobs), its path's score the sum along the path.

Every tree is verified by the loop as any other (the target's choice after each node, the deepest consistent
path): lossless whatever the proposal. The chain sampled at T > 0 carries its draft rows and is verified by
speculative sampling instead (ddtree.engine.tree.rejection_walk), as the serving engines verify it.
"""

from __future__ import annotations

import functools
import math

import torch

from ddtree.engine.batch_tree import BatchTree, batch_chain_trees, batch_full_trees, keyed_uniform
from ddtree.engine.checks import check_budget
from ddtree.engine.drafter.dflash2 import Candidates
from ddtree.engine.proposers import DDTreeProposer, DecodeState, DrafterBlock
from ddtree.engine.tree import (
    DraftTree,
    _ancestor_index,
    _ancestor_matrix,
    chain_tensors,
    chain_tree,
    tree_of_tensors,
)


class _SelectorHead:
    """Mixin for a DrafterBlock over a DFlash2 drafter: its logits carry the drafter's multiplier and soft cap."""

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter.head_logits(self.lm_head, hidden)

    def candidates(self, state: DecodeState):
        """This round's selector inputs (ddtree.engine.drafter.dflash2.Candidates), on the root's device."""
        logits = self.draft_logits(state)
        hidden = self.last_hidden.to(logits.device)
        return self.drafter.candidates(logits, hidden)


PAIR_FLOOR = -50.0  # a recorded pair row's log-probability of a token outside its candidates (e^-50: never drafted)


class _PairRecord(_SelectorHead):
    """Mixin for the proposers that draft by pair scores (the chain, the pair tree): the diagnosis records the pair rows
    given the target's path, not the marginal logits (`record_logits`)."""

    record_scores = "pair"
    draft_hidden = True  # the selector reads the block's final hidden rows (the compiled drafter returns them)
    last_cand = None  # the latest round's Candidates (from a compiled tree: their `outputs()`, rebuilt when recorded)

    def candidates(self, state: DecodeState):
        self.last_cand = super().candidates(state)
        return self.last_cand

    def compiled_tree(self, state: DecodeState):
        """The round's draft (the compiled drafter's, from the second round) and its tree's tensors from the compiled
        round's graph of `tree_graph` (`tree_tensors`); the candidates kept for the diagnosis."""
        with state.timer.stage("draft"):
            logits = self.draft_logits(state)
        with state.timer.stage("tree"):
            out, self.last_cand = self.tree_tensors(state.root, logits, self.last_hidden.to(logits.device))
            return out

    def batch_tree(self, roots: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, budget: int | None,
                   temperature: float, seeds: torch.Tensor, positions: torch.Tensor | None) -> BatchTree:
        """The batched round's trees (ddtree.engine.batch), every stream's in the same ops: its selector walk (budget
        None: the chain; at T > 0 a sample of each position's softmax over its candidates with the noise keyed as the
        target's choice at the drafted token's position, `positions` [N, L]: the coupling of keyed_draft_choice at
        the candidates; verified by the walk), or its pair tree of `budget` nodes (batch_pair_tree)."""
        cand = self.drafter.candidates(logits, hidden)
        if budget is not None:
            return batch_pair_tree(roots, cand, budget)
        if temperature <= 0:
            return batch_chain_trees(roots, selector_walk(cand, roots))
        gumbel = keyed_uniform(seeds, positions, logits.shape[-1]).gather(2, cand.ids).log_().neg_().log_().neg_()
        return batch_chain_trees(roots, selector_walk(cand, roots, temperature, noise=gumbel))

    @torch.inference_mode()
    def record_logits(self, tree: DraftTree, path: torch.Tensor, accepted: int) -> torch.Tensor:
        cand = self.last_cand
        if isinstance(cand, tuple):
            cand = Candidates.of_outputs(cand, self.drafter.candidate_selector.predecessor_codebook.float())
        return path_pair_rows(cand, tree, path, accepted, self.last_logits.shape[-1])


def path_pair_rows(cand, tree: DraftTree, path: torch.Tensor, accepted: int, vocab: int) -> torch.Tensor:
    """[L, V] log-probabilities of each position under pair scores given the target's path: row t holds, at position
    t's candidates, log p_t(. | a_t) as pair_logprobs scores them, a_t the path's token at depth t (the root for t = 0)
    as far as the path is known (depth min(accepted, L - 1)), past it the previous position's best marginal
    candidate; PAIR_FLOOR outside the candidates (a pair tree never drafts them). On the device, no host read (the
    diagnosis's rows, ddtree.engine.diagnostics)."""
    L, k = cand.ids.shape
    m = min(accepted + 1, L)
    prev = torch.cat([tree.tokens[path[:m]], cand.ids[m - 1:L - 1, 0]])  # [L]
    ctx = cand.pred[prev] * cand.proj  # [L, r]
    scores = cand.unary + torch.bmm(cand.succ, ctx[:, :, None])[:, :, 0]
    rows = scores - torch.logaddexp(scores.logsumexp(-1), cand.rest)[:, None]
    return torch.full((L, vocab), PAIR_FLOOR, device=rows.device).scatter_(1, cand.ids, rows)


class DFlash2ChainProposer(_PairRecord, DrafterBlock):
    """method=dflash over a DFlash2 drafter: the selector's walk from the anchor (argmax at T = 0, a sample of the
    softmax over the candidates at T > 0)."""

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        if self.tree_tensors is not None and state.temperature <= 0:  # (a sampled walk stays eager)
            tokens, parents, depths, anc = self.compiled_tree(state)
            return DraftTree(tokens, parents, depths, is_chain=True, depth_bound=len(tokens) - 1, _anc=anc)
        with state.timer.stage("draft"):
            cand = self.candidates(state)
        with state.timer.stage("tree"):
            if state.temperature <= 0:
                return chain_tree(state.root, selector_walk(cand, state.root))
            # a sample of the selector's softmax at each position, verified by rejection against it (the loop)
            return chain_tree(state.root, *selector_walk(cand, state.root, state.temperature, state.generator,
                                                         draft_probs=True))

    def tree_graph(self, root: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor):
        """The greedy walk's chain (chain_tensors) and the candidates' outputs: the compiled round's graph."""
        cand = self.drafter.candidates(logits, hidden)
        return chain_tensors(root, selector_walk(cand, root)), cand.outputs()


class DFlash2MarginalProposer(_SelectorHead, DDTreeProposer):
    """method=ddtree scoring=marginal over a DFlash2 drafter: DDTree over its per-position distributions."""


class PairTreeProposer(_PairRecord, DrafterBlock):
    """method=ddtree scoring=pair: the best-first `budget` nodes under the selector's conditional scores."""

    def __init__(self, target, drafter, budget: int, block_size: int | None = None):
        super().__init__(target, drafter, block_size)
        check_budget(budget)
        self.budget = budget
        self.max_nodes = max(self.block_size, budget + 1)
        self.last_top1: torch.Tensor | None = None  # the latest tree's per-node "best child of its parent" flags

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        if self.tree_tensors is not None:
            tree, self.last_top1 = self.compiled_tree(state)
            return tree_of_tensors(*tree)
        with state.timer.stage("draft"):
            cand = self.candidates(state)
        with state.timer.stage("tree"):
            # the diagnosis's top-1 of each node (ddtree.engine.diagnostics): its parent's best child under pair scores
            lp = pair_logprobs(cand, state.root)
            tree, self.last_top1 = pair_tree(state.root, lp, cand.ids, self.budget)
            return tree

    def tree_graph(self, root: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor):
        """(the pair tree's tensors as tree_of_tensors takes them, its top-1 flags), the candidates' outputs: the
        compiled round's graph."""
        cand = self.drafter.candidates(logits, hidden)
        *tree, top1 = pair_tree_tensors(root, pair_logprobs(cand, root), cand.ids, self.budget)
        aidx = _ancestor_index(tree[1], min(cand.ids.shape[0], self.budget))
        return ((*tree, aidx, _ancestor_matrix(aidx)), top1), cand.outputs()


def selector_walk(cand, root: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None, *,
                  draft_probs: bool = False, noise: torch.Tensor | None = None):
    """The selector's chain [L] from the anchor `root`, on the device (no host read): every pair score of the block
    first (pair_scores: a few batched ops), then per position one row read and its argmax (or a sample of
    softmax(S_t(prev, .) / T) over the candidates). draft_probs (T > 0): (chain, q [L, V]), q_t those softmax rows
    scattered into the vocabulary, 0 outside position t's candidates (what the chain is verified against by
    rejection: ddtree.engine.tree.rejection_walk).

    With a stream dimension (cand's fields [N, L, ...], root [N]: the batched round, ddtree.engine.batch): every
    stream's chain [N, L] in the same ops (a position's reads gathered per stream), row i the walk of stream i alone;
    at T > 0 `noise` [N, L, k] (Gumbel noise at the candidates, keyed by stream and position: the batched round's
    sample, coupled to the target's) instead of a generator: argmax(S_t(prev, .) / T + noise_t)."""
    first, trans = pair_scores(cand, root)
    *lead, L, k = cand.ids.shape
    picks, rows = [], []  # picks [..., 1]: a pick, shaped as the next row's index
    for t in range(L):
        # (a gather, not trans[t - 1, pick]: a 0-d tensor as a Python index is read on the host)
        s = first[..., None, :] if t == 0 else trans[..., t - 1, :, :].gather(
            -2, picks[-1][..., None].expand(*lead, 1, k))  # [..., 1, k]
        if noise is not None:
            picks.append((s * (1.0 / temperature) + noise[..., t: t + 1, :]).argmax(-1))
        elif temperature > 0:
            rows.append(torch.softmax(s / temperature, dim=-1))
            picks.append(torch.multinomial(rows[-1], 1, generator=generator)[0])
        else:
            picks.append(s.argmax(-1))
    chain = cand.ids.gather(-1, torch.cat(picks, dim=-1)[..., None])[..., 0]
    if not draft_probs:
        return chain
    q = torch.zeros(L, cand.pred.shape[0], device=chain.device)
    return chain, q.scatter_(1, cand.ids, torch.cat(rows))


def pair_scores(cand, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [k], trans [L - 1, k, k]): S_0(root, .) over position 0's candidates, and
    trans[t - 1, i, j] = S_t(ids[t - 1, i], ids[t, j]) (a parent at position t - 1 is one of its candidates).
    With a stream dimension (cand's fields [N, L, ...], root [N]): [N, k] and [N, L - 1, k, k], row by row."""
    # one product for every position: position 0's predecessor the root (repeated over a row of k, one row kept),
    # position t's the candidates of t - 1 (the same ops with or without streams, so row i is stream i's alone)
    *lead, L, k = cand.ids.shape
    prev = torch.cat([root.reshape(*lead, 1, 1).long().expand(*lead, 1, k), cand.ids[..., :-1, :]], dim=-2)
    ctx = cand.pred[prev] * cand.proj[..., :, None, :]  # [..., L, k, r]: P[a] * W h_t
    every = cand.unary[..., :, None, :] + ctx @ cand.succ.transpose(-1, -2)  # [..., L, k, k]
    return every[..., 0, 0, :], every[..., 1:, :, :]


def pair_logprobs(cand, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pair_scores as log-probabilities of the drafter's distribution with the candidates' logits replaced by their
    pair scores: log p_t(b | a) = S_t(a, b) - log(sum_c exp S_t(a, c) + sum of exp logit_t(v) over the other tokens v)
    (`cand.rest`: the log of that last sum). The mass beyond the candidates stays in the normaliser, so a position whose
    candidates are unsure costs as much as under marginal scores (normalising over the candidates alone made deep
    nodes look surer than they are: tau 7.51 against 7.90 at budget 16 on the toy pair, docs/dflash2.md).
    With a stream dimension as pair_scores."""
    first, trans = pair_scores(cand, root)
    z0 = torch.logaddexp(first.logsumexp(-1), cand.rest[..., 0])
    zt = torch.logaddexp(trans.logsumexp(-1), cand.rest[..., 1:, None])  # [..., L - 1, k]
    return first - z0[..., None], trans - zt[..., None]


@functools.lru_cache(maxsize=64)
def _beam_layout(widths: tuple[int, ...], k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """pair_tree's constants per list entry (the root first, then the beams), made on the device once per shape:
    depth, the previous beam's offset (where a local parent index points in the list), the entry's row in the
    flattened ids ((depth - 1) * k), its parent's row of best children (0: the first row; 1 + (depth - 2) * k), and
    whether that row depends on the parent's candidate (depth >= 2)."""
    def per_entry(values):
        return torch.cat([torch.full((w,), v, dtype=torch.long, device=device) for w, v in zip(widths, values, strict=True)])

    starts = [1 + sum(widths[:t]) for t in range(len(widths))]
    depth = list(range(1, len(widths) + 1))
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return (torch.cat([zero, per_entry(depth)]), per_entry([0] + starts[:-1]), per_entry([(d - 1) * k for d in depth]),
            per_entry([0 if d == 1 else 1 + (d - 2) * k for d in depth]), per_entry([int(d >= 2) for d in depth]))


def pair_tree(root: torch.Tensor, logprobs: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor,
              budget: int) -> tuple[DraftTree, torch.Tensor]:
    """(tree, top1): pair_tree_tensors' tree, and its top-1 flags."""
    tokens, parents, depths, scores, top1 = pair_tree_tensors(root, logprobs, ids, budget)
    return DraftTree(tokens, parents, depths, scores=scores, depth_bound=min(ids.shape[0], budget)), top1


def pair_tree_tensors(roots: torch.Tensor, logprobs: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor,
                      budget: int) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths, scores, top1): the best-first tree of `budget` nodes under pair scores, built on the
    scores' device without a host read or a host-to-device copy (shapes fixed by budget, L and k), and per node
    whether it is its parent's best child (the root: True; ties: the better-ranked candidate, as argmax).

    One stream (roots [], logprobs ([k], [L - 1, k, k]), ids [L, k]; every output [1 + tree_size(budget, L, k)]) or N
    at once (a leading stream dimension on each: outputs [N, 1 + tree_size]): row i is stream i's tree, node for node
    (the same float32 sums and stable sorts, row by row); the ops do not depend on N, and one stream dispatches no
    more than the stream dimension's absence asks.

    A node is (position t, candidate i); its children are position t + 1's candidates, costing -trans[t, i]. Depth by
    depth a beam (five ops: the rows of the beam's candidates, the pairs' costs, a stable sort, parent and child): the
    best `budget` paths of the depth (every node the tree selects at a depth is among them: any other has `budget`
    better ones there, whose ancestors cost no more). Then one stable sort of the root and all beams, depth-major on
    equal costs, keeps the first 1 + budget: best first, so parents precede children (a child costs at least its
    parent, and on a tie the shallower comes first). scores: the paths' summed log-probabilities."""
    first, trans = logprobs
    *lead, L, k = ids.shape  # lead: [] (one stream) or [N]
    dev = first.device
    # costs >= +0.0 (x + 0.0 turns -0.0 into +0.0, which a radix sort would put first); NaN: no candidate
    c0 = torch.nan_to_num(first.float(), nan=-math.inf).neg().clamp(min=0.0) + 0.0
    ct = torch.nan_to_num(trans.float(), nan=-math.inf).neg().clamp(min=0.0) + 0.0
    cost, cand = c0.sort(dim=-1, stable=True)
    cost, cand = cost[..., :budget], cand[..., :budget]
    costs, cands, parents = [cost], [cand], [torch.zeros_like(cand)]
    layout = _beam_layout.__wrapped__ if torch.compiler.is_compiling() else _beam_layout  # (a graph: its constants)
    # N streams: [N, 1], each stream's row beside its beam's candidates (made here: a cached one made under
    # inference_mode could not index a tensor autograd tracks); one stream: nothing
    streams = (torch.arange(lead[0], device=dev)[:, None],) if lead else ()
    for t in range(1, L):
        rows = ct[..., t - 1, :, :][(*streams, cand)]  # [..., beam, k]: each beam's candidates' rows
        cost, idx = (cost[..., None] + rows).reshape(*lead, -1).sort(dim=-1, stable=True)
        cost, idx = cost[..., :budget], idx[..., :budget]
        parents.append(idx.div(k, rounding_mode="floor"))
        cand = idx.remainder(k)
        costs.append(cost)
        cands.append(cand)
    depth, offset, row, best_row, by_parent = layout(tuple(c.shape[-1] for c in cands), k, dev)
    n = 1 + min(budget, depth.shape[0] - 1)
    cand_all = torch.cat(cands, dim=-1)
    parent_all = torch.cat(parents, dim=-1).add_(offset)  # each entry's parent's place in the list (the root: 0)
    tok_all = torch.cat([roots.reshape(*lead, 1).long(), ids.reshape(*lead, -1).gather(-1, row + cand_all)], dim=-1)
    # an entry is its parent's best child: position 0's best, or the best of its parent's candidate's row
    best = torch.cat([first.argmax(-1, keepdim=True), trans.argmax(-1).reshape(*lead, -1)], dim=-1)
    pc = torch.cat([cand_all[..., :1], cand_all], dim=-1).gather(-1, parent_all)  # (the root's slot: by_parent 0)
    top_all = torch.cat([torch.ones(*lead, 1, dtype=torch.bool, device=dev),
                         cand_all == best.gather(-1, best_row + by_parent * pc)], dim=-1)
    all_cost = torch.cat([torch.zeros(*lead, 1, device=dev), *costs], dim=-1)
    sel = all_cost.sort(dim=-1, stable=True).indices[..., :n]
    place = torch.zeros(*lead, depth.shape[0], dtype=torch.long, device=dev).scatter_(
        -1, sel, torch.arange(n, device=dev).expand(*lead, n))
    parent_of = torch.cat([torch.full((*lead, 1), -1, dtype=torch.long, device=dev), place.gather(-1, parent_all)],
                          dim=-1)
    return (tok_all.gather(-1, sel), parent_of.gather(-1, sel), depth[sel], all_cost.gather(-1, sel).neg(),
            top_all.gather(-1, sel))


def batch_pair_tree(roots: torch.Tensor, cand, budget: int) -> BatchTree:
    """Every stream's pair tree as a BatchTree (ddtree.engine.batch_tree; the batched round's method=ddtree
    scoring=pair): row i is `pair_tree(roots[i], pair_logprobs(cand_i, roots[i]), cand_i.ids, budget)`, cand's fields
    with a stream dimension (the drafter's `candidates` of [N, L, V] logits and [N, L, H] hidden rows). Every row
    holds the same node count (shapes fixed by budget, L and k), so no padding; no host read."""
    tokens, parents, depths, scores, _ = pair_tree_tensors(roots, pair_logprobs(cand, roots), cand.ids, budget)
    return batch_full_trees(tokens, parents, depths, scores, depth_bound=min(cand.ids.shape[1], budget))
