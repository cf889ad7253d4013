"""Per-stage breakdown of generations (draft, tree, verify, commit, other) of every method on the toy pair.

    OMP_NUM_THREADS=1 python bench/bench_stages.py [--budgets 16,64,256,1024] [--prompts 4] [--repeats 3] [--new 128]

The shipped toy pair (assets/toy) when present, else a tiny random Qwen3 and a random drafter (whose acceptance
is meaningless; the stage costs are not). Each pass decodes every prompt; the pass with the median decode time
gives the shares, tok/s is the median over passes (min-max in brackets). Writes docs/bench/bench_stages.json.
"""

from __future__ import annotations

import argparse

from _common import Record, Spread, add_json_arg, load_pair, params, random_pair

import ddtree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    add_json_arg(ap, "bench_stages")
    args = ap.parse_args()
    pair = load_pair("toy", args.prompts) or random_pair(args.prompts, vocab_size=2048, hidden_size=256,
                                                          intermediate_size=768, prompt_len=32)
    runs = [("ar", None), ("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",") if b]
    print(f"# {pair.name}, {len(pair.prompts)} prompts, up to {args.new} new tokens, median of {args.repeats} passes")
    print(f"{'method':>8} {'budget':>6} {'tau':>5} {'tok/s':>7} {'ms/round':>9}   share: draft  tree  verify commit other")
    rows = []
    for method, budget in runs:
        engine = ddtree.Engine(pair.target, pair.drafter, method=method, budget=budget)
        passes = []
        for _ in range(args.repeats):
            res = [engine.generate(ids, max_new_tokens=args.new, stop_token_ids=pair.stops) for ids in pair.prompts]
            stages = {k: sum(r.stage_seconds[k] for r in res) for k in res[0].stage_seconds}
            passes.append((sum(r.decode_s for r in res), sum(r.rounds for r in res),
                           sum(r.num_new_tokens for r in res), sum(r.total_s for r in res), stages))
        decode, rounds, new, _total, st = sorted(passes, key=lambda x: x[0])[len(passes) // 2]
        tok_s = Spread.of([p[2] / p[3] for p in passes])
        other = max(0.0, decode - sum(st.values()))
        shares = [100 * v / decode for v in (*st.values(), other)]
        tau = (new - len(pair.prompts)) / max(1, rounds)  # the prefill's first token is not a round
        ms_round = 1e3 * decode / max(1, rounds)
        print(f"{method:>8} {budget or '-':>6} {tau:5.2f} {tok_s.median:7.1f} {ms_round:9.2f}   "
              + " ".join(f"{s:5.1f}%" for s in shares))
        rows.append([method, budget, round(tau, 2), tok_s.cell(1), round(ms_round, 2), *(round(s, 1) for s in shares)])
    rec = Record("bench_stages", "Where a generation's time goes, per stage",
                 "Share of the decode time per stage (draft = drafter forward + head, tree = tree build, verify = "
                 "target forward, commit = walk + cache commit, other = the loop), per method and budget.",
                 params=params(args, pair=pair.name))
    rec.table(f"{pair.name}, {len(pair.prompts)} prompts", ["method", "budget", "tau", "tok/s", "ms/round", "draft %",
                                                            "tree %", "verify %", "commit %", "other %"], rows,
              formats={"tau": "{:.2f}", "tok/s": "{:.1f}", "ms/round": "{:.2f}"})
    rec.write(args.json)


if __name__ == "__main__":
    main()
