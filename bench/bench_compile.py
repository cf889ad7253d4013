"""What the compiled round costs and saves here: compile time against the per-round gain (docs/compile.md).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_compile.py [--pair toy] [--methods ddtree:64,dflash,ar]
        [--prompts 4] [--new 64] [--passes 3] [--backend inductor] [--out runs/bench_compile.json]

Per method: an eager Engine (compile=false) and a compiled one (compile=true), each warmed up once (the compiled
one's warm-up is the compile: timed, and counted as the compile's cost), then --passes passes over the prompts,
eager and compiled interleaved per prompt; ms a round is the median over passes of the pass's decode seconds /
rounds. The outputs must be the same (greedy). break-even rounds = compile seconds / (eager - compiled ms a round).
On a CPU this is the measurement behind compile=auto leaving the compiled round off there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import Record, load_pair, params, random_pair

import ddtree


def _method(spec: str) -> tuple[str, int | None]:
    name, _, budget = spec.partition(":")
    return name, int(budget) if budget else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="toy")
    ap.add_argument("--methods", default="ddtree:64,dflash,ar")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor)")
    ap.add_argument("--out", default="-", help="JSON record ('-': none)")
    a = ap.parse_args()
    pair = load_pair(a.pair, a.prompts) or random_pair(a.prompts)
    rows = []
    for spec in a.methods.split(","):
        method, budget = _method(spec)
        drafter = pair.drafter if method != "ar" else None
        kw = dict(method=method, budget=budget)
        eager = ddtree.Engine(pair.target, drafter, compile="false", **kw)
        compiled = ddtree.Engine(pair.target, drafter, compile="true", compile_backend=a.backend, **kw)
        first = pair.prompts[0]
        eager.generate(first, max_new_tokens=8)
        t = time.perf_counter()
        compiled.generate(first, max_new_tokens=8)
        compile_s = time.perf_counter() - t
        per = {"eager": [], "compiled": []}
        for _ in range(a.passes):
            spent = {"eager": [0.0, 0], "compiled": [0.0, 0]}
            for ids in pair.prompts:
                outs = {}
                for name, engine in (("eager", eager), ("compiled", compiled)):
                    res = engine.generate(ids, max_new_tokens=a.new, stop_token_ids=pair.stops)
                    spent[name][0] += res.decode_s
                    spent[name][1] += res.rounds
                    outs[name] = res.output_ids
                if outs["eager"] != outs["compiled"]:
                    raise SystemExit(f"{spec}: the compiled round's output differs from the eager one's")
            for name, (seconds, rounds) in spent.items():
                per[name].append(1e3 * seconds / max(1, rounds))
        ms = {name: statistics.median(v) for name, v in per.items()}
        gain = ms["eager"] - ms["compiled"]
        rows.append(dict(method=spec, compile_s=compile_s, eager_ms=ms["eager"], compiled_ms=ms["compiled"],
                         speedup=ms["eager"] / ms["compiled"],
                         break_even_rounds=(1e3 * compile_s / gain) if gain > 0 else None))
        r = rows[-1]
        even = "never" if r["break_even_rounds"] is None else f"{r['break_even_rounds']:.0f} rounds"
        print(f"{spec}: compile {compile_s:.0f} s; a round {r['eager_ms']:.1f} ms eager, {r['compiled_ms']:.1f} ms "
              f"compiled ({r['speedup']:.2f}x); break-even after {even}", flush=True)
    rec = Record("bench_compile", "The compiled round: compile time against the per-round gain",
                 f"{pair.name}, {a.prompts} prompts x {a.new} new tokens, median of {a.passes} interleaved passes, "
                 f"torch {torch.__version__}, backend {a.backend or 'inductor'}",
                 params=params(a))
    rec.table(pair.name, ["method", "compile s", "eager ms/round", "compiled ms/round", "speedup", "break-even rounds"],
              [[r["method"], round(r["compile_s"]), round(r["eager_ms"], 1), round(r["compiled_ms"], 1),
                round(r["speedup"], 2), None if r["break_even_rounds"] is None else round(r["break_even_rounds"])]
               for r in rows])
    rec.write(None if a.out == "-" else a.out)


if __name__ == "__main__":
    main()
