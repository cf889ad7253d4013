"""Published figures to hold a report against: docs/paper_reference.yaml (the DDTree paper's Table 1).

The file lists one entry per model x temperature x dataset, each with the paper's DFlash and DDTree
(best budget) speedup and tau. A value that was not found is null, never zero; `verified: false` marks
values not checked against the paper itself. `python -m ddtree.report` puts these beside the report's
own cells (report.md, "Against the paper"; report.json, "reference"), and docs/paper.md shows the same
table rendered by `reference_markdown` (a test keeps the two equal).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from ddtree.errors import ConfigError
from ddtree.pipeline.datasets import dataset_rank
from ddtree.pipeline.schema import CONF_DIR, REPO_ROOT

DEFAULT_REFERENCE = REPO_ROOT / "docs" / "paper_reference.yaml"
ENTRY_KEYS = {"model", "temperature", "dataset", "dflash", "ddtree", "verified", "note"}
METHOD_KEYS = {"dflash": {"speedup", "tau"}, "ddtree": {"speedup", "tau", "budget"}}
FIX = "see docs/paper_reference.yaml for the format (one entry per model x temperature x dataset)"


def _number(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError("reference", f"{where} must be a positive number or null, not {v!r}", FIX)
    return float(v)


def load_reference(path: str | Path) -> dict[str, Any]:
    """{"path", "source", "entries": {(model, dataset, temperature): entry}}, checked; ConfigError otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("reference", f"no reference file at {p}",
                          "pass reference=<a YAML like docs/paper_reference.yaml>, "
                          "or reference=null for none")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError("reference", f"{p} is not valid YAML ({str(e).splitlines()[0]})", FIX) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("figures"), list):
        raise ConfigError("reference", f"{p} has no 'figures' list", FIX)
    entries: dict[tuple[str, str, float], dict[str, Any]] = {}
    for i, e in enumerate(doc["figures"]):
        where = f"{p.name} figures[{i}]"
        if not isinstance(e, dict) or not {"model", "temperature", "dataset"} <= set(e):
            raise ConfigError("reference", f"{where} needs model, temperature and dataset", FIX)
        unknown = set(e) - ENTRY_KEYS
        if unknown:
            raise ConfigError("reference", f"{where} has unknown keys {sorted(unknown)}", FIX)
        key = (str(e["model"]), str(e["dataset"]), float(e["temperature"]))
        if key in entries:
            raise ConfigError("reference", f"{where} repeats {key}", "keep one entry per model x dataset x temperature")
        out = {"model": key[0], "dataset": key[1], "temperature": key[2],
               "verified": bool(e.get("verified", False)), "note": e.get("note")}
        for method, allowed in METHOD_KEYS.items():
            m = e.get(method) or {}
            if not isinstance(m, dict) or set(m) - allowed:
                raise ConfigError("reference", f"{where}.{method} takes only {sorted(allowed)}", FIX)
            out[method] = {k: _number(m.get(k), f"{where}.{method}.{k}") for k in sorted(allowed)}
            if out[method].get("budget") is not None:
                out[method]["budget"] = int(out[method]["budget"])
        entries[key] = out
    models = doc.get("models") or {}
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        raise ConfigError("reference", f"{p} models: must map a model name to its hub id", FIX)
    return {"path": str(p), "source": doc.get("source"), "entries": entries,
            "models": {str(k): v for k, v in models.items()}}


def reference_model(ref: dict[str, Any], model: str) -> str:
    """The reference's name for a report cell's model: its own, or the one whose hub id it is (model=hf)."""
    by_hub = {hub.lower(): name for name, hub in ref.get("models", {}).items()}
    by_base = {hub.lower().rsplit("/", 1)[-1]: name for name, hub in ref.get("models", {}).items()}
    low = model.lower()
    return by_hub.get(low) or by_base.get(low.rsplit("/", 1)[-1]) or model


def dataset_titles() -> dict[str, str]:
    """name -> title, from conf/dataset/*.yaml."""
    titles = {}
    for f in sorted((CONF_DIR / "dataset").glob("*.yaml")):
        d = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        if d.get("title"):
            titles[f.stem] = str(d["title"])
    return titles


def _fmt(v: float | None, verified: bool, suffix: str = "") -> str:
    if v is None:
        return ""
    return f"{v:.2f}{suffix}" + ("" if verified else " (unverified)")


