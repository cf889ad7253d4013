"""The diagnosis in words: number formats, the markdown section (diagnosis.md, the report's "Why is tau what it
is?")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddtree.pipeline.diagnose.stats import COVERAGE_K


def budget_name(b: int | None) -> str:
    return "-" if b is None else ("1 (a chain: DFlash)" if b == 1 else str(b))


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"



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
    if doc.get("load"):  # budget=auto with many streams: the controller's choices against the load
        lines += [f"{h} Budget against the load", "",
                  "budget=auto with concurrency > 1 chose each round's draft for the live streams "
                  "(docs/concurrency.md, the budget rule):", "",
                  "| job | streams | rounds | choices (rounds) | predicted tok/s | measured tok/s |",
                  "| --- | ---: | ---: | --- | ---: | ---: |"]
        for r in doc["load"]:
            choices = ", ".join(f"{k} {v}" for k, v in sorted(r["choices"].items(), key=lambda kv: -kv[1]))
            lines.append(f"| {r['name']} | {r['streams']} | {r['rounds']} | {choices} | {fmt(r['predicted_tok_s'], 0)} "
                         f"| {fmt(r['measured_tok_s'], 0)} |")
        lines.append("")
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
        lines.append(f"| {m['name']} | {m['method']}{t} | {m['budget']} | {m['measured']:.2f} | {fmt(m['accepted'])} | "
                     f"{fmt(m['predicted'])} | {100 * m['error']:+.1f} % |")
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
        lines += ["", f"Verification cost ({doc['cost']['source']}): AR {fmt(doc['cost']['ar_ms'])} ms a token; rounds "
                  + ", ".join(f"{b}: {ms:.2f} ms" for b, ms in doc["cost"]["round_ms"].items())
                  + " (between measured budgets: interpolated in log2 budget; outside them: not predicted). "
                  f"Best budget: {budget_name(doc['best_budget'])}."]
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
    if doc.get("by_scoring"):
        lines += ["", f"{h} By scoring", "", "Each scoring's jobs diagnosed on their own records (pair: the selector's "
                  "scores given the target's path): the drafter's top-1 right on and off its own path (depths >= 2 of "
                  "the accepted paths), and the predicted tau by budget.", ""]
        budgets = list(next(iter(doc["by_scoring"].values()))["predicted"] or {})
        lines += ["| scoring | rounds | on its path | off it | " + " | ".join(f"tau @ {b}" for b in budgets) + " |",
                  "| --- | ---: | ---: | ---: |" + " ---: |" * len(budgets)]
        for k, part in doc["by_scoring"].items():
            acc, pred = part["accuracy"], part["predicted"] or {}
            lines.append(f"| {k} | {part['rounds']} | {pct(acc['main']['rate'])} | {pct(acc['off']['rate'])} | "
                         + " | ".join(fmt(pred.get(b)) for b in budgets) + " |")
    a = doc["accuracy"]
    lines += ["", f"{h} The drafter on and off its top-1 chain", "",
              "The drafter's top-1 is the target's token, at depths >= 2 of the accepted paths (95 % Wilson intervals):",
              "", "| where | right | of | rate | interval |", "| --- | ---: | ---: | ---: | --- |"]
    for name, r in (("on its top-1 chain", a["main"]), ("off it (a non-top-1 token above)", a["off"])):
        lines.append(f"| {name} | {r['k']} | {r['n']} | {pct(r['rate'])} | {pct(r['lo'])} – {pct(r['hi'])} |")
    lines.append(f"| on the chain, at the off-path depths | | {a['depth_matched_main']['n']} | "
                 f"{pct(a['depth_matched_main']['rate'])} | |")
    nd = a["nodes"]
    if nd["main"]["n"] or nd["off"]["n"]:
        lines += ["", "Every verified top-1 node of the trees whose parent's target choice was computed (the lazy "
                  "head on a CPU computes it on the walked path's chains only): "
                  f"on the chain {nd['main']['k']}/{nd['main']['n']} ({pct(nd['main']['rate'])}), off it "
                  f"{nd['off']['k']}/{nd['off']['n']} ({pct(nd['off']['rate'])})."]
    lines += ["", f"{h} By depth", "",
              "| depth | rounds (chain / off) | top-1 accepted on the chain | " +
              " | ".join(f"top {k}" for k in COVERAGE_K) + " |",
              "| ---: | ---: | ---: |" + " ---: |" * len(COVERAGE_K)]
    for r in doc["depths"]:
        if r["n_main"] + r["n_off"] == 0:
            continue
        lines.append(f"| {r['depth']} | {r['n_main']} / {r['n_off']} | {pct(r['accept_main'])} | "
                     + " | ".join(pct(r["coverage"][k]) for k in COVERAGE_K) + " |")
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return lines + [""]
