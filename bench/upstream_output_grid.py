"""The validator over engine=upstream: the DDTree authors' code on a grid of tiny targets.

    .venv/bin/python bench/upstream_output_grid.py <checkout> [--dtypes float32 bfloat16] [--new 24] [--out grid.json]

<checkout> is a copy of github.com/liranringel/ddtree (never committed here) or the stand-in
tests/compat_fixtures/upstream_checkout. Grid: Qwen3 and the Qwen3.5 hybrid (sdpa), vocabularies 12, 64
and 300, drafter block sizes 2, 4, 8, 16, AR, DFlash and DDTree at budgets 1, 4, 16, 48, three prompts.
Each output gets a verdict against our AR baseline (ddtree.engine.output_check); suspect or failing
configurations are printed as they come, the totals at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from pathlib import Path

import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.output_check import ValidationRule, Validator
from ddtree.testing.tiny import tiny_model
from ddtree.upstream.engine import generate_upstream, load_upstream_engine

METHODS = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in (1, 4, 16, 48)]


def grid(checkout: Path, dtypes: list[str], new: int) -> list[dict]:
    up = load_upstream_engine(checkout)
    print("patches:", ", ".join(f"{p['id']}={p['status']}" for p in up.patches or ()), flush=True)
    rows = []
    for model_type, vocab, dtype_name in itertools.product(["qwen3", "qwen3_5_text"], [12, 64, 300], dtypes):
        dtype = getattr(torch, dtype_name)
        target = tiny_model(model_type, seed=1, vocab_size=vocab, dtype=dtype, attn_implementation="sdpa")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (1, n), generator=g) for n in (3, 9, 15)]
        base = [ddtree.generate(target, None, p, method="ar", max_new_tokens=new).output_ids for p in prompts]
        validator = Validator(target, max_new_tokens=new, rule=ValidationRule(calibration_outputs=2))
        validator.calibrate(zip(prompts, base, strict=True))
        for block in (2, 4, 8, 16):
            drafter = DFlashDrafter.random_for_target(target.config, block_size=block, seed=block, num_layers=1,
                                                      attn_implementation="sdpa").to(dtype)
            for method, budget in METHODS:
                counts, example = Counter(), None
                for p, b in zip(prompts, base, strict=True):
                    try:
                        res = generate_upstream(up, target, drafter if method != "ar" else None, p, method=method,
                                                budget=budget, max_new_tokens=new)
                        verdict = validator.verdict(p, res.output_ids, b)
                        counts[verdict.verdict] += 1
                        if verdict.verdict == "suspect":
                            example = example or verdict.reason
                    except Exception as e:  # noqa: BLE001 - a failing configuration is a finding too
                        counts["error"] += 1
                        example = example or f"{type(e).__name__}: {str(e)[:150]}"
                row = dict(model=model_type, vocab=vocab, dtype=dtype_name, block=block, method=method,
                           budget=budget, **counts, **({"example": example} if example else {}))
                rows.append(row)
                if counts["suspect"] or counts["error"]:
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path)
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--new", type=int, default=24, help="new tokens per output")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = grid(a.checkout, a.dtypes, a.new)
    total = Counter()
    for r in rows:
        total.update({k: r.get(k, 0) for k in ("exact", "tie", "ok", "suspect", "error")})
    print(f"{len(rows)} configurations, {sum(total.values())} outputs: {dict(total)}")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
