"""Many streams at once (Engine.generate_many): total tok/s, per-stream latency and tau against concurrency, measured
on the toy pair and predicted for Qwen3.6-27B bf16 on an H200 by the cost model.

    OMP_NUM_THREADS=1 python bench/bench_concurrency.py [--methods ar,dflash,ddtree:16,ddtree:32,ddtree:64,ddtree:auto]
        [--concurrency 1,2,4,8,16,32] [--runs 3] [--prompts 48] [--per-slot 4] [--new 128]
        [--counts docs/bench/bench_launches_concurrency.json] [--predict 1,2,4,8,16,32,64] [--context 1024]
    OMP_NUM_THREADS=1 python bench/bench_concurrency.py --quick   # a smoke test (seconds; no record without --json)

Measured, on the shipped pure toy pair (assets/toy_pure: a Qwen3 target and its trained DFlash drafter, fp32, greedy,
the stop tokens `python -m ddtree.run` uses): one `ddtree.Engine` per method, a warm-up call, then per run, for each
concurrency c and each method in turn (interleaved, so the machine's load hits every method alike; each run starts
one method later in the list), one `generate_many` call over max(--prompts, --per-slot x c) prompts (the toy's
held-out prompts, the list repeated: every slot stays busy until the queue runs dry). Per call:
  total tok/s   every stream's new tokens over the call's wall seconds (prefills and joins included);
  latency       each stream's own seconds, its prefill to its last token (GenerationResult.total_s; the wait for a
                slot, queued_s, left out): median and p90 over the call's streams;
  tau           tokens committed per round over every stream's rounds (the bonus token included).
At concurrency 1, for each fixed method, the batched round with one slot (ddtree.engine.batch.generate_many: at one
slot and a fixed budget generate_many itself runs the one-stream engine) and Engine.generate over the same prompts one
after another (today's single-stream engine), right after the call (--no-single to leave them out). The cells are
medians over --runs (with their range). `ddtree:auto` (budget="auto": ddtree.engine.adaptive) runs where that module
exists, and is left out, with a note, where it does not.

Predicted, for the real Qwen3.6-27B in bf16 on one H200, by the cost model of bench/_costmodel.py (docs/gpu.md): the
batched round's ops, kernel ops and host reads per round counted by `bench/bench_launches.py --concurrency` (--counts;
at an N not counted: interpolated linearly between the counted N, extrapolated from the last two beyond them), bytes
= the weights once a round + each stream's KV rows at --context, GDN states and drafter KV, FLOPs = streams x tree
tokens x 2 x parameters; total tok/s = N x tau / round, tau the toy's measured at the lowest concurrency (the whole
prompt list, each prompt once); `auto` = the best fixed method at each N (what the budget rule aims at).
Writes docs/bench/bench_concurrency.json (`make docs` renders it into docs/benchmarks.md and docs/concurrency.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from _common import ROOT, Record, Spread, add_json_arg, load_pair, params, random_pair
from _costmodel import H200, predict, real_dims

import ddtree
from ddtree.engine import batch

STRUCTURE = "qwen3_6_27b"
QUICK = dict(methods="ar,dflash,ddtree:16", concurrency="1,2", runs=1, prompts=2, per_slot=1, new=8, predict="1,8")


def has_auto() -> bool:
    """Whether the budget rule (ddtree.engine.adaptive) is in this checkout."""
    return importlib.util.find_spec("ddtree.engine.adaptive") is not None


def parse_method(spec: str) -> tuple[str, int | str | None]:
    name, _, budget = spec.partition(":")
    return name, (budget if budget == "auto" else int(budget)) if budget else None


def label(spec: str) -> str:
    name, budget = parse_method(spec)
    return {"ar": "AR", "dflash": "DFlash"}.get(name, f"DDTree-{budget}")


def p90(values: list[float]) -> float:
    """The 90th percentile (linear between order statistics; the value itself for one stream)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = 0.9 * (len(xs) - 1)
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------- measured

