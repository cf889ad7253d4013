"""The diagnosis's PNG plots: acceptance by depth, predicted and measured tau, predicted speedup by budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddtree.pipeline.diagnose.stats import COVERAGE_K
from ddtree.pipeline.plotting import pyplot, save


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
    plt = pyplot()
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
    paths.append(save(plt, fig, out / f"{prefix}_depth.png"))

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
    paths.append(save(plt, fig, out / f"{prefix}_tau.png"))

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
        paths.append(save(plt, fig, out / f"{prefix}_speedup.png"))
    return paths
