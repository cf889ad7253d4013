"""`python -m ddtree.diagnose <job dir | sweep dir>`: why tau is what it is, from the per-round records every
DFlash and DDTree job keeps (ddtree.engine.diagnostics).

Writes diagnosis.md, diagnosis.json and PNG plots into the directory (or --out):

* the drafter by depth: conditional acceptance of its top-1 (on its own top-1 chain) and the target's token's
  coverage by its top k;
* its top-1 accuracy on its main chain against off it (after the path took a non-top-1 token above), with counts and
  95 % Wilson intervals, per depth and depth-matched;
* predicted tau against the node budget (1 = a chain … 1024), the measured tau of every job drawn beside it;
* with a verification-cost curve (the jobs' own stage timings, or --cost TABLE), predicted speedup against budget and
  the best budget;
* one verdict line naming the limiting factor.

The prediction for DDTree trees (`replay_taus`) replays each recorded round: a DFlash drafter's per-position rows do
not depend on the path, so the best-first tree of any budget B is the set of rank paths whose summed drafter cost (minus
log-probability) is among the B smallest, computed from the round's recorded rows. Where the target's path is known
(its tokens up to one past the accepted depth), the depth that tree accepts is exact: recorded outright up to the
budget that ran (each accepted node's place in the best-first order), from a sketch of the rows past it. Below the
known path the rank model decides: at depth d the target's token has rank r in the drafter's row with probability
p_d(r | state), state = whether the path above stayed on the drafter's top-1 chain, independently across depths, while
which ranks the tree holds still comes from that round's rows. A chain's prediction, 1 + sum_d prod_{i<=d} p_i(0), is
the same replay for the top-1 chain (the measured tau of its own rounds, by construction). `predict_taus` is the rank
model alone: one tree shape for every round, the B most likely rank paths by measured acceptance (what a tree ordered
by acceptance rather than by the drafter's scores would reach), and the prediction for records without rows (format 1).
"""

from __future__ import annotations

import argparse
import csv
import functools
import heapq
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddtree.engine.diagnostics import NODE_COLUMNS, RANK_CAP
from ddtree.errors import ConfigError

DIAGNOSIS_MD, DIAGNOSIS_JSON = "diagnosis.md", "diagnosis.json"
BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COVERAGE_K = (1, 2, 4, 8, 32)
MIN_OFF = 20  # off-path observations a depth needs before its own statistics replace the pooled ratio
Z95 = 1.959964


# ---------------------------------------------------------------- inputs


@dataclass
class JobData:
    """One job's method records and summary, wherever they came from (a job dir, an MLflow run)."""

    name: str
    method: str
    budget: int | None  # None: a chain (DFlash) or AR
    summary: dict[str, Any]
    records: list[dict[str, Any]]  # role == "method"
    baseline: list[dict[str, Any]] = field(default_factory=list)  # role == "baseline"

    @property
    def tau(self) -> float | None:
        return self.summary.get("tau")

    @property
    def tree_budget(self) -> int | None:
        """The budget on the predicted curve: 1 for a chain, the node budget for a tree, None for AR."""
        if self.method == "dflash":
            return 1
        return self.budget if self.method == "ddtree" else None

    @property
    def diagnosed(self) -> list[dict[str, Any]]:
        return [r["diagnosis"] for r in self.records if r.get("diagnosis")]


def job_from_dir(d: Path) -> JobData | None:
    """A job dir's summary.json and samples.jsonl; None when it has neither (a skipped or unfinished job)."""
    samples, summary = d / "samples.jsonl", d / "summary.json"
    if not samples.is_file() or not summary.is_file():
        return None
    summ = json.loads(summary.read_text())
    recs = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.strip()]
    return JobData(d.name, summ.get("method"), summ.get("budget"), summ,
                   [r for r in recs if r.get("role") == "method"], [r for r in recs if r.get("role") == "baseline"])


def load_jobs(path: Path) -> list[JobData]:
    """The job at `path`, or every job below it (a sweep dir, a runs dir)."""
    if not path.is_dir():
        raise ConfigError("path", f"{path} is not a directory", "pass a job dir (holding samples.jsonl and "
                          "summary.json) or a sweep dir")
    job = job_from_dir(path)
    if job is not None:
        return [job]
    jobs = [j for p in sorted(path.rglob("summary.json"), key=lambda p: str(p)) if (j := job_from_dir(p.parent))]
    if not jobs:
        raise ConfigError("path", f"no finished job (samples.jsonl + summary.json) under {path}",
                          "pass the directory `python -m ddtree.run` printed after 'results:'")
    return jobs


# ---------------------------------------------------------------- statistics


def wilson(k: int, n: int) -> tuple[float | None, float | None, float | None]:
    """k of n: the rate and its 95 % Wilson interval (None where n = 0)."""
    if n <= 0:
        return None, None, None
    p = k / n
    den = 1 + Z95 ** 2 / n
    mid = (p + Z95 ** 2 / (2 * n)) / den
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / den
    return p, max(0.0, mid - half), min(1.0, mid + half)


