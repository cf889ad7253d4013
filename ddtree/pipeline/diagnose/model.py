"""The prediction of tau against the node budget: the rank model (`predict_taus`, `chain_tau`) and the replay of
the recorded rounds (`replay_taus`: DDTree's own trees, round by round; ddtree.pipeline.diagnose explains both)."""

from __future__ import annotations

import functools
import heapq
import math
from typing import Any

import numpy as np

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


EPS = 1e-5  # a continuation path less likely than this is left out of the expectation


@functools.lru_cache(maxsize=256)
def _pairs(n_prev: int, n_row: int, n: int):
    """(p, r) with (p + 1)(r + 1) <= n: the only pairs of a sorted parent list and a sorted row that can be among the
    n best of the next depth (every pair <= them is at least as good, and there are (p + 1)(r + 1) of them)."""
    ps, rs = [], []
    for p in range(min(n_prev, n)):
        k = min(n_row, n // (p + 1))
        ps += [p] * k
        rs += range(k)
    return np.array(ps, dtype=np.int64), np.array(rs, dtype=np.int64)


class _Round:
    """One recorded round, prepared for the replay: each depth's sorted drafter costs up to rank n (the sketch
    interpolated in log rank, the last segment's slope past it), the n cheapest node costs of the best-first order over
    every depth (a tree of budget B holds the nodes costing at most the B-th), and the target's path (ranks, costs)."""

    def __init__(self, ranks: list[int], costs: list[int], rows: list[list[int]], tails: list[list[int]] | None,
                 need: list[int] | None, dg: dict[str, Any], n: int):
        self.ranks, self.need, self.tree = ranks, need, dg.get("tree")
        scale, vocab = dg.get("cost_scale", 1000), int(dg["vocab"])
        self.path = np.cumsum(np.array(costs, dtype=np.float64) / scale)  # the path's nodes' cumulative costs
        xr = np.log1p(np.arange(min(n, vocab), dtype=np.float64))
        self.rows = []
        for d, pts in enumerate(rows):
            # (rank, cost) points: the sketched ranks, then the mean logit's cost at rank (V - 1) / 2 and the last rank's
            xs, ys = list(dg["sketch"]), [c / scale for c in pts]
            for x, c in zip(((vocab - 1) / 2, vocab - 1), tails[d] if tails else [], strict=False):
                if x > xs[-1] and c / scale >= ys[-1]:
                    xs.append(x)
                    ys.append(c / scale)
            x, y = np.log1p(np.array(xs)), np.array(ys)
            row = np.interp(xr, x, y)
            if len(x) > 1 and xr[-1] > x[-1]:  # past the last point: its last slope in log rank
                past = xr > x[-1]
                row[past] = y[-1] + (y[-1] - y[-2]) / (x[-1] - x[-2]) * (xr[past] - x[-1])
            self.rows.append(row)
        lists, prev = [], np.zeros(1)
        for row in self.rows:
            ps, rs = _pairs(len(prev), len(row), n)
            cand = prev[ps] + row[rs]
            prev = np.sort(np.partition(cand, n - 1)[:n] if len(cand) > n else cand)
            lists.append(prev)
        allc = np.concatenate(lists) if lists else np.zeros(0)
        self.order = np.sort(np.partition(allc, n - 1)[:n] if len(allc) > n else allc)

    def theta(self, budget: int) -> float:
        """The cost of the budget-th node of the best-first order: a tree of that budget holds the nodes up to it."""
        return float(self.order[budget - 1]) if budget <= len(self.order) else math.inf

    def needs(self) -> list[int]:
        """Per known path node: the smallest budget whose tree holds it (recorded where the round's tree carried its
        scores, else from the sketch; past the run's tree: at least one more than it), non-decreasing."""
        out, last = [], 0
        for d, c in enumerate(self.path):
            if self.need is not None and d < len(self.need):
                b = self.need[d]
            else:
                b = 1 + int(np.searchsorted(self.order, c - 1e-9, side="left"))
                if self.need is not None and self.tree:
                    b = max(b, self.tree + 1)  # the run's tree did not hold it
            last = max(b, last + 1)
            out.append(last)
        return out

    def continuation(self, tables: tuple[list[list[float]], list[list[float]]], vocab: int, top: float
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The nodes below the known path's last node that a tree costing up to `top` could hold: (costs, chance
        that the target's path passes through each, under the rank model given the known path), sorted by cost."""
        L, m = len(self.rows), len(self.ranks)
        costs, probs = [], []
        stack = [(m, float(self.path[-1]), int(any(self.ranks)), 1.0)]
        while stack:
            d, c, state, pr = stack.pop()
            if d >= L:
                continue
            row, tab = self.rows[d], tables[state][d]
            n_in = int(np.searchsorted(row, top - c, side="right"))
            for r in range(min(n_in, RANK_CAP)):
                p = pr * tab[r]
                if p > EPS:
                    cc = c + float(row[r])
                    costs.append(cc)
                    probs.append(p)
                    stack.append((d + 1, cc, int(state or r != 0), p))
            if n_in > RANK_CAP and tab[RANK_CAP] > 0 and vocab > RANK_CAP:
                each = pr * tab[RANK_CAP] / (vocab - RANK_CAP)
                for r in range(RANK_CAP, n_in):  # rarely many: a flat drafter's wide trees
                    if each * (n_in - RANK_CAP) <= EPS:
                        break
                    cc = c + float(row[r])
                    costs.append(cc)
                    probs.append(each)
                    if each > EPS:
                        stack.append((d + 1, cc, 1, each))
        order = np.argsort(costs, kind="stable")
        return np.array(costs)[order], np.cumsum(np.array(probs)[order])

    def depths(self, budgets: list[int], tables, vocab: int) -> list[float]:
        """The expected accepted depth of a DDTree tree of each budget in this round: exact along the known path (the
        target's tokens up to one past the accepted depth), the rank model below it."""
        needs = self.needs()
        L, m = len(self.rows), len(needs)
        out, cont = [], None
        for b in budgets:
            j = sum(n <= b for n in needs)
            if j < m or m >= L:
                out.append(float(j))
                continue
            if cont is None:
                cont = self.continuation(tables, vocab, max(self.theta(x) for x in budgets))
            k = int(np.searchsorted(cont[0], self.theta(b) + 1e-9, side="right"))
            out.append(m + (float(cont[1][k - 1]) if k else 0.0))
        return out


_PREPARED: dict[int, tuple[dict, list[_Round]]] = {}


def _prepared(dg: dict[str, Any], n: int) -> list[_Round]:
    """A generation record's rounds for the replay (cached: the diagnosis replays the same records many times)."""
    key = id(dg) * 4096 + n
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not dg:
        none = [None] * len(dg["ranks"])
        rounds = [_Round(r, c, w, t, nd, dg, n) for r, c, w, t, nd in
                  zip(dg["ranks"], dg["costs"], dg["rows"], dg.get("tail") or none, dg.get("need") or none, strict=True)]
        hit = _PREPARED[key] = (dg, rounds)
    return hit[1]


def replayable(diagnoses: list[dict[str, Any]]) -> bool:
    """Whether every record keeps the rows the replay needs (format 2 on; older records: the rank model alone)."""
    return bool(diagnoses) and all(dg.get("rows") is not None and dg.get("costs") is not None for dg in diagnoses)


def replay_taus(diagnoses: list[dict[str, Any]], main: list[list[float]], off: list[list[float]],
                budgets: list[int], vocab: int | None) -> dict[int, float]:
    """Predicted tau of DDTree trees of each budget (>= 2): the mean over the recorded rounds of 1 + the accepted depth
    that round's own best-first tree of that budget would reach (`_Round.depths`)."""
    n = max(budgets)
    tot = [0.0] * len(budgets)
    rounds = 0
    for dg in diagnoses:
        v = int(dg.get("vocab") or vocab or 0)
        for rnd in _prepared(dg, n):
            for i, x in enumerate(rnd.depths(budgets, (main, off), v)):
                tot[i] += x
            rounds += 1
    return {b: 1.0 + t / max(rounds, 1) for b, t in zip(budgets, tot, strict=True)}
