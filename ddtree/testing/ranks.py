"""A scripted drafter with known per-depth rank distributions, and the exact expected tau it gives.

`RankScriptedProposer` knows the target's greedy continuation. Each round it writes drafter log-probabilities for
L positions: row d gives its rank-r token probability p_d(r) (a calibrated drafter), and the target's true token
at depth d + 1 is placed at rank r with probability p_d(r), independently across depths and rounds, whatever the
prefix (so the rank model's independence holds exactly). It proposes the best-first tree of `budget` nodes from
those rows (budget None: the argmax chain of all L positions, as DFlash), and exposes the rows as `last_logits`
for the round recorder. `exact_tau` is the expected tau of such rounds, by enumeration.

With `scores`, the rows it writes hold those probabilities instead (a drafter whose scores do not track acceptance,
as a random drafter's do not): the target's token still takes rank r with probability probs[d][r], but the tree is
the best-first one under `scores`.
"""

from __future__ import annotations

import itertools
import random

import torch

from ddtree.engine.proposers import Proposer
from ddtree.engine.tree import DraftTree, best_first_tree, chain_tree


class RankScriptedProposer(Proposer):
    diagnoses = True  # its rows, as last_logits

    def __init__(self, reference: list[int], vocab: int, probs: list[list[float]], budget: int | None,
                 seed: int = 0, scores: list[list[float]] | None = None):
        """probs[d][r]: the chance that the target's token at depth d + 1 has rank r (r < len(probs[d]); the rest of
        the mass: a rank past them, uniformly among the other tokens)."""
        self.reference, self.vocab, self.probs, self.budget = reference, vocab, probs, budget
        self.block_size = len(probs) + 1
        self.max_nodes = (len(probs) if budget is None else budget) + 1
        self.rng = random.Random(seed)
        self.last_logits: torch.Tensor | None = None
        self.history: list[tuple[int, torch.Tensor]] = []  # per round: tokens generated before it, its rows
        rows = []
        for p in scores or probs:
            rest = max(0.0, 1.0 - sum(p))
            tail = [rest / (vocab - len(p))] * (vocab - len(p))
            assert not tail or tail[0] < p[-1], "the tail's tokens must rank below the scripted ones"
            rows.append([*p, *tail])
        self.row_probs = torch.tensor(rows, dtype=torch.float64).clamp(min=1e-30)

    def _rank(self, d: int) -> int:
        u, acc = self.rng.random(), 0.0
        for r, p in enumerate(self.probs[d]):
            acc += p
            if u < acc:
                return r
        return self.rng.randrange(len(self.probs[d]), self.vocab)

    def propose(self, state) -> DraftTree:
        pos = len(state.generated)
        L = len(self.probs)
        logits = torch.empty(L, self.vocab, dtype=torch.float32)
        for d in range(L):
            true = self.reference[pos + d] if pos + d < len(self.reference) else self.rng.randrange(self.vocab)
            others = [t for t in range(self.vocab) if t != true]
            self.rng.shuffle(others)
            r = self._rank(d)
            order = others[:r] + [true] + others[r:]  # order[k]: the token of rank k
            logits[d, torch.tensor(order)] = self.row_probs[d].log().float()
        self.last_logits = logits.to(state.root.device)
        self.history.append((pos, logits))
        if self.budget is None:
            return chain_tree(state.root, self.last_logits.argmax(-1))
        return best_first_tree(state.root, torch.log_softmax(self.last_logits, -1), self.budget)


def exact_tau(probs: list[list[float]], budget: int | None, scores: list[list[float]] | None = None) -> float:
    """The expected tau of RankScriptedProposer's rounds: 1 + the sum over the tree's nodes of the chance that the target's
    path passes through them. The tree holds the `budget` rank paths of highest score (the drafter's: `scores`, or,
    calibrated, these probabilities); None: the chain of rank 0 at every depth. By enumeration of every rank path over
    the scripted ranks (small L and rank counts, and budgets whose trees hold no rank past them, only)."""
    L = len(probs)
    if budget is None:
        tau, run = 1.0, 1.0
        for p in probs:
            run *= p[0]
            tau += run
        return tau
    scores = scores or probs
    paths = []
    for depth in range(1, L + 1):
        for ranks in itertools.product(*(range(len(probs[d])) for d in range(depth))):
            pr, sc = 1.0, 1.0
            for d, r in enumerate(ranks):
                pr *= probs[d][r]
                sc *= scores[d][r]
            paths.append((-sc, depth, pr))
    return 1.0 + sum(pr for _, _, pr in sorted(paths)[:budget])