@dataclass
class RankStats:
    """Counts over rounds. hist[state][d][r]: observations at depth d + 1 whose target token had rank r (RANK_CAP:
    beyond), state 0 = the path above on the drafter's top-1 chain, 1 = off it. nodes[d][col]: verified nodes
    (ddtree.engine.diagnostics.NODE_COLUMNS layout), depth d."""

    depth: int  # L, the drafter's positions
    hist: list[list[list[int]]]
    nodes: list[list[int]]
    rounds: int = 0
    prob_sum: list[list[float]] = field(default_factory=list)  # [d][r] sum of the drafter's prob of the token
    vocab: int | None = None  # the drafter's vocabulary (ranks past RANK_CAP spread over it)

    @classmethod
    def empty(cls, L: int) -> RankStats:
        return cls(L, [[[0] * (RANK_CAP + 1) for _ in range(L)] for _ in range(2)],
                   [[0] * NODE_COLUMNS for _ in range(L + 1)], 0, [[0.0] * (RANK_CAP + 1) for _ in range(L)])

    def reached(self, d: int, state: int | None = None) -> int:
        states = (0, 1) if state is None else (state,)
        return sum(sum(self.hist[s][d]) for s in states)

    def count(self, d: int, r: int, state: int | None = None) -> int:
        states = (0, 1) if state is None else (state,)
        return sum(self.hist[s][d][r] for s in states)

    def covered(self, d: int, k: int, state: int | None = None) -> int:
        states = (0, 1) if state is None else (state,)
        return sum(sum(self.hist[s][d][:k]) for s in states)


def collect(diagnoses: list[dict[str, Any]], L: int | None = None) -> RankStats:
    """RankStats of per-generation records (GenerationResult.diagnosis)."""
    if L is None:
        L = max((len(r) for dg in diagnoses for r in dg["ranks"]), default=1)
        L = max([L] + [len(dg.get("nodes", [])) - 1 for dg in diagnoses])
    st = RankStats.empty(L)
    for dg in diagnoses:
        if dg.get("vocab"):
            st.vocab = max(st.vocab or 0, int(dg["vocab"]))
        scale = dg.get("prob_scale", 1000)
        for ranks, probs in zip(dg["ranks"], dg["probs"], strict=True):
            st.rounds += 1
            off = 0
            for d, (r, p) in enumerate(zip(ranks[:L], probs[:L], strict=True)):
                st.hist[off][d][r] += 1
                st.prob_sum[d][r] += p / scale
                off = off or int(r != 0)
        for d, row in enumerate(dg.get("nodes", [])[: L + 1]):
            for c, v in enumerate(row):
                st.nodes[d][c] += v
    return st


def rank_probabilities(st: RankStats) -> tuple[list[list[float]], list[list[float]]]:
    """(main, off): p_d(r) per depth for ranks 0 … RANK_CAP - 1 and, last, the mass beyond them, on the top-1 chain
    and off it.

    Off the chain, a depth with fewer than MIN_OFF observations takes the main-chain distribution with its top-1 share
    scaled by the pooled off/main ratio of top-1 accuracy, the rest rescaled to match (1 where nothing off the chain
    was observed: independence assumed)."""
    ranks = range(RANK_CAP + 1)
    main = [[st.count(d, r, 0) / n if (n := st.reached(d, 0)) else 0.0 for r in ranks] for d in range(st.depth)]
    ratio = off_main_ratio(st)
    off = []
    for d in range(st.depth):
        n = st.reached(d, 1)
        if n >= MIN_OFF:
            off.append([st.count(d, r, 1) / n for r in ranks])
            continue
        row = list(main[d])
        rest = sum(row[1:])
        if row[0] > 0 and ratio is not None and rest > 0:
            top = min(1.0, row[0] * ratio)
            row = [top] + [x * (1 - top) / rest for x in row[1:]]
        off.append(row)
    return main, off


def off_main_ratio(st: RankStats) -> float | None:
    """Off-path top-1 accuracy over the depth-matched main-chain accuracy (None: nothing observed off the chain)."""
    acc = main_vs_off(st)
    m, o = acc["depth_matched_main"]["rate"], acc["off"]["rate"]
    return None if m in (None, 0) or o is None else o / m


def main_vs_off(st: RankStats) -> dict[str, Any]:
    """The drafter's top-1 accuracy at depths >= 2 along the accepted paths, on its top-1 chain and off it, with the
    main-chain rate reweighted to the off-path observations' depths (depth matters more than anything: deeper is
    harder, and off-path observations are deeper)."""
    per_depth = []
    km = nm = ko = no = 0
    matched = 0.0
    for d in range(1, st.depth):
        k0, n0 = st.count(d, 0, 0), st.reached(d, 0)
        k1, n1 = st.count(d, 0, 1), st.reached(d, 1)
        km, nm, ko, no = km + k0, nm + n0, ko + k1, no + n1
        if n1 and n0:
            matched += n1 * k0 / n0
        per_depth.append({"depth": d + 1, "main": _rate(k0, n0), "off": _rate(k1, n1)})
    n_matched = sum(st.reached(d, 1) for d in range(1, st.depth) if st.reached(d, 0))
    out = {"main": _rate(km, nm), "off": _rate(ko, no),
           "depth_matched_main": {"rate": matched / n_matched if n_matched else None, "n": n_matched},
           "per_depth": per_depth}
    # the verified nodes (DDTree): top-1 nodes whose parent's target choice is known, on and off the chain
    nodes = {"main": [0, 0], "off": [0, 0]}
    for d in range(1, len(st.nodes)):
        row = st.nodes[d]
        for name, base in (("main", 0), ("off", 4)):
            nodes[name][0] += row[base + 3]  # top-1, agreed
            nodes[name][1] += row[base + 2] + row[base + 3]  # top-1
    out["nodes"] = {k: _rate(*v) for k, v in nodes.items()}
    return out


