"""The documentation stays true: README size, generated tables and pages equal to their sources (the engine's
tables, the benchmark records, the paper reference), every file path and relative link in the docs exists, and
the benchmark harness writes records the page generator reads."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree import docs

ROOT = docs.ROOT
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# paths the docs name that a checkout does not hold: built or written at run time
NOT_IN_CHECKOUT = ("ddtree/_data", "runs/")
PATH = re.compile(r"(?<![\w/.-])((?:ddtree|compat|tests|bench|conf|toy|assets|docs)/[\w./*-]*[\w*/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_a_product_page_of_at_most_12_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move detail into docs/"


def test_generated_pages_equal_their_sources():
    stale = [str(p.relative_to(ROOT)) for p in docs.stale_pages()]
    assert not stale, f"out of date: {stale}; run `make docs`"


def test_make_docs_prints_no_library_noise():
    """`python -m ddtree.docs` loads transformers (the attention column), which imports torchao where it is installed:
    its import noise is filtered as every CLI filters it (ddtree.noise.LIBRARY_NOISE)."""
    import torch

    from ddtree.noise import LIBRARY_NOISE

    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "ddtree.docs", "--check"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    noise = [f for _, f, without_cuda in LIBRARY_NOISE if not (without_cuda and torch.cuda.is_available())]
    assert not [line for line in r.stderr.splitlines() if any(f in line for f in noise)], r.stderr


def test_readme_model_table_is_the_family_and_method_tables():
    readme = (ROOT / "README.md").read_text()
    table = docs.models_markdown()
    assert f"{docs.begin('models')}\n{table}\n{docs.end('models')}" in readme
    for row in docs.FAMILIES.values():  # every family and method appears, under its own name
        assert f"`{row.model_type}`" in table
    for name in docs.METHODS:
        assert f"| `{name}` |" in table


def test_readme_result_table_is_the_toy_run_record():
    """README's result table is rendered from bench/bench_toy_run.py's record, with the spread of its runs."""
    readme = (ROOT / "README.md").read_text()
    rec = json.loads((ROOT / "docs" / "bench" / docs.RESULTS_RECORD).read_text())
    body = docs.results_markdown(rec)
    assert f"{docs.begin('results')}\n{body}\n{docs.end('results')}" in readme
    table = rec["tables"][0]
    assert table["columns"] == ["method", "budget", "tau", "speedup over AR", "outputs"]
    speed = [row[3] for row in table["rows"]]
    assert speed and all(set(c) >= {"median", "min", "max", "n"} and c["min"] <= c["median"] <= c["max"] for c in speed)
    assert {row[0] for row in table["rows"]} >= {"DFlash", "DDTree"} and rec["commit"] in body


def test_benchmarks_page_matches_every_record():
    records = docs.load_records()
    assert {r["bench"] for r in records} >= {"bench_engines", "bench_overhead", "bench_tree", "bench_stages",
                                             "bench_round"}
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page == docs.benchmarks_markdown(records)
    for rec in records:  # every figure of a record is on the page, as the record has it
        for table in rec["tables"]:
            assert docs.render_table(table) in page


def test_a_changed_record_makes_the_page_stale(tmp_path):
    records = docs.load_records()
    rec = next(r for r in records if r["bench"] == "bench_engines")
    rec["tables"][0]["rows"][0][2] += 1.0
    assert docs.benchmarks_markdown(records) != (ROOT / "docs" / "benchmarks.md").read_text()


def _paths_in(text: str):
    for m in PATH.finditer(text):
        path = m.group(1).split("::")[0].rstrip(".")
        if "<" in path or any(path.startswith(p) for p in NOT_IN_CHECKOUT):
            continue
        yield path


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    missing = sorted({p for p in _paths_in(page.read_text()) if not glob.glob(str(ROOT / p))})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = page.parent / path if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)} links to missing files or headings: {bad}"


def test_the_path_check_catches_a_wrong_path():
    assert list(_paths_in("see `ddtree/attention.py` and `ddtree/engine/attention.py`")) == [
        "ddtree/attention.py", "ddtree/engine/attention.py"]
    assert not (ROOT / "ddtree" / "attention.py").exists()


def test_the_bench_harness_writes_records_the_page_renders(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "_common.py")
    common = importlib.util.module_from_spec(spec)
    sys.modules["bench_common"] = common  # dataclasses look their module up there
    try:
        spec.loader.exec_module(common)
    finally:
        del sys.modules["bench_common"]
    spread = common.timed(lambda: sum(range(100)), 5, warmup=1)
    assert spread.n == 5 and spread.min <= spread.median <= spread.max
    rec = common.Record("bench_x", "A title", "what it measures", params={"repeats": 5})
    rec.table("t", ["budget", "ms"], [[16, spread.scaled(1e3).cell()], [64, None]], formats={"ms": "{:.3f}"})
    out = rec.write(str(tmp_path / "bench_x.json"))
    data = json.loads(out.read_text())
    assert data["schema"] == common.SCHEMA and data["commit"] and data["machine"] and data["date"]
    assert "bench_x.json" not in data["command"] or "python" in data["command"]
    [loaded] = docs.load_records(tmp_path)
    page = docs.benchmarks_markdown([loaded])
    cell = data["tables"][0]["rows"][0][1]
    assert f"| 16 | {cell['median']:.3f}" in page and "| 64 | – |" in page


def test_render_cell_shows_medians_with_their_range():
    assert docs.render_cell({"median": 1.42, "min": 1.38, "max": 1.44, "n": 3}, "{:.2f}x") == "1.42x (1.38–1.44)"
    assert docs.render_cell(1.2, "{:.2f}x") == "1.20x"
    assert docs.render_cell(None) == "–" and docs.render_cell("up 48/48") == "up 48/48"


FORBIDDEN_IN_ENGINE = ("hydra", "mlflow", "omegaconf", "compat", "ddtree.pipeline", "ddtree.train", "ddtree.testing",
                       "ddtree.upstream", "ddtree.run", "ddtree.report", "ddtree.docs")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


# the one engine module that imports compat: gdn/patch.py, whose install() applies the engine's own row (gdn-tree-forward)
ENGINE_COMPAT_IMPORTS = {("ddtree/engine/gdn/patch.py", "compat"), ("ddtree/engine/gdn/patch.py", "compat.patches")}


def test_the_engine_imports_no_pipeline_hydra_mlflow_or_compat():
    """docs/architecture.md's layer rule for the engine, read from every import statement (also inside functions)."""
    bad = {f"{p.relative_to(ROOT)}: {name}" for p in (ROOT / "ddtree" / "engine").rglob("*.py")
           for name in _imports(p) if (name == "compat" or name.startswith(tuple(f + "." for f in FORBIDDEN_IN_ENGINE))
                                       or name in FORBIDDEN_IN_ENGINE)
           and (str(p.relative_to(ROOT)), name) not in ENGINE_COMPAT_IMPORTS}
    assert not bad, bad
    assert _imports(ROOT / "ddtree" / "docs.py") >= {"ddtree.engine.families", "ddtree.engine.methods"}


