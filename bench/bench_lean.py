"""A lean-forward feature on and off, in one process, interleaved per prompt (ddtree.engine.forward).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lean.py [--switch layers|tail] [--pairs toy,toy_pure]
        [--rows ar,dflash,ddtree:64] [--prompts 48] [--new 128] [--passes 3]

--switch layers (default): "off" is the lean forward as it was before `LeanLayer`: every decoder layer runs its
own `forward` and the final norm its module (the bench switches `LeanLayer.supports` and the fused norms off
for those calls). Both are bitwise the plain model call (tests/test_forward.py).
--switch tail: "off" runs a lazy-head round's last decoder layer over every node (`LeanForward.lazy_tail`
off: only the head is lazy), "on" only over the rows the walk asks for (`LazyTail`).
"on" is the engine's default; the outputs must be identical, and the bench checks it. Each prompt runs on/off back to back, the order alternating per
prompt; tok/s per pass, ratio = on / off (median over passes, min-max in brackets). The answers workload of
bench_engines.py: each held-out prompt's answer up to its stop token, at most --new tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_engines import machine, trained_pair  # noqa: E402

import ddtree  # noqa: E402
import ddtree.engine.forward as forward  # noqa: E402

_SUPPORTS, _NORM = forward.LeanLayer.supports, forward.lean_norm


@contextmanager
def lean_layers(on: bool):
    """Sessions made inside build their LeanForward with (on) or without (off) lean layers and fused norms."""
    if not on:
        forward.LeanLayer.supports = staticmethod(lambda layer: False)
        forward.lean_norm = lambda norm, fused: _NORM(norm, False)
    try:
        yield
    finally:
        forward.LeanLayer.supports, forward.lean_norm = staticmethod(_SUPPORTS), _NORM


@contextmanager
def lazy_tail(on: bool):
    """Sessions made inside build their LeanForward with (on) or without (off) the lazy last layer."""
    if on:
        yield
        return
    def build(self, *a, **kw):
        _INIT(self, *a, **kw)
        self.lazy_tail = False
    forward.LeanForward.__init__ = build
    try:
        yield
    finally:
        forward.LeanForward.__init__ = _INIT


_INIT = forward.LeanForward.__init__
SWITCHES = {"layers": lean_layers, "tail": lazy_tail}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="layers")
    ap.add_argument("--pairs", default="toy,toy_pure")
    ap.add_argument("--rows", default="ar,dflash,ddtree:16,ddtree:64,ddtree:256")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    rows = [(r.split(":")[0], int(r.split(":")[1]) if ":" in r else None) for r in args.rows.split(",")]
    print(f"machine: {machine()}")
    switch = SWITCHES[args.switch]
    label = {"layers": "lean layers", "tail": "lazy last layer"}[args.switch]
    print(f"| pair | method | budget | {label} tok/s | without tok/s | on / off | same output |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.pairs.split(","):
        pair = trained_pair(name, args.prompts, "cpu", torch.float32)
        if pair is None:
            print(f"| {name} | (not built: make toy / make toy-pure) | | | | | |")
            continue
        for method, budget in rows:
            rates: dict[bool, list[float]] = {True: [], False: []}
            same = True
            for _ in range(args.passes):
                wall, tokens, outs = {True: 0.0, False: 0.0}, {True: 0, False: 0}, {True: [], False: []}
                for i, ids in enumerate(pair.prompts):
                    for on in ((True, False) if i % 2 else (False, True)):
                        with switch(on):
                            t0 = time.perf_counter()
                            r = ddtree.generate(pair.target, pair.drafter, ids, method=method, budget=budget,
                                                max_new_tokens=args.new, stop_token_ids=pair.stops)
                            wall[on] += time.perf_counter() - t0
                        tokens[on] += r.num_new_tokens
                        outs[on].append(r.output_ids)
                same &= outs[True] == outs[False]
                for on in (True, False):
                    rates[on].append(tokens[on] / wall[on])
            ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
            print(f"| {name} | {method} | {budget or '–'} | {statistics.median(rates[True]):.1f} | "
                  f"{statistics.median(rates[False]):.1f} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}–{max(ratios):.2f}) | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