def _rate(k: int, n: int) -> dict[str, Any]:
    p, lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": p, "lo": lo, "hi": hi}


def depth_table(st: RankStats) -> list[dict[str, Any]]:
    """Per depth: observations, conditional acceptance of the top-1 on the main chain, top-k coverage (all paths)."""
    rows = []
    for d in range(st.depth):
        n = st.reached(d)
        rows.append({"depth": d + 1, "n_main": st.reached(d, 0), "n_off": st.reached(d, 1),
                     "accept_main": _rate(st.count(d, 0, 0), st.reached(d, 0))["rate"],
                     "coverage": {k: (st.covered(d, k) / n if n else None) for k in COVERAGE_K}})
    return rows


# ---------------------------------------------------------------- the model


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


# ---------------------------------------------------------------- the replay: DDTree's own trees, round by round

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


# ---------------------------------------------------------------- verification cost


def round_ms(job: JobData) -> float | None:
    """A round's wall milliseconds (draft + tree + verify + commit), from the job's stage timings."""
    per = job.summary.get("stage_ms_per_round") or {}
    vals = [v for v in per.values() if v is not None]
    return sum(vals) if vals else None


def ar_ms_per_token(jobs: list[JobData]) -> float | None:
    """The AR baseline's decode milliseconds per token over every job's baseline records."""
    s = sum(r["decode_s"] for j in jobs for r in j.baseline)
    n = sum(len(r["acceptance_lengths"]) for j in jobs for r in j.baseline)
    return 1000 * s / n if n else None


def read_cost_table(path: Path) -> dict[str, Any]:
    """A user's verification-cost table: JSON {"ar": ms, "1": ms, "64": ms, ...} or {"round_ms": {...}, "ar_ms": x},
    or CSV rows `budget,ms` (budget "ar" for the baseline's ms per token; 1 = a chain). Milliseconds per round."""
    if not path.is_file():
        raise ConfigError("--cost", f"{path} does not exist", "pass a JSON or CSV table of budget -> ms per round")
    try:
        if path.suffix.lower() == ".csv":
            rows = [r for r in csv.reader(path.read_text().splitlines()) if r and not r[0].startswith("#")]
            raw = {r[0].strip(): float(r[1]) for r in rows if r[0].strip().lower() != "budget"}
        else:
            data = json.loads(path.read_text())
            raw = dict(data.get("round_ms", data))
            if "ar_ms" in data:
                raw["ar"] = data["ar_ms"]
        ar = raw.pop("ar", None)
        return {"ar_ms": None if ar is None else float(ar), "round_ms": {int(k): float(v) for k, v in raw.items()}}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ConfigError("--cost", f"cannot read {path}: {e}", "write budget,ms rows (CSV) or {\"64\": 12.5, "
                          "\"ar\": 9.8} (JSON)") from None


def cost_curve(jobs: list[JobData], table: dict[str, Any] | None) -> dict[str, Any]:
    """Round ms by budget (1 = the chain) and AR ms per token: the table's where given, else the jobs' own."""
    if table is not None:
        return {"source": "table", "round_ms": dict(sorted(table["round_ms"].items())), "ar_ms": table["ar_ms"]}
    by_budget: dict[int, list[float]] = defaultdict(list)
    for j in jobs:
        b, ms = j.tree_budget, round_ms(j)
        if b is not None and ms is not None:
            by_budget[b].append(ms)
    return {"source": "measured", "round_ms": {b: sum(v) / len(v) for b, v in sorted(by_budget.items())},
            "ar_ms": ar_ms_per_token(jobs)}


def interpolate_cost(curve: dict[int, float], b: int) -> float | None:
    """Round ms at budget b: measured, or linear in log2(budget) between two measured budgets (never outside)."""
    if b in curve:
        return curve[b]
    lo = max((k for k in curve if k < b), default=None)
    hi = min((k for k in curve if k > b), default=None)
    if lo is None or hi is None:
        return None
    t = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return curve[lo] + t * (curve[hi] - curve[lo])


# ---------------------------------------------------------------- the diagnosis


def suspect_jobs(jobs: list[JobData]) -> list[str]:
    out = []
    for j in jobs:
        v = j.summary.get("validation") or {}
        if v.get("suspect"):
            out.append(f"{j.name} ({v['suspect']} of {v.get('checked', '?')} outputs)")
    return out


def _quantization(j: JobData) -> str | None:
    q = j.summary.get("quantization") or {}
    parts = [f"{k} {v}" for k, v in q.items() if v]
    return ", ".join(parts) or None


def quantized_pairs(jobs: list[JobData]) -> list[dict[str, Any]]:
    """Each quantized job beside an unquantized one of the same model, method, budget and temperature (users see
    acceptance collapse when a drafter or target is quantized: the line that shows it)."""
    key = lambda j: (j.summary.get("model"), j.method, j.budget, j.summary.get("temperature"))  # noqa: E731
    plain = {key(j): j for j in jobs if _quantization(j) is None and j.tau is not None}
    return [{"name": j.name, "quantization": _quantization(j), "tau": j.tau, "unquantized": plain[key(j)].name,
             "unquantized_tau": plain[key(j)].tau}
            for j in jobs if _quantization(j) and j.tau is not None and key(j) in plain]