def engines(pair, specs: list[str]) -> dict[str, tuple[ddtree.Engine, int | str | None]]:
    out = {}
    for spec in specs:
        name, budget = parse_method(spec)
        engine = ddtree.Engine(pair.target, pair.drafter if name != "ar" else None, method=name,
                               budget=64 if budget == "auto" else budget)
        out[spec] = (engine, budget)
    return out


def one_call(engine, budget, prompts, c: int, args, stops) -> dict:
    kw = {"budget": budget} if budget == "auto" else {}
    since = len(engine.load_budget.history) if budget == "auto" and engine.load_budget is not None else 0
    t = time.perf_counter()
    results = engine.generate_many(prompts, concurrency=c, max_new_tokens=args.new, stop_token_ids=stops, **kw)
    wall = time.perf_counter() - t
    new = sum(r.num_new_tokens for r in results)
    lat = [r.total_s for r in results]
    out = dict(tok_s=new / wall, wall_s=wall, tokens=new, latency_median=statistics.median(lat), latency_p90=p90(lat),
               tau=sum(sum(r.acceptance_lengths) for r in results) / max(1, sum(r.rounds for r in results)))
    if budget == "auto":  # the rule's choices this call: rounds by option (the controller outlives calls)
        out["choices"] = dict(Counter(r.choice.label for r in engine.load_budget.history[since:]).most_common())
    return out


def measure(args, pair, specs: list[str]) -> tuple[list[dict], list[dict]]:
    """The measured rows (method x concurrency: medians over the runs) and, at concurrency 1, Engine.generate's tok/s
    over the same prompts one after another (today's single-stream engine), interleaved with the batched calls."""
    runs: dict[tuple[str, int], list[dict]] = {}
    single: dict[str, list[float]] = {}
    built = engines(pair, specs)
    for engine, budget in built.values():  # warm-up: lazy buffers, the allocator
        one_call(engine, budget, pair.prompts[:2], 2, argparse.Namespace(new=8), pair.stops)
    for run in range(args.runs):
        for c in args.concurrency:
            n = max(args.prompts, args.per_slot * c)
            prompts = (pair.prompts * math.ceil(n / len(pair.prompts)))[:n]
            for spec in specs[run % len(specs):] + specs[:run % len(specs)]:  # (each run starts one method later:
                # none always runs after the same one, on a machine whose speed drifts)
                engine, budget = built[spec]
                m = one_call(engine, budget, prompts, c, args, pair.stops)
                m["prompts"] = n
                runs.setdefault((spec, c), []).append(m)
                print(f"run {run + 1}/{args.runs} c={c:>2} {label(spec):>11}: {m['tok_s']:7.1f} tok/s, latency "
                      f"{m['latency_median']:.3f} / {m['latency_p90']:.3f} s, tau {m['tau']:.2f} ({n} prompts, "
                      f"{m['wall_s']:.1f} s){'  ' + str(m['choices']) if 'choices' in m else ''}", flush=True)
                if c == 1 and args.single and budget != "auto":
                    # the batched round with one slot (generate_many at one slot and a fixed budget runs the
                    # one-stream engine: docs/concurrency.md), then today's engine, one prompt after another
                    t = time.perf_counter()
                    new = sum(r.num_new_tokens for r in batch.generate_many(engine, prompts, 1, 0.0, args.new,
                                                                            pair.stops, 0, engine.budget))
                    b = new / (time.perf_counter() - t)
                    t = time.perf_counter()
                    new = sum(engine.generate(p, max_new_tokens=args.new, stop_token_ids=pair.stops).num_new_tokens
                              for p in prompts)
                    g = new / (time.perf_counter() - t)
                    single.setdefault(spec, []).append((b, g))
                    print(f"run {run + 1}/{args.runs} c= 1 {label(spec):>11}: {b:7.1f} tok/s the batched round (one "
                          f"slot), {g:7.1f} with Engine.generate", flush=True)
    rows = []
    for (spec, c), ms in runs.items():
        rows.append(dict(method=spec, label=label(spec), concurrency=c, prompts=ms[0]["prompts"],
                         tok_s=Spread.of([m["tok_s"] for m in ms]).cell(1),
                         latency_median_s=Spread.of([m["latency_median"] for m in ms]).cell(3),
                         latency_p90_s=Spread.of([m["latency_p90"] for m in ms]).cell(3),
                         tau=round(statistics.median(m["tau"] for m in ms), 3),
                         tok_s_runs=[round(m["tok_s"], 1) for m in ms]))  # (in run order: the targets' paired ratios)
        if "choices" in ms[0]:  # budget=auto: the rounds each option ran, all runs together
            rows[-1]["choices"] = dict(sum((Counter(m["choices"]) for m in ms), Counter()).most_common())
    return rows, [dict(method=spec, label=label(spec), batched_tok_s=Spread.of([b for b, _ in g]).cell(1),
                       tok_s=Spread.of([x for _, x in g]).cell(1), ratio=Spread.of([b / x for b, x in g]).cell(3))
                  for spec, g in single.items()]


