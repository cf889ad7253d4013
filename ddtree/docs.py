"""`python -m ddtree.docs`: regenerate the generated parts of the documentation (`make docs`).

    python -m ddtree.docs            # rewrite them in place
    python -m ddtree.docs --check    # exit 1 and name the files that are out of date (tests do the same)

Generated, each from its one source:
  README.md, between the `models` markers   the supported models and methods (ddtree/engine/families.py and
                                            ddtree/engine/methods.py)
  README.md, between the `concurrency` markers  the many-streams table (docs/bench/bench_concurrency.json)
  README.md, between the `results` markers  the toy pair's result table (docs/bench/bench_toy_run.json, written by
                                            bench/bench_toy_run.py)
  docs/benchmarks.md                        every benchmark record under docs/bench/*.json (written by bench/)
  docs/paper.md, between the `paper-reference` markers   the paper's figures (docs/paper_reference.yaml)
  docs/dflash2.md, between the `dflash2-toy` markers     the DFlash2 toy table (the second table of
                                                         docs/bench/bench_toy_run.json)
  docs/concurrency.md, between the `concurrency-measured` and `concurrency-predicted` markers, and
  docs/concurrency.png                      the measured and predicted tables and their plot
                                            (docs/bench/bench_concurrency.json, written by bench/bench_concurrency.py;
                                            the PNG carries its data's key, so --check needs no drawing)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddtree.engine.families import FAMILIES, Family, has_tp_plan
from ddtree.engine.methods import METHODS, family_methods

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs" / "bench"


# ---------------------------------------------------------------- generated blocks in a hand-written page

def begin(name: str) -> str:
    return f"<!-- generated:{name} (make docs; do not edit by hand) -->"


def end(name: str) -> str:
    return f"<!-- /generated:{name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """text with the lines between the `name` markers replaced by body; a page without the markers is an error."""
    b, e = begin(name), end(name)
    if b not in text or e not in text:
        raise ValueError(f"the page has no '{b}' ... '{e}' block")
    head, rest = text.split(b, 1)
    _, tail = rest.split(e, 1)
    return f"{head}{b}\n{body.rstrip()}\n{e}{tail}"


# ---------------------------------------------------------------- supported models and methods

def _kind(row: Family) -> str:
    if row.gdn:
        return "hybrid: tree-exact Gated DeltaNet"
    if row.recurrent:
        return "recurrent: no exact tree verification"
    return "attention"


def _auto_attention(row: Family) -> str:
    """What attention=auto picks for the family (ddtree.pipeline.preflight.auto_attention), from its class's flags."""
    from ddtree.pipeline.preflight import auto_attention

    if row.recurrent:
        return "sdpa, else eager"  # (recurrent families: whatever their class takes; no tree to verify)
    cpu = auto_attention({"model_type": row.model_type}, "cpu", "float32")
    return f"{cpu} (CUDA: flash with sinks)" if row.sinks else cpu


def _methods_cell(methods: tuple[str, ...]) -> str:
    """A family's methods, short: "all", "all but <those it lacks>" where it lacks fewer than it has, else the list."""
    missing = [m for m in METHODS if m not in methods]
    if not missing:
        return "all"
    return f"all but {', '.join(missing)}" if len(missing) < len(methods) else ", ".join(methods)


