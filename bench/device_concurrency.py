"""The compiled batched round on CUDA (bench/device_all.sh's `concurrency` step): Engine.generate_many with
compile=auto (CUDA graphs) at 1, 8 and 32 streams on the shipped pure toy pair (fp32, greedy), against the eager
batched round (compile=false) and HF greedy decoding of each prompt alone: exactness (streams equal to each) and total
tok/s (every stream's new tokens over the call's wall seconds; the compiled engine warmed up first: its graphs
compiled on a call of its own).

    python bench/device_concurrency.py [--concurrency 1,8,32] [--methods ar,dflash,ddtree:16,ddtree:auto]
        [--new 64] [--out concurrency.json]

Prints a table and writes --out (JSON: a row per method and concurrency). Exit 1 where a stream differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _common import load_pair

import ddtree


def call(engine, prompts, c: int, new: int, stops, budget) -> tuple[list[list[int]], float, list]:
    kw = {"budget": budget} if budget == "auto" else {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    results = engine.generate_many(prompts, concurrency=c, max_new_tokens=new, stop_token_ids=stops, **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [r.output_ids for r in results], time.perf_counter() - t, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--methods", default="ar,dflash,ddtree:16,ddtree:auto")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--pair", default="toy_pure")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    pair = load_pair(args.pair, n_prompts=max(levels) * 2, device=args.device)
    if pair is None:
        print(f"device_concurrency: assets/{args.pair} is not built")
        return 1
    prompts, stops = pair.prompts, pair.stops
    refs = []
    with torch.inference_mode():  # HF greedy of each prompt alone (the reference)
        for ids in prompts:
            out = pair.target.generate(ids, max_new_tokens=args.new, do_sample=False, eos_token_id=stops,
                                       pad_token_id=0)
            refs.append(out[0, ids.shape[1]:].tolist())
    rows, bad = [], 0
    for spec in args.methods.split(","):
        name, _, b = spec.partition(":")
        budget = "auto" if b == "auto" else int(b) if b else None
        for c in levels:
            ps, rs = prompts[: 2 * c], refs[: 2 * c]
            row = dict(method=spec, concurrency=c, prompts=len(ps))
            for setting in ("false", "auto"):
                with ddtree.Engine(pair.target, pair.drafter if name != "ar" else None, method=name,
                                   budget=64 if budget == "auto" else budget, compile=setting) as engine:
                    call(engine, ps[:c], c, 8, stops, budget)  # warm-up: graphs, caches, allocator
                    outs, wall, results = call(engine, ps, c, args.new, stops, budget)
                tokens = sum(len(o) for o in outs)
                key = "compiled" if setting == "auto" else "eager"
                row[f"{key}_tok_s"] = round(tokens / wall, 1)
                row[f"{key}_round"] = results[0].round
                row[f"{key}_note"] = results[0].round_note
                row[f"{key}_exact"] = sum(o == r for o, r in zip(outs, rs, strict=True))
                row[f"{key}_outputs"] = outs
            row["same_as_eager"] = sum(a == b for a, b in zip(row.pop("compiled_outputs"), row.pop("eager_outputs"),
                                                              strict=True))
            bad += (row["compiled_exact"] < len(ps)) + (row["same_as_eager"] < len(ps))
            rows.append(row)
            print(f"{spec:12s} N={c:3d}  eager {row['eager_tok_s']:8.1f} tok/s  compiled ({row['compiled_round']}) "
                  f"{row['compiled_tok_s']:8.1f} tok/s  x{row['compiled_tok_s'] / row['eager_tok_s']:.2f}  "
                  f"exact {row['compiled_exact']}/{len(ps)} (eager {row['eager_exact']}/{len(ps)}), same as eager "
                  f"{row['same_as_eager']}/{len(ps)}" + (f"  note: {row['compiled_note']}" if row["compiled_note"]
                                                         else ""), flush=True)
            if args.out:  # written as it goes: a step killed at its limit keeps its rows
                with open(args.out, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                                   torch=torch.__version__, new=args.new, rows=rows), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
