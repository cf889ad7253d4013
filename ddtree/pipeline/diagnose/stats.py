"""Statistics of the per-round records: acceptance and coverage by depth, the drafter's top-1 on and off its main
chain with Wilson intervals, the rank probabilities the prediction models take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree.engine.diagnostics import NODE_COLUMNS, RANK_CAP
from ddtree.engine.stats import wilson

COVERAGE_K = (1, 2, 4, 8, 32)
MIN_OFF = 20  # off-path observations a depth needs before its own statistics replace the pooled ratio


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
    if L is None:  # the drafter's positions: its rows (a chain's rounds record no nodes), else the deepest path
        L = max((len(r) for dg in diagnoses for r in dg["ranks"]), default=1)
        L = max([L] + [len(dg.get("nodes") or []) - 1 for dg in diagnoses]
                + [len(w) for dg in diagnoses for w in dg.get("rows") or []])
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