def models_markdown() -> str:
    """The model-family table (rows alike in everything shown share a line), then the method table."""
    groups: dict[tuple, list[str]] = {}
    for row in FAMILIES.values():
        kind = _kind(row) + (f" ({row.traits})" if row.traits else "")
        key = (family_methods(row.model_type), kind, row.embedding_access == "nested", row.lean is not None,
               has_tp_plan(row.model_type), _auto_attention(row))
        groups.setdefault(key, []).append(row.model_type)
    lines = ["| `model_type` | methods | layers | wrapper | lean forward | TP plan | `attention=auto` |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (methods, kind, nested, lean, tp, auto), types in groups.items():
        lines.append(f"| {', '.join(f'`{t}`' for t in types)} | {_methods_cell(methods)} | {kind} | "
                     f"{'yes' if nested else '–'} | {'yes' if lean else '–'} | {'yes' if tp else '–'} | {auto} |")
    every = _methods_cell(family_methods(""))  # an unknown model_type: every method but the own-head ones
    lines.append(f"| any other | {every} | attention (tree methods refused on a cache with "
                 "linear-attention layers) | – | – | where shipped | sdpa, else eager |")
    lines += ["", "| method | drafts | needs a drafter | reads `budget` |", "| --- | --- | --- | --- |"]
    drafts = {"root": "nothing (the last token alone)", "chain": "a chain (one block)",
              "tree": "a best-first tree of `budget` nodes"}
    for m in METHODS.values():
        what = m.drafts or drafts.get(m.tree, m.tree)
        budget = "tree only" if m.budget_when_branching else "yes" if m.reads_budget else "no"
        needs = m.drafter_kind.needs if m.drafter_kind is not None else "no"
        lines.append(f"| `{m.name}` | {what} | {needs} | {budget} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- benchmark records

def _split_format(spec: str) -> tuple[str, str]:
    """"{:.2f}x" -> ("{:.2f}", "x"): the number's format and a unit written after the median only."""
    i = spec.rfind("}")
    return spec[: i + 1], spec[i + 1:]


def render_cell(value: Any, spec: str | None = None) -> str:
    """A record's cell as text: None as "–", a timing {median, min, max} as "median (min–max)"."""
    fmt, unit = _split_format(spec) if spec else ("{}", "")
    if value is None:
        return "–"
    if isinstance(value, dict) and "median" in value:
        m = fmt.format(value["median"]) + unit
        if value.get("min") is None or value.get("max") is None or value["min"] == value["max"]:
            return m
        return f"{m} ({fmt.format(value['min'])}–{fmt.format(value['max'])})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return fmt.format(value) + unit


def render_table(table: dict) -> str:
    cols, formats = table["columns"], table.get("formats", {})
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for row in table["rows"]:
        if len(row) != len(cols):
            raise ValueError(f"table '{table.get('title')}': a row has {len(row)} cells for {len(cols)} columns")
        lines.append("| " + " | ".join(render_cell(v, formats.get(c)) for c, v in zip(cols, row, strict=True)) + " |")
    return "\n".join(lines)


REQUIRED = ("schema", "bench", "title", "command", "commit", "machine", "date", "tables")


def load_records(folder: Path = BENCH_DIR) -> list[dict]:
    """Every docs/bench/*.json record, checked for the fields the page shows, in file-name order."""
    records = []
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}: a benchmark record needs {', '.join(missing)}")
        rec["_file"] = path.name
        records.append(rec)
    return records


BENCHMARKS_INTRO = """# Benchmarks

Generated by `make docs` from the records in [`docs/bench/`](bench/); do not edit by hand. Each benchmark
script in `bench/` writes its record there when it runs (`--json PATH` elsewhere, `--json -` for none), with the
command, the commit, the machine and the date; a test fails when this page and the records disagree. Timings are
medians, with the range over the runs in brackets. Records marked *transcribed* were copied from an earlier
version of the documentation, not written by the script: their figures are what was measured then, at the commit
named. What each benchmark measures and how to run it: [bench/README.md](../bench/README.md).

Tokens per second and milliseconds compare only within one record (the machines were shared and their speed
changed between measurements); ratios, shares and tau compare across records.
"""


def benchmarks_markdown(records: Iterable[dict]) -> str:
    out = [BENCHMARKS_INTRO]
    for rec in records:
        out += [f"## {rec['title']}", "", f"`{rec['bench']}` ({rec['_file']})" if "_file" in rec else "", ""]
        if rec.get("description"):
            out += [rec["description"], ""]
        facts = [("command", f"`{rec['command']}`"), ("commit", f"`{rec['commit']}`"), ("machine", rec["machine"]),
                 ("date", rec["date"])]
        if rec.get("source"):
            facts.append(("source", rec["source"]))
        out += [f"- {k}: {v}" for k, v in facts] + [""]
        for table in rec["tables"]:
            out += [f"**{table['title']}**", "", render_table(table), ""]
            if table.get("note"):
                out += [table["note"], ""]
        if rec.get("notes"):
            out += [rec["notes"], ""]
        for fig in rec.get("figures", ()):  # a plot drawn from the record (python -m ddtree.docs draws it)
            out += [f"![{fig['alt']}]({fig['path']})", ""]
    return "\n".join(line for line in out).rstrip() + "\n"


RESULTS_RECORD = "bench_toy_run.json"


def results_markdown(rec: dict) -> str:
    """README's result table: the first table of the toy-run record, with where it came from."""
    table = rec["tables"][0]
    runs = rec.get("params", {}).get("runs")
    spread = f"speedup: median (min–max) of {runs} runs" if runs and runs > 1 else "one run"
    return (f"{render_table(table)}\n\n{spread}, from [`docs/bench/{RESULTS_RECORD}`](docs/bench/{RESULTS_RECORD}) "
            f"(commit `{rec['commit']}`, {rec['date'][:10]}; the machine and its load: "
            f"[benchmarks.md](docs/benchmarks.md)).")


DFLASH2_TABLE = "DFlash and DFlash2 on the toy pair (`make run`'s DFlash2 jobs)"  # bench/bench_toy_run.py writes it
DFLASH2_SWEEP_TABLE = "DDTree over the toy DFlash2 drafter: tau by budget and scoring (toy_eval)"  # and this one


def dflash2_markdown(rec: dict) -> str:
    """docs/dflash2.md's toy tables: the DFlash2 tables of the toy-run record, with where they came from."""
    table = next((t for t in rec["tables"] if t["title"] == DFLASH2_TABLE), None)
    sweep = next((t for t in rec["tables"] if t["title"] == DFLASH2_SWEEP_TABLE), None)
    if table is None:
        return (f"(no DFlash2 table in `docs/bench/{RESULTS_RECORD}` yet: "
                "`OMP_NUM_THREADS=1 python bench/bench_toy_run.py --runs 3 --dflash2-only`, then `make docs`)")
    runs = max((c["n"] for r in table["rows"] for c in r if isinstance(c, dict) and "n" in c), default=1)
    spread = f"speedup: median (min–max) of {runs} runs" if runs > 1 else "one run"
    note = f" Machine: {table['note']}." if table.get("note") else ""
    by_budget = (f"\n\n{sweep['title']}:\n\n{render_table(sweep)}") if sweep is not None else ""
    return (f"{render_table(table)}\n\n{spread}, from `docs/bench/{RESULTS_RECORD}` (its DFlash2 tables; "
            f"`bench/bench_toy_run.py`).{note}{by_budget}")


OBJECTIVES_RECORD = "bench_dflash2_loss.json"  # bench/bench_dflash2_loss.py writes it


def dflash2_objectives_markdown(folder: Path) -> str:
    """docs/dflash2.md's comparison of selector objectives: every table of their record, with where it came from."""
    path = folder / OBJECTIVES_RECORD
    if not path.exists():
        return (f"(no `docs/bench/{OBJECTIVES_RECORD}` yet: `OMP_NUM_THREADS=1 python bench/bench_dflash2_loss.py "
                "--drafter NAME=DIR ...`, then `make docs`)")
    rec = json.loads(path.read_text())
    parts = [f"{t['title']}:\n\n{render_table(t)}" + (f"\n\n{t['note']}" if t.get("note") else "")
             for t in rec["tables"]]
    return "\n\n".join(parts) + (f"\n\nFrom `docs/bench/{OBJECTIVES_RECORD}` (`bench/bench_dflash2_loss.py`; commit "
                                 f"`{rec['commit']}`, {rec['date'][:10]}, {rec['machine']}).")


CONCURRENCY_RECORD = "bench_concurrency.json"  # bench/bench_concurrency.py writes it
CONCURRENCY_PLOT = "concurrency.png"  # docs/, drawn from that record
# what docs/concurrency.md shows of the record, by block: the tables whose titles start so
CONCURRENCY_BLOCKS = {"concurrency-measured": ("Measured",), "concurrency-predicted": ("Predicted",)}
PLOT_VERSION = "1"  # bump when concurrency_plot draws differently: the PNG's data key changes, `make docs` redraws


def concurrency_markdown(rec: dict | None, block: str) -> str:
    """docs/concurrency.md's measured or predicted tables, from the record, with where they came from."""
    if rec is None:
        return (f"(no `docs/bench/{CONCURRENCY_RECORD}` yet: `OMP_NUM_THREADS=1 python bench/bench_concurrency.py`, "
                "then `make docs`)")
    tables = [t for t in rec["tables"] if t["title"].startswith(CONCURRENCY_BLOCKS[block])]
    if not tables:
        return f"(no such tables in `docs/bench/{CONCURRENCY_RECORD}`)"
    parts = [f"**{t['title']}**\n\n{render_table(t)}" + (f"\n\n{t['note']}" if t.get("note") else "") for t in tables]
    at = {k: rec.get(f"measured_{k}", rec[k]) if block == "concurrency-measured" else rec[k]
          for k in ("command", "commit", "date", "machine")}  # a prediction redone keeps the measurement's own
    return "\n\n".join(parts) + (f"\n\nFrom `docs/bench/{CONCURRENCY_RECORD}` (`{at['command']}`; commit "
                                 f"`{at['commit']}`, {at['date'][:10]}; {at['machine']}).")


def _plot_key(rec: dict) -> str:
    """The data a concurrency plot draws, hashed: the PNG carries it, so --check knows a stale plot without drawing."""
    import hashlib

    data = {"v": PLOT_VERSION, "measured": rec.get("measured"), "predicted": (rec.get("predicted") or {}).get("rows")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def concurrency_plot(rec: dict, path: Path) -> Path:
    """Total tok/s against concurrency, a line per method: measured on the toy pair; predicted for Qwen3.6-27B on an
    H200, the eager round as counted and the device alone. The PNG's metadata holds the data's key (_plot_key)."""
    from ddtree.pipeline.plotting import pyplot

    plt = pyplot()
    pred = (rec.get("predicted") or {}).get("rows") or []
    panels = [("measured: toy pair (CPU)", rec["measured"], "concurrency", lambda r: r["tok_s"]["median"])]
    if pred:
        panels += [("predicted: Qwen3.6-27B bf16, H200, eager round as counted", pred, "streams", lambda r: r["tok_s"]),
                   ("predicted: the device alone (host hidden)", pred, "streams", lambda r: r["device_tok_s"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), dpi=100, squeeze=False)
    for ax, (title, rows, x, y) in zip(axes[0], panels, strict=True):
        labels = list(dict.fromkeys(r["label"] for r in rows))
        for i, name in enumerate(labels):
            pts = sorted((r[x], y(r)) for r in rows if r["label"] == name)
            style = dict(color="k", linestyle="--", marker="*") if name.startswith("auto") else dict(color=f"C{i}",
                                                                                                     marker="o")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        xs = sorted({r[x] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("total tok/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None, "ddtree-data": _plot_key(rec)})
    plt.close(fig)
    return path


def _png_key(path: Path) -> str | None:
    if not path.exists():
        return None
    from PIL import Image

    with Image.open(path) as im:
        return im.info.get("ddtree-data")


def readme_concurrency_markdown(rec: dict | None) -> str:
    """README's many-streams table: the record's first measured table (total tok/s by concurrency), with its source."""
    if rec is None:
        return f"(no `docs/bench/{CONCURRENCY_RECORD}` yet: `OMP_NUM_THREADS=1 python bench/bench_concurrency.py`)"
    conc = sorted({r["concurrency"] for r in rec["measured"]})
    labels = list(dict.fromkeys(r["label"] for r in rec["measured"]))
    cell = {(r["label"], r["concurrency"]): r["tok_s"]["median"] for r in rec["measured"]}
    rows = ["| method | " + " | ".join(f"c={c}" for c in conc) + " |", "| --- |" + " ---: |" * len(conc)]
    rows += [f"| {label} | " + " | ".join(f"{cell[label, c]:.0f}" if (label, c) in cell else "–" for c in conc) + " |"
             for label in labels]
    table = "\n".join(rows)
    return (f"{table}\n\nTotal tok/s of every stream (medians of {rec['params'].get('runs', 1)} runs), "
            f"from [`docs/bench/{CONCURRENCY_RECORD}`](docs/bench/{CONCURRENCY_RECORD}) (commit `{rec['commit']}`, "
            f"{rec['date'][:10]}; [docs/concurrency.md](docs/concurrency.md)).")


def _concurrency_record(root: Path) -> dict | None:
    path = root / "docs" / "bench" / CONCURRENCY_RECORD
    return json.loads(path.read_text()) if path.exists() else None


def stale_plots(root: Path = ROOT) -> list[Path]:
    """The generated plots whose data differs from their record's (or that are missing)."""
    rec = _concurrency_record(root)
    if rec is None or "measured" not in rec:
        return []
    path = root / "docs" / CONCURRENCY_PLOT
    return [] if _png_key(path) == _plot_key(rec) else [path]


# ---------------------------------------------------------------- all pages

def generated_pages(root: Path = ROOT) -> dict[Path, str]:
    """Every generated page's full text as `make docs` would write it (nothing is written)."""
    from ddtree.pipeline.reference import DEFAULT_REFERENCE, all_models_markdown, load_reference

    readme, paper, dflash2 = root / "README.md", root / "docs" / "paper.md", root / "docs" / "dflash2.md"
    concurrency, conc_rec = root / "docs" / "concurrency.md", _concurrency_record(root)
    conc_text = concurrency.read_text()
    for block in CONCURRENCY_BLOCKS:
        conc_text = replace_block(conc_text, block, concurrency_markdown(conc_rec, block))
    return {
        concurrency: conc_text,
        readme: replace_block(replace_block(replace_block(readme.read_text(), "models", models_markdown()), "results",
                                            results_markdown(json.loads((root / "docs" / "bench" /
                                                                         RESULTS_RECORD).read_text()))),
                              "concurrency", readme_concurrency_markdown(conc_rec)),
        root / "docs" / "benchmarks.md": benchmarks_markdown(load_records(root / "docs" / "bench")),
        paper: replace_block(paper.read_text(), "paper-reference",
                             all_models_markdown(load_reference(DEFAULT_REFERENCE))),
        dflash2: replace_block(replace_block(dflash2.read_text(), "dflash2-toy",
                                             dflash2_markdown(json.loads((root / "docs" / "bench" /
                                                                          RESULTS_RECORD).read_text()))),
                               "dflash2-objectives", dflash2_objectives_markdown(root / "docs" / "bench")),
    }


def stale_pages(root: Path = ROOT) -> list[Path]:
    """The generated pages and plots that differ from what their sources make."""
    return ([p for p, text in generated_pages(root).items() if not p.exists() or p.read_text() != text]
            + stale_plots(root))


def main(argv: list[str] | None = None) -> int:
    from ddtree.noise import quiet_library_noise

    quiet_library_noise()  # torchao's and torch's import noise, as the CLIs filter it (the model table loads transformers)
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--check":
        stale = stale_pages()
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run `make docs`)")
        return 1 if stale else 0
    for path, text in generated_pages().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale_plots():
        concurrency_plot(_concurrency_record(ROOT), path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