def paired(a: dict, b: dict) -> dict:
    """a's tok/s over b's, run by run (the same run: the machine at the same moment), as a median with its range; a
    record without the runs (before tok_s_runs): the ratio of the medians, n 1."""
    if "tok_s_runs" in a and "tok_s_runs" in b:
        return Spread.of([x / y for x, y in zip(a["tok_s_runs"], b["tok_s_runs"], strict=True)]).cell(3)
    return Spread.of([a["tok_s"]["median"] / b["tok_s"]["median"]]).cell(3)


# ---------------------------------------------------------------- predicted

def counts_at(counts: list[dict], spec: str, n: int) -> tuple[dict, str]:
    """The batched round's counts for `spec` at `n` streams (interpolated in N; another budget's counts where this
    one was not counted: a budget changes shapes, not ops) and where they came from."""
    mine = [r for r in counts if r["method"] == spec]
    source = spec
    if not mine:  # the nearest counted budget of the same method
        name, budget = parse_method(spec)
        same = [r for r in counts if parse_method(r["method"])[0] == name]
        if not same and name != "ar":  # a drafting method's counts for another (a stated stand-in)
            same = [r for r in counts if parse_method(r["method"])[0] != "ar"]
        if not same:
            raise KeyError(f"no counts for {spec}")
        near = min({r["method"] for r in same}, key=lambda m: abs((parse_method(m)[1] or 0) - (budget or 0)))
        mine, source = [r for r in counts if r["method"] == near], near
    by_n = {r["streams"]: r for r in mine}
    ns = sorted(by_n)
    keys = ("total_ops", "total_kernel_ops", "total_syncs", "graph_calls")
    if n in by_n:
        return {k: by_n[n][k] for k in keys}, f"{source} counted at N={n}"
    if len(ns) == 1:
        return {k: by_n[ns[0]][k] for k in keys}, f"{source} counted at N={ns[0]}"
    lo = max([x for x in ns if x < n], default=ns[0])
    hi = min([x for x in ns if x > n], default=ns[-1])
    if lo == hi or n > ns[-1]:
        lo, hi = ns[-2], ns[-1]
    f = (n - lo) / (hi - lo)
    return ({k: by_n[lo][k] + f * (by_n[hi][k] - by_n[lo][k]) for k in keys},
            f"{source} {'extrapolated' if n > ns[-1] else 'interpolated'} from N={lo}, {hi}")


