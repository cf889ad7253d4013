"""Stage 4, evaluation: tau and speed of the trained drafter with the engine, on held-out prompts.

Every prompt runs AR, DFlash and DDTree (each budget) in this process with ddtree.generate;
greedy outputs must equal AR's (lossless), and the report says how many did.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ddtree.engine.methods import BASELINE, DRAFTER_METHOD_NAMES, get_method, loads_drafter
from ddtree.pipeline.prompts import encode
from ddtree.train.data import read_prompts, stop_ids


def _runs(methods: list[str], budgets: list[int]) -> list[tuple[str, str, int | None]]:
    out = []
    for m in methods:
        if get_method(m).reads_budget:
            out += [(f"{m}@{b}", m, b) for b in budgets]
        else:
            out.append((m, m, None))
    return out


def evaluate(target, drafter, tokenizer, prompts_path: str, *, max_samples: int | None = 16,
             max_new_tokens: int = 128, methods: list[str] | None = None, budgets: list[int] | None = None,
             chat_template: bool = True, warmup: bool = True, baseline: bool = True,
             log: Callable[[str], None] = print) -> dict:
    """Per method: tau (tokens committed per round, bonus included), tokens/s, and with the AR baseline
    (baseline=True) speedup over AR and match rate (the share of outputs equal to AR's)."""
    import ddtree

    methods = methods or list(DRAFTER_METHOD_NAMES)
    if baseline and BASELINE not in methods:
        methods = [BASELINE, *methods]  # the lossless reference and the speed baseline
    runs = _runs(methods, budgets or [8, 16, 32, 64])
    prompts = read_prompts(prompts_path, "eval.prompts")[:max_samples or None]
    stops = stop_ids(tokenizer, target)
    dev = next(target.parameters()).device
    inputs = [torch.tensor([encode(tokenizer, [{"role": "user", "content": p.turns[0]}], chat_template=chat_template)],
                           device=dev) for p in prompts]

    def gen(method: str, budget: int | None, ids: torch.Tensor, n: int):
        return ddtree.generate(target, drafter if loads_drafter(method) else None, ids, method=method, budget=budget,
                               max_new_tokens=n, stop_token_ids=stops)

    if warmup and inputs:
        for _, method, budget in runs:
            gen(method, budget, inputs[0], 8)
    acc = {name: {"tokens": 0, "rounds": 0, "committed": 0, "seconds": 0.0, "match": 0} for name, _, _ in runs}
    t0 = time.perf_counter()
    for ids in inputs:
        ref = None
        for name, method, budget in runs:
            r = gen(method, budget, ids, max_new_tokens)
            a = acc[name]
            a["tokens"] += r.num_new_tokens
            a["rounds"] += r.rounds
            a["committed"] += sum(r.acceptance_lengths)
            a["seconds"] += r.total_s
            if ref is None:
                ref = r.output_ids
            a["match"] += int(r.output_ids == ref)
    ar_tps = acc[BASELINE]["tokens"] / max(acc[BASELINE]["seconds"], 1e-9) if BASELINE in acc else 0.0
    report: dict = {"prompts": len(inputs), "max_new_tokens": max_new_tokens, "methods": {}}
    for name, a in acc.items():
        tps = a["tokens"] / max(a["seconds"], 1e-9)
        report["methods"][name] = {"tau": a["committed"] / max(1, a["rounds"]), "tokens_per_s": tps,
                                   "speedup": tps / ar_tps if ar_tps else 0.0,
                                   "match_rate": a["match"] / max(1, len(inputs)), "new_tokens": a["tokens"]}
    trees = {k: v for k, v in report["methods"].items() if k.startswith("ddtree@")}
    if trees:
        best = max(trees, key=lambda k: trees[k]["tau"])
        fastest = max(trees, key=lambda k: trees[k]["tokens_per_s"])
        report["ddtree_best_tau"] = {"budget": int(best.split("@")[1]), **trees[best]}
        report["ddtree_fastest"] = {"budget": int(fastest.split("@")[1]), **trees[fastest]}
    report["seconds"] = time.perf_counter() - t0
    for name, m in report["methods"].items():
        log(f"eval: {name:<11} tau {m['tau']:.2f}  {m['tokens_per_s']:.1f} tok/s  speedup {m['speedup']:.2f}x  "
            f"match {m['match_rate']:.2f}")
    return report