# docs/architecture.md's layers above the engine: (a folder's modules, the imports they must not make); the product
# (every ddtree module but ddtree/testing) imports nothing of ddtree/testing
LAYER_RULES = (
    ("ddtree/testing", ("ddtree.pipeline", "ddtree.train", "ddtree.upstream", "ddtree.run", "ddtree.report")),
    ("ddtree/upstream", ("ddtree.pipeline", "ddtree.train", "ddtree.testing")),
    ("ddtree/train", ("ddtree.testing", "ddtree.upstream")),
    ("ddtree/pipeline", ("ddtree.testing", "ddtree.train")),
    ("ddtree/tiny.py", ("ddtree.pipeline", "ddtree.train", "ddtree.testing", "ddtree.upstream")),
)
# the pipeline's face to training: its shared modules whole, and of the run's loaders the two it shares
TRAIN_MAY_IMPORT = {"ddtree.pipeline.schema", "ddtree.pipeline.prompts", "ddtree.pipeline.distributed",
                    "ddtree.pipeline.tracking", "ddtree.pipeline.console"}
TRAIN_MAY_IMPORT_NAMES = {"ddtree.pipeline.models": {"load_checkpoint", "resolve_device"}}


def _imported_names(path: Path) -> set[tuple[str, str | None]]:
    """(module, name) of every import in a file, inside functions too (name None: `import module`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.update((node.module, a.name) for a in node.names)
    return out


def test_the_layers_import_only_downward():
    """docs/architecture.md's layer table, read from every import statement: nothing imports ddtree/testing but tests
    and benchmarks; ddtree/testing imports no layer above it; training uses the pipeline's face only."""
    under = lambda name, prefixes: any(name == p or name.startswith(p + ".") for p in prefixes)  # noqa: E731
    bad = []
    for f in sorted((ROOT / "ddtree").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        for mod, name in _imported_names(f):
            full = f"{mod}.{name}" if name else mod
            if not rel.startswith("ddtree/testing/") and (under(mod, ("ddtree.testing",)) or full == "ddtree.testing"):
                bad.append(f"{rel}: {full} (the product imports ddtree/testing)")
            for folder, forbidden in LAYER_RULES:
                if rel.startswith(folder) and (under(mod, forbidden) or under(full, forbidden)):
                    bad.append(f"{rel}: {full} (upward from {folder})")
            if rel.startswith("ddtree/train/") and under(mod, ("ddtree.pipeline",)):
                ok = (mod in TRAIN_MAY_IMPORT or full in TRAIN_MAY_IMPORT
                      or name in TRAIN_MAY_IMPORT_NAMES.get(mod, ()))
                if not ok:
                    bad.append(f"{rel}: {full} (a pipeline internal)")
    assert not bad, "\n".join(sorted(set(bad)))


# where a drafter kind may be named: its row (ddtree/engine/drafter_kinds.py), the methods table, the kinds' own files
# (drafters, their proposers, the DFlash2 selector) and the testing references (independent code a test compares
# against); the pipeline loads a drafter through its kind's row (`load`), training asks it for its term (`selector`)
KIND_HOMES = ("ddtree/engine/drafter_kinds.py", "ddtree/engine/methods.py", "ddtree/engine/drafter/",
              "ddtree/engine/proposers.py", "ddtree/engine/selector.py", "ddtree/testing/")
KIND_BRANCH = re.compile(r"has_selector\(|candidate_selector|drafter_kind\s*[!=]=|\b(DFLASH|OWN_HEAD)\b|"
                         r"isinstance\([^)]*(DFlashDrafter|MTPHead|DFlash2)")


def test_nothing_outside_a_drafter_kinds_row_branches_on_the_kind():
    """The loop, the pipeline, the diagnosis and the docs generator ask a drafter kind's row (its columns), never
    which kind it is: adding a kind is its row and its own files (docs/architecture.md)."""
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in sorted((ROOT / "ddtree").rglob("*.py"))
             if not str(f.relative_to(ROOT)).startswith(KIND_HOMES)
             for i, line in enumerate(f.read_text().splitlines(), 1) if KIND_BRANCH.search(line)]
    assert not found, "\n".join(found)


def test_every_test_a_page_names_exists():
    defined = set()
    for f in (ROOT / "tests").glob("test_*.py"):
        defined.update(re.findall(r"^\s*def (test_\w+)", f.read_text(), flags=re.M))
    named = {(p.relative_to(ROOT), n) for p in PAGES for n in re.findall(r"(?<![\w/])(test_\w+)(?!\w*\.py)", p.read_text())}
    missing = sorted(f"{p}: {n}" for p, n in named if n not in defined and not n.startswith("test_x"))
    assert not missing, missing