def diagnose(jobs: list[JobData], cost: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything diagnosis.md and diagnosis.json say, from the jobs of one drafter-target pair."""
    drafting = [j for j in jobs if j.diagnosed]
    temps = {j.summary.get("temperature") for j in drafting}
    doc: dict[str, Any] = {"jobs": [{"name": j.name, "method": j.method, "budget": j.budget, "tau": j.tau,
                                     "round_ms": round_ms(j), "speedup": j.summary.get("speedup"),
                                     "rounds": sum(len(d["depth"]) for d in j.diagnosed)} for j in jobs],
                           "suspect": suspect_jobs(jobs), "quantized": quantized_pairs(jobs)}
    if not drafting:
        doc["verdict"] = ("no diagnosis: no DFlash or DDTree job here recorded its rounds (method=ar, engine=upstream, "
                          "or runs older than the recording)")
        return doc
    st = collect([d for j in drafting for d in j.diagnosed])
    L = st.depth
    # each temperature on its own: the first (the lowest) draws the curves, every job is predicted from its own
    groups: dict[float, list[JobData]] = defaultdict(list)
    for j in drafting:
        groups[float(j.summary.get("temperature") or 0.0)].append(j)
    curves = {t: model_curves(g, L) for t, g in sorted(groups.items())}
    pred, indep, best, sources = curves[min(groups)]
    if len(groups) > 1:
        doc["predicted_by_temperature"] = {t: c[0] for t, c in curves.items()}
    doc.update(temperature=sorted(t for t in temps if t is not None), rounds=st.rounds, drafter_positions=L,
               depths=depth_table(st), accuracy=main_vs_off(st), predicted=pred, predicted_independent=indep,
               predicted_by_acceptance=best, calibration=sources, model=MODEL_NOTE)
    measured = []
    for j in drafting:
        b = j.tree_budget
        if b is not None and j.tau is not None:
            t = float(j.summary.get("temperature") or 0.0)
            own = curves[t][0]
            p = own[b] if b in own else model_curves(groups[t], L, (b,))[0][b]
            depths = [a for d in j.diagnosed for a in d["depth"]]
            accepted = 1 + sum(depths) / len(depths) if depths else None
            measured.append({"name": j.name, "method": j.method, "budget": b, "temperature": t, "measured": j.tau,
                             "accepted": accepted, "predicted": p, "error": (p - j.tau) / j.tau})
    doc["measured"] = sorted(measured, key=lambda m: (m["temperature"], m["budget"]))
    doc["cross"] = cross_predictions(drafting, L) if len(drafting) > 1 else []
    curve = cost_curve(jobs, cost)
    doc["cost"] = curve
    speed = {}
    if curve["ar_ms"]:
        for b in BUDGETS:
            ms = interpolate_cost(curve["round_ms"], b)
            if ms:
                speed[b] = {"round_ms": ms, "speedup": pred[b] * curve["ar_ms"] / ms}
    doc["speedup"] = speed
    doc["best_budget"] = max(speed, key=lambda b: speed[b]["speedup"]) if speed else None
    if any(t and t > 0 for t in temps):
        doc["note"] = ("temperature > 0: the ranks are of the target's sampled tokens, and the trees are replayed the "
                       "same way (under the same samples a smaller tree accepts the part of the path it holds); a chain "
                       "is predicted from its own rounds, or from tree rounds by the drafter's tempered probability of "
                       "the target's samples (recorded from format 2 on; older records: greedy); each temperature is "
                       "predicted from its own jobs" if any(record_temperature(j.diagnosed) > 0 for j in drafting)
                       else "temperature > 0, but these records predate the tempered costs: the chain is predicted "
                       "as if greedy")
    doc["verdict"] = verdict(doc, pred)
    return doc


def predicted_curves(st: RankStats, budgets: tuple[int, ...] = BUDGETS,
                     diagnoses: list[dict[str, Any]] | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """Predicted tau at each budget (1: the drafter's chain of all its positions, as DFlash verifies; B >= 2: DDTree's
    tree of B nodes), with the measured off-path statistics and under plain independence (off-path = main).

    With the records (`diagnoses`) of format 2 on, the trees are replayed round by round (`replay_taus`: each round's
    own best-first tree from the drafter's recorded scores); without them (or records older than format 2), the one
    tree shape by measured acceptance (`predict_taus`). The chain: `chain_tau`, or at T > 0 `sampled_chain_tau`."""
    main, off = rank_probabilities(st)
    trees = [b for b in budgets if b > 1]
    replay = bool(trees) and diagnoses is not None and replayable(diagnoses)
    chain = sampled_chain_tau(diagnoses) if diagnoses and record_temperature(diagnoses) > 0 else None
    if chain is None:
        chain = chain_tau(main)
    curves = []
    for o in (off, main):
        if replay:
            taus = replay_taus(diagnoses, main, o, trees, st.vocab)
        else:
            full = predict_taus(main, o, max(budgets), st.vocab)
            taus = {b: full[b] for b in trees}
        curves.append({b: (chain if b == 1 else taus[b]) for b in budgets})
    return curves[0], curves[1]


def record_temperature(diagnoses: list[dict[str, Any]]) -> float:
    """The temperature the records were made at (0: greedy, and records older than format 2)."""
    return max((float(dg.get("temperature") or 0.0) for dg in diagnoses), default=0.0)


def sampled_chain_tau(diagnoses: list[dict[str, Any]]) -> float | None:
    """A DFlash chain's expected tau at temperature T > 0, where it drafts a sample of the drafter's tempered row at each
    depth and the target accepts it when its own sample is the same token.

    From a chain's own rounds: their accepted tau (the accepted prefix leans toward the drafter's likely tokens, so it
    cannot be reused). From tree rounds, whose path is a plain sample of the target's (a DFlash row does not depend on
    the path): P(the chain accepts >= k) = prod_{i<=k} q_i(x_i), q_i the drafter's tempered probability of the target's
    token x_i, where x_i was recorded (`tcosts`), and past it the mean q_i of the rounds that recorded depth i
    (independence across depths). None: records without `tcosts`."""
    if all(dg.get("tree") is None for dg in diagnoses):  # chain rounds
        depths = [a for dg in diagnoses for a in dg["depth"]]
        return 1 + sum(depths) / len(depths) if depths else None
    if not all(dg.get("tcosts") is not None for dg in diagnoses):
        return None
    L = max(len(r) for dg in diagnoses for r in dg["rows"])
    qs = [[math.exp(-c / dg.get("cost_scale", 1000)) for c in tc] for dg in diagnoses for tc in dg["tcosts"]]
    seen = [[q[i] for q in qs if len(q) > i] for i in range(L)]
    mean = [sum(v) / len(v) if v else 0.0 for v in seen]
    total = 0.0
    for q in qs:
        run = 1.0
        for i in range(L):
            run *= q[i] if i < len(q) else mean[i]
            total += run
    return 1 + total / max(len(qs), 1)


def model_curves(jobs: list[JobData], L: int, budgets: tuple[int, ...] = BUDGETS):
    """(predicted, independent, by acceptance, sources): the chain point (budget 1) from the chain rounds (DFlash) where there are any,
    the trees' points from the tree rounds where there are any; else each from what there is.

    Why apart: a round starts where the previous one missed, and a tree misses at harder tokens than a chain (it
    catches the drafter's near misses), so the rounds of each start in different places; on the toy pair a chain
    predicted from tree rounds is ~16 % optimistic (docs/diagnosis.md), while trees predicted from chain rounds
    and trees from trees stay within ~7 %."""
    chains = [d for j in jobs if j.method == "dflash" for d in j.diagnosed]
    trees = [d for j in jobs if j.method != "dflash" for d in j.diagnosed]
    chain_src, tree_src = (chains or trees), (trees or chains)
    c_pred, c_ind = predicted_curves(collect(chain_src, L), budgets, chain_src)
    t_pred, t_ind = (c_pred, c_ind) if tree_src is chain_src else predicted_curves(collect(tree_src, L), budgets,
                                                                                     tree_src)
    best = predicted_curves(collect(tree_src, L), budgets)[0]  # the rank model alone: one tree shape by acceptance
    pick = lambda c, t: {b: (c[b] if b == 1 else t[b]) for b in budgets}  # noqa: E731
    name = lambda src: "chain rounds" if src is chains else "tree rounds"  # noqa: E731
    sources = {"chain": name(chain_src), "trees": name(tree_src),
               "trees_model": "replay" if replayable(tree_src) else "rank model (records without rows)"}
    return pick(c_pred, t_pred), pick(c_ind, t_ind), pick(c_pred, best), sources


def cross_predictions(jobs: list[JobData], L: int) -> list[dict[str, Any]]:
    """Each job's records alone predicting every job's tau (what one calibration run, e.g. budget=auto, can tell):
    rows of {calibration, budget, method, predicted, measured, error}."""
    temp = lambda j: float(j.summary.get("temperature") or 0.0)  # noqa: E731
    rows = []
    for cal in jobs:
        targets = [(j.tree_budget, j.tau) for j in jobs if j.tree_budget is not None and j.tau and temp(j) == temp(cal)]
        budgets = tuple(sorted({b for b, _ in targets}))
        pred, _ = predicted_curves(collect(cal.diagnosed, L), budgets, cal.diagnosed)
        for b, tau in targets:
            rows.append({"calibration": cal.name, "calibration_budget": cal.tree_budget, "budget": b,
                         "predicted": pred[b], "measured": tau, "error": (pred[b] - tau) / tau})
    return rows


def verdict(doc: dict[str, Any], taus: dict[int, float]) -> str:
    """One line naming the limiting factor: suspect outputs, then drafter, tree or verification."""
    if doc["suspect"]:
        return f"SUSPECT outputs in {', '.join(doc['suspect'])}: fix correctness before reading tau"
    d1 = doc["depths"][0]
    acc1, cov8 = d1["accept_main"], d1["coverage"][8]
    chain, best_tree = taus[1], max(taus.values())
    best_b = min(b for b in taus if taus[b] >= best_tree - 1e-9)
    drafter = (f"depth-1 acceptance {_pct(acc1)}, top-8 coverage {_pct(cov8)}; a chain reaches tau {chain:.2f}, "
               f"the best tree up to {BUDGETS[-1]} nodes {best_tree:.2f}")
    a = doc["accuracy"]
    off, m = a["off"], a["depth_matched_main"]["rate"]
    collapsed = (off["n"] >= MIN_OFF and m is not None and off["hi"] is not None and off["hi"] < m
                 and off["rate"] < 0.6 * m)
    if best_tree < 1.1 * chain:
        if collapsed:
            return (f"tree-limited: off its top-1 chain the drafter's top-1 is right {_pct(off['rate'])} "
                    f"(n={off['n']}) against {_pct(m)} on it at the same depths — use a chain (DFlash); {drafter}")
        return f"drafter-limited: {drafter}; no tree helps much — a better drafter does"
    if collapsed:
        enough = min(b for b in taus if taus[b] >= chain + 0.9 * (best_tree - chain))
        return (f"tree-limited: off its top-1 chain the drafter's top-1 is right {_pct(off['rate'])} (n={off['n']}) "
                f"against {_pct(m)} on it — budget <= {enough} gets 90 % of what any tree gets; {drafter}")
    best = doc.get("best_budget")
    if best is not None and doc["speedup"]:
        top = doc["speedup"][best]["speedup"]
        at_tau = max((b for b in doc["speedup"]), key=lambda b: taus[b])
        if at_tau != best and doc["speedup"][at_tau]["speedup"] < 0.95 * top:
            return (f"verification-limited: tau keeps rising to {taus[at_tau]:.2f} at budget {at_tau}, but its rounds "
                    f"cost more than they gain — best budget {_budget_name(best)} (predicted {top:.2f}x); {drafter}")
        return (f"drafter-limited: best budget {_budget_name(best)} (predicted {top:.2f}x, tau {taus[best]:.2f}); "
                f"{drafter}")
    return f"drafter-limited: {drafter} (tau peaks near budget {best_b})"


def _budget_name(b: int | None) -> str:
    return "-" if b is None else ("1 (a chain: DFlash)" if b == 1 else str(b))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# ---------------------------------------------------------------- plots and files


def _label(ax, xlabel: str, ylabel: str, title: str, *, ylim: bool = False, budgets: list[int] | None = None) -> None:
    """Axis labels, grid, legend and title; a 0-1 scale (ylim) or a log2 budget axis (budgets)."""
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
    if ylim:
        ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if ylim else 8)
    ax.set_title(title, fontsize=10)


def write_plots(doc: dict[str, Any], out: Path, prefix: str = "diagnosis") -> list[Path]:
    """diagnosis_depth.png, diagnosis_tau.png and (with a cost curve) diagnosis_speedup.png."""
    if "depths" not in doc:
        return []
    from ddtree.pipeline.report import _plt, _save  # the report's matplotlib set-up (Agg) and saving

    plt = _plt()
    paths = []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    ds = [r["depth"] for r in doc["depths"]]
    ax.plot(ds, [r["accept_main"] for r in doc["depths"]], marker="o", color="k", label="top-1 accepted | d-1 (chain)")
    for i, k in enumerate(COVERAGE_K[1:]):
        ax.plot(ds, [r["coverage"][k] for r in doc["depths"]], marker=".", color=f"C{i}", label=f"target in top {k}")
    _label(ax, "depth", "share of rounds reaching the depth", "the drafter by depth", ylim=True)
    pd_ = [p for p in doc["accuracy"]["per_depth"] if p["main"]["n"] or p["off"]["n"]]
    for name, color, dx in (("main", "C0", -0.1), ("off", "C3", 0.1)):
        pts = [(p["depth"] + dx, p[name]) for p in pd_ if p[name]["n"]]
        if pts:
            xs = [x for x, _ in pts]
            ys = [r["rate"] for _, r in pts]
            err = [[max(0.0, y - r["lo"]) for (_, r), y in zip(pts, ys, strict=True)],
                   [max(0.0, r["hi"] - y) for (_, r), y in zip(pts, ys, strict=True)]]
            bx.errorbar(xs, ys, yerr=err, fmt="o", color=color, capsize=2,
                        label=f"{'on' if name == 'main' else 'off'} its top-1 chain above")
    _label(bx, "depth", "drafter's top-1 = target's token", "main path vs off-path (95 % intervals)", ylim=True)
    paths.append(_save(plt, fig, out / f"{prefix}_depth.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    bs = list(doc["predicted"])
    trees = [b for b in bs if b > 1]
    ax.plot(trees, [doc["predicted"][b] for b in trees], marker=".", color="C0",
            label="predicted DDTree (replay, measured off-path)")
    ax.plot(trees, [doc["predicted_independent"][b] for b in trees], linestyle=":", color="C0",
            label="predicted DDTree (independence: off-path = main)")
    if doc.get("predicted_by_acceptance"):
        ax.plot(trees, [doc["predicted_by_acceptance"][b] for b in trees], linestyle="--", color="C2",
                label="one tree shape by measured acceptance")
    if 1 in doc["predicted"]:
        ax.scatter([1], [doc["predicted"][1]], marker="*", s=120, color="C0", label="predicted chain (all positions)")
    meas = doc["measured"]
    ax.scatter([m["budget"] for m in meas], [m["measured"] for m in meas], color="C3", zorder=3,
               label="measured (1 = DFlash)")
    _label(ax, "node budget (1 = a chain)", "tau (tokens per round)", "tau against budget", budgets=bs)
    paths.append(_save(plt, fig, out / f"{prefix}_tau.png"))

    if doc.get("speedup"):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        sb = list(doc["speedup"])
        st = [b for b in sb if b > 1]
        ax.plot(st, [doc["speedup"][b]["speedup"] for b in st], marker=".", color="C0", label="predicted tree")
        if 1 in doc["speedup"]:
            ax.scatter([1], [doc["speedup"][1]["speedup"]], marker="*", s=120, color="C0", label="predicted chain")
        pts = [(m["budget"], j["speedup"]) for m in meas for j in doc["jobs"]
               if j["name"] == m["name"] and j.get("speedup")]
        if pts:
            ax.scatter(*zip(*pts, strict=True), color="C3", zorder=3, label="measured")
        if doc["best_budget"]:
            ax.axvline(doc["best_budget"], color="k", linestyle=":", linewidth=1, label=f"best {doc['best_budget']}")
        _label(ax, f"node budget (cost: {doc['cost']['source']})", "speedup over AR (x)", "speedup against budget",
               budgets=sb)
        paths.append(_save(plt, fig, out / f"{prefix}_speedup.png"))
    return paths


MODEL_NOTE = ("Model: each recorded round is replayed: DDTree's tree of budget B is rebuilt from that round's "
              "drafter scores (its per-depth rows do not depend on the path), and its accepted depth is exact as far as "
              "the target's path is known (one token past the accepted depth); below that, the target's token has rank "
              "r with the measured probability p_d(r | on or off the drafter's top-1 chain above), independently across "
              "depths. The chain is the same for the top-1 chain. Dotted: the continuation under plain independence "
              "(off-path = main), which DDTree's scores assume; dashed: the rank model alone, one tree shape for every "
              "round (the B likeliest rank paths by measured acceptance), where DDTree adapts its tree to each round's "
              "scores.")


def markdown_section(doc: dict[str, Any], plots: list[str], level: int = 2) -> list[str]:
    """The diagnosis as markdown lines (diagnosis.md, and the report's section), headings at `level`."""
    h = "#" * level
    lines = [f"**Verdict:** {doc['verdict']}", ""]
    if "depths" not in doc:
        return lines
    lines += [f"{doc['rounds']} rounds recorded; the drafter drafts {doc['drafter_positions']} positions.", ""]
    if doc.get("note"):
        lines += [f"Note: {doc['note']}.", ""]
    lines += [f"{h} Predicted and measured tau", "", MODEL_NOTE, "",
              "Budget 1 is the drafter's chain of all its positions (DFlash); a budget B >= 2 a tree of B nodes. "
              "Measured tau is the job's (committed tokens per round); accepted is the same before the stop token "
              "and max_new_tokens cut the last round of each output (what the model describes).", "",
              "| job | method | budget | measured tau | accepted | predicted | error |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in doc["measured"]:
        t = f" (T={m['temperature']:g})" if m.get("temperature") else ""
        lines.append(f"| {m['name']} | {m['method']}{t} | {m['budget']} | {m['measured']:.2f} | {_f(m['accepted'])} | "
                     f"{_f(m['predicted'])} | {100 * m['error']:+.1f} % |")
    for q in doc.get("quantized", []):
        lines += ["", f"Quantized: {q['name']} ({q['quantization']}) tau {q['tau']:.2f}, against {q['unquantized_tau']:.2f} "
                  f"unquantized ({q['unquantized']})."]
    lines += ["", "| budget | " + " | ".join(str(b) for b in doc["predicted"]) + " |",
              "| --- |" + " ---: |" * len(doc["predicted"]),
              "| predicted tau | " + " | ".join(f"{v:.2f}" for v in doc["predicted"].values()) + " |",
              "| independence | " + " | ".join(f"{v:.2f}" for v in doc["predicted_independent"].values()) + " |"]
    if doc.get("predicted_by_acceptance"):
        lines.append("| one tree by acceptance | " + " | ".join(
            f"{v:.2f}" for v in doc["predicted_by_acceptance"].values()) + " |")
    if doc.get("speedup"):
        lines.append("| predicted speedup | " + " | ".join(
            f"{doc['speedup'][b]['speedup']:.2f}x" if b in doc["speedup"] else "-" for b in doc["predicted"]) + " |")
        lines += ["", f"Verification cost ({doc['cost']['source']}): AR {_f(doc['cost']['ar_ms'])} ms a token; rounds "
                  + ", ".join(f"{b}: {ms:.2f} ms" for b, ms in doc["cost"]["round_ms"].items())
                  + " (between measured budgets: interpolated in log2 budget; outside them: not predicted). "
                  f"Best budget: {_budget_name(doc['best_budget'])}."]
    if doc.get("calibration"):
        lines += ["", f"Calibration: the chain from {doc['calibration']['chain']}, the trees from "
                  f"{doc['calibration']['trees']} ({doc['calibration'].get('trees_model', 'rank model')}; a round starts where the last one missed, and trees miss at harder "
                  "tokens than chains: see docs/diagnosis.md)."]
    if doc.get("cross"):
        cols = sorted({r["budget"] for r in doc["cross"]})
        cals = sorted(dict.fromkeys((r["calibration"], r["calibration_budget"]) for r in doc["cross"]),
                      key=lambda c: (c[1] is None, c[1] or 0))
        cell = {(r["calibration"], r["budget"]): r for r in doc["cross"]}
        lines += ["", f"{h} Predicting from one job", "", "Each job's records alone, predicting every job's tau "
                  "(error against the measured tau; `budget=auto` calibrates this way):", "",
                  "| calibration job (budget) | " + " | ".join(str(b) for b in cols) + " |",
                  "| --- |" + " ---: |" * len(cols)]
        for name, cb in cals:
            lines.append(f"| {name} ({cb}) | " + " | ".join(
                f"{100 * cell[(name, b)]['error']:+.0f} %" if (name, b) in cell else "-" for b in cols) + " |")
    a = doc["accuracy"]
    lines += ["", f"{h} The drafter on and off its top-1 chain", "",
              "The drafter's top-1 is the target's token, at depths >= 2 of the accepted paths (95 % Wilson intervals):",
              "", "| where | right | of | rate | interval |", "| --- | ---: | ---: | ---: | --- |"]
    for name, r in (("on its top-1 chain", a["main"]), ("off it (a non-top-1 token above)", a["off"])):
        lines.append(f"| {name} | {r['k']} | {r['n']} | {_pct(r['rate'])} | {_pct(r['lo'])} – {_pct(r['hi'])} |")
    lines.append(f"| on the chain, at the off-path depths | | {a['depth_matched_main']['n']} | "
                 f"{_pct(a['depth_matched_main']['rate'])} | |")
    nd = a["nodes"]
    if nd["main"]["n"] or nd["off"]["n"]:
        lines += ["", "Every verified top-1 node of the trees whose parent's target choice was computed (the lazy "
                  "head on a CPU computes it on the walked path's chains only): "
                  f"on the chain {nd['main']['k']}/{nd['main']['n']} ({_pct(nd['main']['rate'])}), off it "
                  f"{nd['off']['k']}/{nd['off']['n']} ({_pct(nd['off']['rate'])})."]
    lines += ["", f"{h} By depth", "",
              "| depth | rounds (chain / off) | top-1 accepted on the chain | " +
              " | ".join(f"top {k}" for k in COVERAGE_K) + " |",
              "| ---: | ---: | ---: |" + " ---: |" * len(COVERAGE_K)]
    for r in doc["depths"]:
        if r["n_main"] + r["n_off"] == 0:
            continue
        lines.append(f"| {r['depth']} | {r['n_main']} / {r['n_off']} | {_pct(r['accept_main'])} | "
                     + " | ".join(_pct(r["coverage"][k]) for k in COVERAGE_K) + " |")
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return lines + [""]


def write_diagnosis(doc: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = write_plots(doc, out) if plots else []
    doc["plots"] = [p.name for p in paths]
    (out / DIAGNOSIS_JSON).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / DIAGNOSIS_MD).write_text("\n".join(["# Why is tau what it is?", ""] + markdown_section(doc, doc["plots"])))
    return paths


def report_diagnoses(cells: list[dict[str, Any]], load_samples, out: Path, plots: bool = True
                     ) -> tuple[list[str], list[dict[str, Any]]]:
    """`python -m ddtree.report`'s "Why is tau what it is?": a diagnosis per table cell from its jobs (MLflow runs with
    .summary, .samples, .method, .budget, .name), samples fetched by `load_samples(job)`; (markdown lines, docs)."""
    lines, docs = ["## Why is tau what it is?", "",
                   "Per cell, from the per-round records of its DFlash and DDTree runs (`python -m ddtree.diagnose` on a "
                   "job or sweep dir says the same; docs/diagnosis.md explains it).", ""], []
    for c in cells:
        jobs = []
        for job in c["_jobs"].values():
            load_samples(job)
            recs = job.samples or []
            jobs.append(JobData(job.name, job.method, job.budget, job.summary or {},
                                [r for r in recs if r.get("role") == "method"],
                                [r for r in recs if r.get("role") == "baseline"]))
        doc = diagnose(jobs)
        slug = "_".join(str(x) for x in (c["dataset"], c["model"], f"T{c['temperature']:g}"))
        slug = "".join(ch if ch.isalnum() or ch in "._" else "-" for ch in slug)
        doc["plots"] = [p.name for p in write_plots(doc, out, f"diagnosis_{slug}")] if plots else []
        docs.append({"dataset": c["dataset"], "model": c["model"], "temperature": c["temperature"], **doc})
        lines += [f"### {c['title']}, {c['model']}, temperature {c['temperature']:g}", ""]
        lines += markdown_section(doc, doc["plots"], level=4)
    return lines, docs


def main(argv: list[str] | None = None) -> None:
    from ddtree.pipeline.cli import tracebacks_wanted, user_error

    ap = argparse.ArgumentParser(prog="python -m ddtree.diagnose", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="a job dir (samples.jsonl, summary.json) or a sweep dir")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the path itself)")
    ap.add_argument("--cost", type=Path, default=None,
                    help="verification cost table: CSV budget,ms (budget 'ar': AR ms per token) or JSON")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    try:
        jobs = load_jobs(args.path.expanduser().resolve())
        cost = read_cost_table(args.cost) if args.cost else None
    except ConfigError as e:
        if tracebacks_wanted():
            raise
        user_error(str(e))
    doc = diagnose(jobs, cost)
    out = (args.out or args.path).expanduser().resolve()
    write_diagnosis(doc, out, plots=not args.no_plots)
    for m in doc.get("measured", []):
        print(f"  {m['name']}: {m['method']} budget {m['budget']}: tau {m['measured']:.2f}, predicted "
              f"{_f(m['predicted'])}")
    print(doc["verdict"])
    print(f"diagnosis: {out / DIAGNOSIS_MD}")
    sys.stdout.flush()
