"""Proposers over a DFlash2 drafter's candidate selector (ddtree.engine.drafter.dflash2): the chain the serving
engines draft (method=dflash) and DDTree's two scorings (method=ddtree scoring=marginal|pair).

* chain: the selector's walk from the anchor: at each position the candidate maximising S_t(prev, .) (T = 0), or
  a sample of softmax(S_t(prev, .) / T) over the candidates (T > 0); the token taken is the next predecessor.
* marginal: today's DDTree best-first tree over the per-position distributions (the drafter's logits with its
  multiplier and soft cap).
* pair: a best-first tree whose children know their parent: a child b of a node with token a at position t scores
  log_softmax over position t's candidates of S_t(a, .), its path's score the sum along the path.

Every tree is verified by the loop as any other (the target's choice after each node, the deepest consistent
path): lossless whatever the proposal.
"""

from __future__ import annotations

import heapq

import torch

from ddtree.engine.checks import check_budget
from ddtree.engine.proposers import DDTreeProposer, DecodeState, DrafterBlock
from ddtree.engine.tree import DraftTree, chain_tree, tree_from_parents


class _SelectorHead:
    """Mixin for a DrafterBlock over a DFlash2 drafter: its logits carry the drafter's multiplier and soft cap."""

    static_form = None  # its convolutions and selector are not in the compiled drafter (StaticDraft): it drafts eagerly

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter.head_logits(self.lm_head, hidden)

    def candidates(self, state: DecodeState):
        """This round's selector inputs (ddtree.engine.drafter.dflash2.Candidates), on the root's device."""
        logits = self.draft_logits(state)
        hidden = self.last_hidden.to(logits.device)
        return self.drafter.candidates(logits, hidden)


class DFlash2ChainProposer(_SelectorHead, DrafterBlock):
    """method=dflash over a DFlash2 drafter: the selector's walk from the anchor (argmax at T = 0, a sample of the
    softmax over the candidates at T > 0)."""

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            cand = self.candidates(state)
        with state.timer.stage("tree"):
            return chain_tree(state.root, selector_walk(cand, state.root, state.temperature, state.generator))


class DFlash2MarginalProposer(_SelectorHead, DDTreeProposer):
    """method=ddtree scoring=marginal over a DFlash2 drafter: DDTree over its per-position distributions."""


class PairTreeProposer(_SelectorHead, DrafterBlock):
    """method=ddtree scoring=pair: the best-first `budget` nodes under the selector's conditional scores."""

    def __init__(self, target, drafter, budget: int, block_size: int | None = None):
        super().__init__(target, drafter, block_size)
        check_budget(budget)
        self.budget = budget
        self.last_top1: torch.Tensor | None = None  # the latest tree's per-node "best child of its parent" flags

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            cand = self.candidates(state)
        with state.timer.stage("tree"):
            top1: list[bool] = []
            tree = pair_tree(state.root, pair_logprobs(cand, state.root), cand.ids, self.budget, top1)
            # the diagnosis's top-1 of each node (ddtree.engine.diagnostics): its parent's best child under pair scores
            self.last_top1 = torch.tensor(top1, device=tree.tokens.device)
            return tree


def selector_walk(cand, root: torch.Tensor, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The selector's chain [L] from the anchor `root`, on the device (no host read): every pair score of the block
    first (pair_scores: a few batched ops), then per position one row read and its argmax (or a sample)."""
    first, trans = pair_scores(cand, root)
    picks = []
    for t in range(cand.ids.shape[0]):
        s = first if t == 0 else trans[t - 1, picks[-1]]
        if temperature > 0:
            picks.append(torch.multinomial(torch.softmax(s / temperature, dim=-1), 1, generator=generator)[0])
        else:
            picks.append(s.argmax())
    return cand.ids.gather(1, torch.stack(picks)[:, None])[:, 0]


def pair_scores(cand, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [k], trans [L - 1, k, k]): S_0(root, .) over position 0's candidates, and
    trans[t - 1, i, j] = S_t(ids[t - 1, i], ids[t, j]) (a parent at position t - 1 is one of its candidates)."""
    first = cand.scores(0, root.reshape(()))
    ctx = cand.pred[cand.ids[:-1]] * cand.proj[1:, None, :]  # [L - 1, k, r]: P[a] * W h_t
    return first, cand.unary[1:, None, :] + ctx @ cand.succ[1:].transpose(1, 2)


def pair_logprobs(cand, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pair_scores as log-probabilities over each position's candidates (log_softmax along the last dimension)."""
    first, trans = pair_scores(cand, root)
    return torch.log_softmax(first, dim=-1), torch.log_softmax(trans, dim=-1)


def pair_tree(root: torch.Tensor, logprobs: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor,
              budget: int, top1: list[bool] | None = None) -> DraftTree:
    """The best-first tree of `budget` nodes under pair scores (one host read): a node is (position t, candidate i),
    its children the candidates of position t + 1 scored by trans[t, i]. Nodes in selection order (best first; equal
    scores: the one found first), so parents precede children. top1: a list to fill with, per node, whether it is
    its parent's best child (the root: True)."""
    first, trans = logprobs
    L, k = ids.shape
    # one host read: the scores and the candidates' tokens (ids < 2**53: exact in float64)
    host = torch.cat([root.reshape(1).double(), first.double(), trans.double().reshape(-1), ids.double().reshape(-1)])
    values = host.tolist()
    root_tok, first_l = int(values[0]), values[1: 1 + k]
    trans_l = values[1 + k: 1 + k + (L - 1) * k * k]
    ids_l = [int(v) for v in values[1 + k + (L - 1) * k * k:]]
    heap = [(-first_l[i], i, 0, i, 0) for i in range(k)]  # (-score, order found, position, candidate, parent)
    cand_of = [-1]  # each node's candidate index at its position
    heapq.heapify(heap)
    found = k
    tokens, parents, best = [root_tok], [-1], [True]
    while heap and len(tokens) <= budget:
        neg, _, t, i, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids_l[t * k + i])
        parents.append(parent)
        if top1 is not None:  # its parent's row of scores (the root's: first), the first best on ties
            row = first_l if t == 0 else trans_l[((t - 1) * k + cand_of[parent]) * k:((t - 1) * k + cand_of[parent] + 1) * k]
            best.append(i == row.index(max(row)))
        cand_of.append(i)
        if t + 1 < L:
            row = (t * k + i) * k
            for j in range(k):
                heapq.heappush(heap, (neg - trans_l[row + j], found, t + 1, j, node))
                found += 1
    if top1 is not None:
        top1[:] = best
    return tree_from_parents(tokens, parents, device=root.device)