def predicted(args, measured: list[dict], specs: list[str]) -> dict | None:
    path = Path(args.counts)
    if not path.exists():
        print(f"# no counts at {path}: no prediction (bench/bench_launches.py --concurrency 1,8,32 writes them)")
        return None
    rec = json.loads(path.read_text())
    label_ = next((k for k in rec.get("counts", {}) if k.split(" ")[0] == STRUCTURE), None)
    if label_ is None:
        print(f"# {path} has no {STRUCTURE} counts: no prediction")
        return None
    counts = rec["counts"][label_]
    dims = rec.get("dims", {}).get(STRUCTURE) or real_dims(STRUCTURE)  # recorded with the counts (a meta build: s)
    gpu = H200
    fixed = [s for s in specs if parse_method(s)[1] != "auto"]
    low = min(r["concurrency"] for r in measured)
    tau = {r["method"]: r["tau"] for r in measured if r["concurrency"] == low}
    block = 16
    rows = []
    for n in args.predict:
        for spec in fixed:
            name, budget = parse_method(spec)
            c, source = counts_at(counts, spec, n)
            nodes = 1 if name == "ar" else (block if name == "dflash" else budget + 1)
            p = predict(dims, c["total_ops"], c["total_kernel_ops"], c["total_syncs"], nodes, block, name != "ar",
                        args.context, gpu, c["graph_calls"], streams=n)
            rows.append(dict(method=spec, label=label(spec), streams=n, tau=tau[spec], nodes=nodes,
                             ops=round(c["total_ops"]), kernel_ops=round(c["total_kernel_ops"]),
                             host_reads=round(c["total_syncs"], 1), counts=source, gb=round(p["bytes"] / 1e9, 2),
                             tflop=round(p["flops"] / 1e12, 2), ceiling_ms=round(p["ceiling_ms"], 2),
                             compute_ms=round(p["compute_ms"], 2), host_ms=round(p["host_ms"], 2),
                             round_ms=round(p["round_ms"], 2), bound=p["bound"],
                             tok_s=round(n * tau[spec] / p["round_ms"] * 1e3, 1),
                             device_tok_s=round(n * tau[spec] / p["device_ms"] * 1e3, 1)))
        mine = {r["method"]: r for r in rows if r["streams"] == n}
        pick = mine[rule_choice(n, tau, fixed, args.context)]
        rows.append(dict(pick, method="auto", label="auto (the rule's choice)", chosen=pick["label"], best=max(mine.values(), key=lambda r: r["tok_s"])["label"]))
    weights = 2 * (dims["params"] + dims["drafter"] + dims["head"])
    return dict(
        structure=STRUCTURE, counts_from=f"docs/bench/{path.name} ({label_}, commit {rec.get('commit')})",
        gpu=dict(name=gpu.name, bandwidth_bytes_s=gpu.bandwidth, peak_bf16_flops=gpu.peak_flops, mfu=gpu.mfu,
                 launch_us=gpu.launch_us, dispatch_us=gpu.dispatch_us, sync_us=gpu.sync_us, graph_us=gpu.graph_us),
        context=args.context, taus_from=f"the toy's measured tau at concurrency {low}", tau=tau,
        dims=dict(dims, weights_gb_drafted=round(weights / 1e9, 2)),
        assumptions=[
            "the real Qwen3.6-27B (bench/configs/qwen3_6_27b.json) in bf16 on one H200; its DFlash drafter: 5 layers "
            "at the target's width (4 sliding at window 2048 + 1 full), block 16",
            "bytes a round = the weights once (the target without its input embeddings; where drafting, the drafter "
            "and the lm_head once more) + per stream: the target's KV rows at the context, the GDN states (fp32, read "
            "and written), the drafter's KV",
            "FLOPs a round = streams x tree tokens x 2 x parameters (+ the drafter's block); attention over the "
            "context and activations left out",
            "device = max(bytes / bandwidth, FLOPs / (peak x mfu)); host = kernel ops x launch_us + other ops x "
            "dispatch_us (eager: the batched round is not compiled); round = max(device, host) + host reads x sync_us",
            f"ops, kernel ops and host reads per round: the batched round's counted by bench/bench_launches.py "
            f"--concurrency ({label_}); between counted N interpolated, beyond them extrapolated linearly",
            "tau per stream does not depend on N (lossless per stream: each stream's tokens are its greedy decode); "
            "the toy's taus stand in for the real pair's",
            "every stream at the same context; no prefill in the rounds (a steady state of full slots)",
            "auto = the method the budget rule picks at each N (ddtree.engine.adaptive: predictions and best, with "
            "the toy's taus and its own stated cost, RooflineCost.stated('qwen3_6_27b', 'h200')), costed here like "
            "the others: its rate is this model's for the rule's choice, not the best by construction",
        ],
        rows=rows)


