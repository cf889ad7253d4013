"""The diagnosis of a set of jobs: statistics, predicted curves, the jobs' measured tau beside them, the
verification cost and the best budget, one verdict line."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from ddtree.engine.methods import drafter_method
from ddtree.pipeline.diagnose.cost import cost_curve, interpolate_cost, round_ms
from ddtree.pipeline.diagnose.model import chain_tau, predict_taus, replay_taus, replayable
from ddtree.pipeline.diagnose.records import JobData
from ddtree.pipeline.diagnose.stats import (
    MIN_OFF,
    RankStats,
    collect,
    depth_table,
    main_vs_off,
    rank_probabilities,
)
from ddtree.pipeline.diagnose.text import MODEL_NOTE, budget_name, pct

BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)



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


def _job_rows(jobs: list[JobData]) -> list[dict[str, Any]]:
    return [{"name": j.name, "method": j.method, "budget": j.budget, "tau": j.tau, "round_ms": round_ms(j),
             "speedup": j.summary.get("speedup"), "rounds": sum(len(d["depth"]) for d in j.diagnosed)} for j in jobs]


def record_scores(j: JobData) -> str | None:
    """What a job's recorded rows score: "marginal" (per position), "pair" (a DFlash2 selector's pair scores given the
    target's path: its chain and pair trees), None: no records."""
    return (j.diagnosed[0].get("scores") or "marginal") if j.diagnosed else None


def load_rows(jobs: list[JobData]) -> list[dict[str, Any]]:
    """budget=auto with concurrency > 1 (ddtree.engine.adaptive): per job and live-stream count, the rounds, the
    drafts the controller chose (label -> rounds) and its predicted and measured tokens/s, over the job's calls."""
    rows = []
    for j in jobs:
        merged: dict[int, dict[str, Any]] = {}
        for call in j.summary.get("load_budget") or []:
            for streams, row in call.get("loads", {}).items():
                m = merged.setdefault(int(streams), {"rounds": 0, "choices": {}, "_p": [], "_m": []})
                m["rounds"] += row["rounds"]
                for label, n in row["choices"].items():
                    m["choices"][label] = m["choices"].get(label, 0) + n
                for key, src in (("_p", "predicted_tok_s"), ("_m", "measured_tok_s")):
                    if row.get(src) is not None:
                        m[key].append((row[src], row["rounds"]))
        for streams, m in sorted(merged.items()):
            p, w = m.pop("_p"), m.pop("_m")
            rows.append({"name": j.name, "streams": streams, **m,
                         "predicted_tok_s": sum(v * n for v, n in p) / sum(n for _, n in p) if p else None,
                         "measured_tok_s": sum(v * n for v, n in w) / sum(n for _, n in w) if w else None})
    return rows


def diagnose(jobs: list[JobData], cost: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything diagnosis.md and diagnosis.json say, from the jobs of one drafter-target pair. Jobs recorded under
    different scores (a DFlash2 drafter's marginal and pair jobs) are diagnosed apart: the document is the marginal
    jobs', and `by_scoring` holds each scoring's accuracy on and off the drafter's path and its predicted taus."""
    kinds = sorted({record_scores(j) for j in jobs if j.diagnosed})
    if len(kinds) > 1:
        parts = {k: diagnose([j for j in jobs if record_scores(j) in (None, k)], cost) for k in kinds}
        doc = dict(parts[kinds[0]])
        doc["jobs"] = _job_rows(jobs)
        doc["by_scoring"] = {k: {key: parts[k].get(key) for key in ("rounds", "accuracy", "predicted", "measured",
                                                                    "verdict")} for k in kinds}
        note = f"diagnosed apart by scoring ({', '.join(kinds)}); the sections below are the {kinds[0]} jobs'"
        doc["note"] = f"{doc['note']}; {note}" if doc.get("note") else note
        return doc
    drafting = [j for j in jobs if j.diagnosed]
    temps = {j.summary.get("temperature") for j in drafting}
    doc: dict[str, Any] = {"jobs": _job_rows(jobs), "suspect": suspect_jobs(jobs), "quantized": quantized_pairs(jobs),
                           "load": load_rows(jobs)}
    if not drafting:
        doc["verdict"] = ("no diagnosis: no DFlash or DDTree job here recorded its rounds (method=ar, engine=upstream, "
                          "concurrency > 1, outputs that stopped before a round, or runs older than the recording)")
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
    if kinds == ["pair"]:  # DFlash2 pair scores (ddtree.engine.selector)
        pair = ("pair scores: each row is the selector's log-softmax over its position's candidates given the target's "
                "previous token (the tree replay treats every branch's rows as the path's); a node counts as the "
                "drafter's top-1 when it is its parent's best child under them")
        doc["note"] = f"{doc['note']}; {pair}" if doc.get("note") else pair
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
    chain = drafter_method("chain")
    chains = [d for j in jobs if j.method == chain for d in j.diagnosed]
    trees = [d for j in jobs if j.method != chain for d in j.diagnosed]
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
        if not budgets:  # no job at its temperature measured a tau
            continue
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
    drafter = (f"depth-1 acceptance {pct(acc1)}, top-8 coverage {pct(cov8)}; a chain reaches tau {chain:.2f}, "
               f"the best tree up to {BUDGETS[-1]} nodes {best_tree:.2f}")
    a = doc["accuracy"]
    off, m = a["off"], a["depth_matched_main"]["rate"]
    collapsed = (off["n"] >= MIN_OFF and m is not None and off["hi"] is not None and off["hi"] < m
                 and off["rate"] < 0.6 * m)
    if best_tree < 1.1 * chain:
        if collapsed:
            return (f"tree-limited: off its top-1 chain the drafter's top-1 is right {pct(off['rate'])} "
                    f"(n={off['n']}) against {pct(m)} on it at the same depths — use a chain (DFlash); {drafter}")
        return f"drafter-limited: {drafter}; no tree helps much — a better drafter does"
    if collapsed:
        enough = min(b for b in taus if taus[b] >= chain + 0.9 * (best_tree - chain))
        return (f"tree-limited: off its top-1 chain the drafter's top-1 is right {pct(off['rate'])} (n={off['n']}) "
                f"against {pct(m)} on it — budget <= {enough} gets 90 % of what any tree gets; {drafter}")
    best = doc.get("best_budget")
    if best is not None and doc["speedup"]:
        top = doc["speedup"][best]["speedup"]
        at_tau = max((b for b in doc["speedup"]), key=lambda b: taus[b])
        if at_tau != best and doc["speedup"][at_tau]["speedup"] < 0.95 * top:
            return (f"verification-limited: tau keeps rising to {taus[at_tau]:.2f} at budget {at_tau}, but its rounds "
                    f"cost more than they gain — best budget {budget_name(best)} (predicted {top:.2f}x); {drafter}")
        return (f"drafter-limited: best budget {budget_name(best)} (predicted {top:.2f}x, tau {taus[best]:.2f}); "
                f"{drafter}")
    return f"drafter-limited: {drafter} (tau peaks near budget {best_b})"
