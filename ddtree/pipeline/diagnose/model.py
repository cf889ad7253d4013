"""The prediction of tau against the node budget: the rank model (`predict_taus`, `chain_tau`: its home is
ddtree.engine.rank_model, which the per-round budget controller shares) and the replay of the recorded rounds
(`replay_taus`: DDTree's own trees, round by round; ddtree.pipeline.diagnose explains both)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ddtree.engine.diagnostics import RANK_CAP
from ddtree.engine.rank_model import chain_tau, predict_taus

__all__ = ["chain_tau", "predict_taus", "replay_taus", "replayable"]

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