def rule_choice(n: int, tau: dict[str, float], fixed: list[str], context: int) -> str:
    """The method `budget=auto`'s rule picks at `n` streams among the fixed ones (ddtree.engine.adaptive.best over
    its predictions, each option's tau the toy's, the round's seconds its stated cost for Qwen3.6-27B on an H200)."""
    from ddtree.engine.adaptive import AR, Choice, RooflineCost, best, predictions

    def option(spec: str) -> Choice:
        name, budget = parse_method(spec)
        return AR if name == "ar" else Choice("chain", 15) if name == "dflash" else Choice("tree", int(budget))

    options = {option(s): s for s in fixed}
    cost = RooflineCost.stated("qwen3_6_27b", "h200", context=context)
    return options[best(n, predictions(n, {c: tau[s] for c, s in options.items()}, cost)).choice]


# ---------------------------------------------------------------- the record

def tables(rec: Record, measured: list[dict], single: list[dict], pred: dict | None, specs: list[str], args,
           note: str) -> None:
    cs = sorted({r["concurrency"] for r in measured})
    by = {(r["method"], r["concurrency"]): r for r in measured}
    rec.table("Measured on the toy pair: total tok/s by concurrency", ["method", *(f"c={c}" for c in cs)],
              [[label(s), *(by[s, c]["tok_s"] for c in cs)] for s in specs], formats={f"c={c}": "{:.0f}" for c in cs},
              note=note)
    rec.table("Measured on the toy pair: every call", ["method", "concurrency", "prompts", "total tok/s",
                                                      "latency median s", "latency p90 s", "tau"],
              [[r["label"], r["concurrency"], r["prompts"], r["tok_s"], r["latency_median_s"], r["latency_p90_s"],
                r["tau"]] for r in measured],
              formats={"total tok/s": "{:.0f}", "latency median s": "{:.3f}", "latency p90 s": "{:.3f}",
                       "tau": "{:.2f}"})
    fixed = [s for s in specs if parse_method(s)[1] != "auto"]
    targets = []
    if single and 1 in cs:
        rec.table("Measured at concurrency 1: the batched round with one slot against Engine.generate (the same "
                  "prompts, total tok/s)",
                  ["method", "generate_many", "batched round", "Engine.generate", "batched / generate"],
                  [[g["label"], by[g["method"], 1]["tok_s"], g["batched_tok_s"], g["tok_s"], one_slot(g)]
                   for g in single],
                  formats={"generate_many": "{:.0f}", "batched round": "{:.0f}", "Engine.generate": "{:.0f}",
                           "batched / generate": "{:.2f}x"},
                  note="generate_many at one slot with a fixed budget runs the one-stream engine (Engine.generate's "
                       "round); the batched round with one slot is what budget=auto and T > 0 run there")
        targets += [[f"c=1: the batched round (one slot) / Engine.generate ({g['label']})", one_slot(g), ">= 0.95x"]
                    for g in single]
    if "ar" in specs and 1 in cs and 16 in cs:
        targets.append(["AR at 16 streams / AR at 1", paired(by["ar", 16], by["ar", 1]), ">= 4x"])
    auto = next((s for s in specs if parse_method(s)[1] == "auto"), None)
    if auto and fixed:
        for c in cs:
            best = max(fixed, key=lambda s: by[s, c]["tok_s"]["median"])  # (the best by its median)
            targets.append([f"c={c}: auto / best fixed ({label(best)})", paired(by[auto, c], by[best, c]), ">= 0.95x"])
            if "ar" in specs:
                targets.append([f"c={c}: auto / AR", paired(by[auto, c], by["ar", c]), ">= 1x"])
    if targets:
        rec.table("Measured: the issue's targets (run by run: the median ratio of the same run's calls, its range)",
                  ["ratio", "measured", "target"], targets, formats={"measured": "{:.2f}x"},
                  note="Each run calls every method in turn at each concurrency, so a ratio within one run compares "
                       "calls a few seconds apart; the machine's speed moves more than that between runs.")
    if pred is None:
        return
    ns = sorted({r["streams"] for r in pred["rows"]})
    pby = {(r["method"], r["streams"]): r for r in pred["rows"]}
    methods = [*fixed, "auto"]
    rec.table(f"Predicted: Qwen3.6-27B bf16 on one H200, total tok/s by streams ({pred['context']} tokens of context "
              "a stream)", ["method", *(f"N={n}" for n in ns)],
              [[label(s) if s != "auto" else "auto (the rule)", *(pby[s, n]["tok_s"] for n in ns)] for s in methods]
              + [["auto picks", *(pby["auto", n]["chosen"] for n in ns)]],
              formats={f"N={n}": "{:.0f}" for n in ns},
              note="The eager batched round as counted: where its host time (ops x launch cost) exceeds the device "
                   "time, every method's round costs the same and tok/s follows tau.")
    rec.table("Predicted: the device alone (the host hidden, as a compiled round's graphs would), total tok/s by "
              "streams", ["method", *(f"N={n}" for n in ns)],
              [[label(s) if s != "auto" else "auto (the rule)", *(pby[s, n]["device_tok_s"] for n in ns)] for s in methods]
              + [["auto picks", *(pby["auto", n]["chosen"] for n in ns)]],
              formats={f"N={n}": "{:.0f}" for n in ns},
              note="N x tau / max(bytes / bandwidth, FLOPs / (peak x mfu)): the bandwidth-bound round until N x tree "
                   "tokens reaches the compute bound, after which every drafted token costs compute.")
    if "ar" in fixed:
        rec.table("Predicted: the rule's choice against AR and the best fixed method (total tok/s)",
                  ["N", "the rule picks", "best fixed", "auto / AR", "auto / best"],
                  [[n, pby["auto", n]["chosen"], pby["auto", n]["best"],
                    round(pby["auto", n]["tok_s"] / pby["ar", n]["tok_s"], 2),
                    round(pby["auto", n]["tok_s"] / max(pby[s, n]["tok_s"] for s in fixed), 2)] for n in ns],
                  formats={"auto / AR": "{:.2f}x", "auto / best": "{:.2f}x"},
                  note="The issue's target: auto >= AR at every N up to 64. The rule costs rounds with its own "
                       "roofline (no host time); this table costs its choice with the counted ops as well.")
    rec.table("Predicted: every round", ["method", "N", "tau", "tree tokens", "ops", "kernel ops", "host reads", "GB",
                                         "TFLOP", "ceiling ms", "compute ms", "host ms", "round ms", "bound",
                                         "total tok/s", "device-only tok/s"],
              [[r["label"], r["streams"], r["tau"], r["nodes"], r["ops"], r["kernel_ops"], r["host_reads"], r["gb"],
                r["tflop"], r["ceiling_ms"], r["compute_ms"], r["host_ms"], r["round_ms"], r["bound"], r["tok_s"],
                r["device_tok_s"]] for r in pred["rows"] if r["method"] != "auto"],
              formats={"tau": "{:.2f}", "GB": "{:.1f}", "TFLOP": "{:.2f}", "ceiling ms": "{:.1f}",
                       "compute ms": "{:.1f}", "host ms": "{:.1f}", "round ms": "{:.1f}", "total tok/s": "{:.0f}",
                       "device-only tok/s": "{:.0f}"},
              note="Assumptions: " + "; ".join(pred["assumptions"]) + f". Counts: {pred['counts_from']}.")