def _yours(v: float | None, suffix: str = "") -> str:
    return "" if v is None else f"{v:.2f}{suffix}"


def comparison_rows(ref: dict[str, Any], cells: list[dict[str, Any]] | None, models: list[str]) -> list[dict[str, Any]]:
    """One row per reference entry of `models`: the paper's numbers, the matching report cell's (if any),
    and yours / paper where both exist."""
    look = {(reference_model(ref, c["model"]), c["dataset"], float(c["temperature"])): c for c in cells or []}
    rows = []
    for key, e in sorted(ref["entries"].items(), key=lambda kv: (kv[0][2], kv[0][0], dataset_rank(kv[0][1]))):
        if key[0] not in models:
            continue
        c = look.get(key)
        d, t = (c or {}).get("dflash") or {}, (c or {}).get("ddtree_best") or {}
        yours = {"dflash": {"speedup": d.get("speedup"), "tau": d.get("tau")},
                 "ddtree": {"speedup": t.get("speedup"), "tau": t.get("tau"), "budget": t.get("budget")}}
        ratio = {f"{m}_{k}": (yours[m][k] / e[m][k] if yours[m][k] is not None and e[m][k] else None)
                 for m in ("dflash", "ddtree") for k in ("speedup", "tau")}
        rows.append({"model": key[0], "dataset": key[1], "temperature": key[2], "verified": e["verified"],
                     "paper": {"dflash": e["dflash"], "ddtree": e["ddtree"]}, "yours": yours,
                     "yours_over_paper": ratio})
    return rows


def reference_markdown(ref: dict[str, Any], model: str, cells: list[dict[str, Any]] | None = None) -> str:
    """The paper's figures for one model beside yours (blank without `cells`): a table per temperature."""
    titles = dataset_titles()
    rows = comparison_rows(ref, cells, [model])
    lines: list[str] = []
    for temp in sorted({r["temperature"] for r in rows}):
        lines += [f"Temperature {temp:g}:", "",
                  "| dataset | paper DFlash speedup | paper DDTree speedup (budget) | paper tau (DFlash / DDTree) | "
                  "your DFlash speedup | your DDTree speedup (budget) | your tau (DFlash / DDTree) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in (r for r in rows if r["temperature"] == temp):
            p, y, ok = r["paper"], r["yours"], r["verified"]
            pb = f" ({p['ddtree']['budget']})" if p["ddtree"]["speedup"] is not None and p["ddtree"]["budget"] else ""
            yb = f" ({y['ddtree']['budget']})" if y["ddtree"]["speedup"] is not None else ""
            ptau = " / ".join(_fmt(p[m]["tau"], True) or "-" for m in ("dflash", "ddtree"))
            ytau = " / ".join(_yours(y[m]["tau"]) or "-" for m in ("dflash", "ddtree"))
            lines.append(f"| {titles.get(r['dataset'], r['dataset'])} | {_fmt(p['dflash']['speedup'], ok, 'x')} | "
                         f"{_fmt(p['ddtree']['speedup'], ok, 'x')}{pb} | "
                         f"{'' if ptau == '- / -' else ptau + ('' if ok else ' (unverified)')} | "
                         f"{_yours(y['dflash']['speedup'], 'x')} | {_yours(y['ddtree']['speedup'], 'x')}{yb} | "
                         f"{'' if ytau == '- / -' else ytau} |")
        lines.append("")
    return "\n".join(lines)


def reference_models(ref: dict[str, Any]) -> list[str]:
    """The reference's models, in the order of their first entry."""
    return list(dict.fromkeys(k[0] for k in ref["entries"]))


def all_models_markdown(ref: dict[str, Any]) -> str:
    """Every model's tables, a `###` heading each (the hub id beside the name when the reference has it)."""
    parts = []
    for m in reference_models(ref):
        hub = ref.get("models", {}).get(m)
        parts.append(f"### {m}" + (f" ({hub})" if hub else "") + "\n\n" + reference_markdown(ref, m))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """`python -m ddtree.reference [file] [model]`: print the tables docs/paper.md shows (every model)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    ref = load_reference(args[0] if args else DEFAULT_REFERENCE)
    print(reference_markdown(ref, args[1]) if len(args) > 1 else all_models_markdown(ref), end="")


if __name__ == "__main__":
    main()
