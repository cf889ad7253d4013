"""The rank model of acceptance: at depth d the target's token has rank r in the drafter's row with probability
p_d(r | state), state 0 while the path above stayed on the drafter's top-1 chain and 1 once it left it, independently
across depths. Its expected tau for the best tree of B nodes is 1 + the sum of the B largest path products
prod_d p_d(r_d | state) (`predict_taus`); a chain's is 1 + sum_d prod_{i<=d} p_i(0) (`chain_tau`).

One home for the prediction the diagnosis (ddtree.pipeline.diagnose: tau against the node budget) and the per-round
budget controller (ddtree.engine.adaptive: tau against the load) both make."""

from __future__ import annotations

import heapq

from ddtree.engine.diagnostics import RANK_CAP


class _Row:
    """One depth's rank probabilities in descending order, without listing a vocabulary: the measured ranks, and the
    mass beyond RANK_CAP spread evenly over the `tail` ranks past them (a run of equal values, merged in order)."""

    def __init__(self, probs: list[float], vocab: int | None):
        explicit = probs[:RANK_CAP]
        beyond = probs[RANK_CAP] if len(probs) > RANK_CAP else 0.0
        self.tail = max(0, (vocab or 0) - RANK_CAP) if beyond > 0 else 0
        self.t = beyond / self.tail if self.tail else 0.0
        ranked = sorted(((p, r) for r, p in enumerate(explicit) if p > 0), reverse=True)
        self.hi = [x for x in ranked if x[0] > self.t]
        self.lo = [x for x in ranked if x[0] <= self.t]

    def __len__(self) -> int:
        return len(self.hi) + self.tail + len(self.lo)

    def __getitem__(self, k: int) -> tuple[float, int]:
        """(probability, rank) of the k-th likeliest rank (a tail rank is reported as RANK_CAP)."""
        if k < len(self.hi):
            return self.hi[k]
        if k < len(self.hi) + self.tail:
            return self.t, RANK_CAP
        return self.lo[k - len(self.hi) - self.tail]


def predict_taus(main: list[list[float]], off: list[list[float]], max_budget: int,
                 vocab: int | None = None) -> list[float]:
    """Expected tau of the best tree of each budget 0 … max_budget under the rank model (module docstring).

    A best-first search over rank paths: a node's probability is its parent's times p_d(r | state); popping in
    descending probability selects, after B pops, the B most likely paths (a prefix's probability is at least its
    extensions', so the set is a tree). taus[B] = 1 + the sum of the B popped probabilities. Rows may end with the mass
    beyond RANK_CAP: with `vocab`, it is spread evenly over the vocab - RANK_CAP ranks past the cap (a flat drafter's
    big trees reach them), else left out."""
    L = len(main)
    order = [[_Row(tab[d], vocab) for d in range(L)] for tab in (main, off)]
    taus = [1.0]
    # heap item: (-prob, tie, depth index, parent prob, parent state, index in the sorted row)
    heap: list[tuple[float, int, int, float, int, int]] = []
    tie = 0

    def push(d: int, parent_p: float, state: int, k: int) -> None:
        nonlocal tie
        if d < L and k < len(order[state][d]):
            tie += 1
            heapq.heappush(heap, (-parent_p * order[state][d][k][0], tie, d, parent_p, state, k))

    push(0, 1.0, 0, 0)
    total = 0.0
    while heap and len(taus) <= max_budget:
        neg, _, d, parent_p, state, k = heapq.heappop(heap)
        total += -neg
        taus.append(1.0 + total)
        push(d, parent_p, state, k + 1)  # next sibling
        rank = order[state][d][k][1]
        push(d + 1, -neg, int(state == 1 or rank != 0), 0)  # first child: off the chain once a rank above is not 0
    while len(taus) <= max_budget:  # nothing left with a nonzero probability
        taus.append(taus[-1])
    return taus


def chain_tau(main: list[list[float]]) -> float:
    """1 + sum_d prod_{i<=d} p_i(0): a chain's expected tau (the check of predict_taus at budget 1 … L)."""
    tau, run = 1.0, 1.0
    for row in main:
        run *= row[0]
        tau += run
    return tau