def one_slot(g: dict) -> dict:
    """The batched round with one slot over Engine.generate, run by run (a record from before: of the medians)."""
    return g["ratio"] if "ratio" in g else Spread.of([g["batched_tok_s"]["median"] / g["tok_s"]["median"]]).cell(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="ar,dflash,ddtree:16,ddtree:32,ddtree:64,ddtree:auto",
                    help="ddtree:auto runs where ddtree.engine.adaptive exists")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=48, help="at least this many prompts a call (the toy has 48)")
    ap.add_argument("--per-slot", type=int, default=4, help="and at least this many a slot (the list repeated)")
    ap.add_argument("--new", type=int, default=128, help="max_new_tokens (make run's)")
    ap.add_argument("--no-single", dest="single", action="store_false",
                    help="leave out Engine.generate at concurrency 1 (today's engine, one prompt after another)")
    ap.add_argument("--pair", default="toy_pure")
    ap.add_argument("--counts", default=str(ROOT / "docs" / "bench" / "bench_launches_concurrency.json"))
    ap.add_argument("--predict", default="1,2,4,8,16,32,64", help="stream counts of the predicted table")
    ap.add_argument("--context", type=int, default=1024, help="the predicted round's context a stream")
    ap.add_argument("--measured-from", default=None, metavar="RECORD",
                    help="take the measured rows from this record (measure nothing): the prediction again, e.g. "
                         "after new counts")
    ap.add_argument("--quick", action="store_true", help="a smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    add_json_arg(ap, "bench_concurrency")
    args = ap.parse_args()
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in sys.argv[1:]}
        for k, v in (QUICK | {"json": "-"}).items():  # a smoke test writes no record unless told where
            if k not in given:
                setattr(args, k, v)
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x]
    args.predict = [int(x) for x in str(args.predict).split(",") if x]
    specs = [s for s in args.methods.split(",") if s]
    skipped = [s for s in specs if parse_method(s)[1] == "auto" and not has_auto()]
    specs = [s for s in specs if s not in skipped]
    note = ("" if not skipped else "DDTree budget=auto not measured: ddtree.engine.adaptive is not in this checkout. ")
    if args.measured_from:  # the measurement of an earlier record, its provenance kept
        old = json.loads(Path(args.measured_from).read_text())
        measured, single, old_params = old["measured"], old.get("measured_single", []), old["params"]
        single = [g for g in single if "batched_tok_s" in g]  # (a record from before the one-slot batched round)
        specs = list(dict.fromkeys(m["method"] for m in measured))
        pair_name, skipped, note = old_params["pair"], old_params["skipped"], old["tables"][0].get("note", "")
        for k in ("methods", "concurrency", "runs", "prompts", "per_slot", "new", "pair", "single"):
            setattr(args, k, old_params.get(k))
    else:
        torch.manual_seed(0)
        pair = load_pair(args.pair, args.prompts) or random_pair(args.prompts)
        pair_name = pair.name
        note += (f"{pair.name}, fp32, greedy, max_new_tokens {args.new}, stop tokens {pair.stops}; medians of "
                 f"{args.runs} run(s) with their range; prompts a call: max({args.prompts}, {args.per_slot} x c).")
        print(f"# {pair.name}: {', '.join(label(s) for s in specs)} at concurrency {args.concurrency}, {args.runs} "
              f"run(s)" + (f"; skipped {skipped} (no ddtree.engine.adaptive)" if skipped else ""), flush=True)
        measured, single = measure(args, pair, specs)
    pred = predicted(args, measured, specs)
    rec = Record("bench_concurrency", "Many streams at once: total tok/s against concurrency (Engine.generate_many)",
                 "Measured on the toy pair (CPU) and predicted for Qwen3.6-27B bf16 on an H200 by the cost model, fed "
                 "with the batched round's counted ops (bench/bench_launches.py --concurrency) and the toy's taus "
                 "(docs/concurrency.md).",
                 params=params(args, pair=pair_name, skipped=skipped))
    tables(rec, measured, single, pred, specs, args, note)
    out = rec.as_dict()
    if args.measured_from:
        for k in ("command", "commit", "machine", "date"):
            out[f"measured_{k}"] = old.get(f"measured_{k}", old[k])
        out["description"] += (f" The measured tables: `{out['measured_command']}` at commit `{out['measured_commit']}`, "
                               f"{out['measured_date'][:10]}, {out['measured_machine']}.")
    out["measured"] = measured
    out["measured_single"] = single
    out["predicted"] = pred
    out["figures"] = [{"path": "concurrency.png", "alt": "total tok/s against concurrency, a line per method"}]
    for t in out["tables"]:
        print(f"\n{t['title']}")
        for row in t["rows"]:
            print("  " + " | ".join(str(c["median"] if isinstance(c, dict) else c) for c in row))
    if args.json and args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(f"# record: {args.json} (make docs renders docs/benchmarks.md and docs/concurrency.md from it)")


if __name__ == "__main__":
    main()
