"""`python -m ddtree.diagnose <job dir | sweep dir>`: the diagnosis of the jobs there, written beside them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddtree.errors import ConfigError
from ddtree.pipeline.console import tracebacks_wanted, user_error
from ddtree.pipeline.diagnose.analysis import diagnose
from ddtree.pipeline.diagnose.cost import read_cost_table
from ddtree.pipeline.diagnose.outputs import DIAGNOSIS_MD, write_diagnosis
from ddtree.pipeline.diagnose.records import load_jobs
from ddtree.pipeline.diagnose.text import fmt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree.diagnose", description=__doc__.split("\n\n")[0].strip('"`'))
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
              f"{fmt(m['predicted'])}")
    print(doc["verdict"])
    print(f"diagnosis: {out / DIAGNOSIS_MD}")
    sys.stdout.flush()
