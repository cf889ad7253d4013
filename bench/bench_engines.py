"""The native engine against every peer that runs here: same pair, prompts, settings and warm-up, one process.

    OMP_NUM_THREADS=1 python bench/bench_engines.py [--upstream PATH] [--pairs toy,toy_pure]
        [--prompts 48] [--new 128] [--no-stop] [--passes 3] [--budgets 16,64,256] [--device cpu]
        [--dtype float32] [--out runs/bench_engines.md] [--json docs/bench/bench_engines.json]

Peers (each skipped, with the reason printed, where it cannot run):
  upstream      the DDTree authors' generate functions (`--upstream PATH` or $DDTREE_UPSTREAM: a checkout
                of github.com/liranringel/ddtree; never committed), through ddtree.upstream.engine on our
                models, drafting with our drafter's very weights;
  transformers  transformers' own DFlash (`generate(assistant_model=..., speculation_type="dflash")`, its
                MuseGlimmerAssistantModel holding our drafter's weights) and its plain greedy `generate`
                for the AR row. It refuses stateful (hybrid) targets, so it runs on toy_pure and pure only.
Pairs (default toy,toy_pure):
  toy       the shipped trained pair (assets/toy: hybrid Qwen3.5 target + DFlash drafter), its held-out prompts
            (48; --prompts N takes the first N);
  toy_pure  the pure-attention trained pair (assets/toy_pure, `make toy-pure`: a Qwen3 target of the same size
            trained on the same corpus, and its drafter), the same prompts: the fair pair for transformers' DFlash;
  pure      a tiny random pure-attention Qwen3 (6 x 192, vocab 1024) and a random drafter, --pure-prompts
            random prompts (default 4), always no-stop: acceptance is meaningless there (tau about 1), costs
            are not.
MTP rows (native only; where the pair's target checkpoint carries an MTP head, as the toy's does): `mtp S`, the
head's chain of --mtp-steps tokens a round, and `mtp SxK` at each --mtp-budgets, its EAGLE-style tree (top-K children
per expanded node); their outputs are compared with the native AR row's.
Workload, greedy (T = 0) everywhere, outputs compared per prompt:
  answers (default on the trained pairs) every prompt's answer up to its stop token (at most --new tokens): the regime the
          drafter was trained for (tau 5-8). The toy's answers are short (~20 tokens), so the figures rest on
          many prompts instead: 48 prompts give ~1,000 new tokens and ~170 DDTree rounds per engine, row and pass;
  no-stop (--no-stop, and always on the random pure pair, which has no meaningful stop token) exactly --new
          tokens per prompt. Past its answer the toy target keeps going (it starts a new count or greeting),
          which the drafter never saw: tau falls to 1.2-1.5, so this measures the engines on near-AR rounds.

Interleaved per prompt: each pass runs every row; inside a row, each prompt runs on every engine back to
back, the engine order rotating per prompt, so slow drift of a shared machine hits all engines alike.
tok/s = new tokens / wall seconds of the generate calls. ratio = native / peer, the median over passes of
the per-pass ratio, with its min-max spread. Stage columns: native / upstream ms per round for the drafter
forward (draft; theirs leaves out each generation's first drafter call, the one over the whole prompt, so
theirs reads low), tree building (tree), the target forward (verify) and the walk + cache commit (commit);
overhead = the share of the native decode time (wall minus the prefills) spent outside the drafter and target
forwards, and in brackets the same share of the rounds alone (without each generation's setup: its fresh caches and
result; the native engine is one `ddtree.Engine` per row, as `ddtree.run` keeps one per job, so the checks, the
proposer and the target's binding are built once, in the warm-up); ceiling = the authors' wall time over our target-forward time (prefills + verifications): the
native/upstream ratio we would reach if everything else of ours (drafter, tree, walk, commit, loop) took no
time at all, since both engines run the same target code. Writes docs/bench/bench_engines.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import (
    TRAINED,
    Pair,
    Record,
    Spread,
    add_json_arg,
    device_sync,
    load_pair,
    machine,
    params,
    random_pair,
)

import ddtree
from ddtree.docs import render_table
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.host import tune_host_allocator

ENGINES = ("native", "upstream", "transformers")
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class Cell:
    """One engine on one row, summed over the prompts of one pass."""

    wall_s: float = 0.0
    ttft_s: float = 0.0  # the prefills (and first tokens) inside wall_s
    decode_s: float = 0.0  # the rounds inside wall_s (after the prefills; without each generation's setup)
    tokens: int = 0
    rounds: int = 0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def hf_assistant(drafter: DFlashDrafter) -> torch.nn.Module:
    """transformers' DFlash drafter (MuseGlimmerAssistantModel) holding `drafter`'s tensors."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    c = drafter.config
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings, layer_types=list(c.layer_types),
        sliding_window=c.sliding_window or c.max_position_embeddings, hidden_act=c.hidden_act,
        block_size=c.block_size, mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = drafter.attn_implementation
    with torch.device(drafter.device):
        model = MuseGlimmerAssistantModel(cfg).to(drafter.dtype)
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({names.get(k, k): v for k, v in drafter.state_dict().items()}, strict=True, assign=True)
    return model.eval()


class Runner:
    """One generate call per engine, timed the same way (wall clock around the call, device synced)."""

    def __init__(self, pair: Pair, upstream, new: int, stops: list[int], mtp=None, mtp_steps: int = 3,
                 mtp_topk: int = 4):
        self.pair, self.upstream, self.new, self.stops = pair, upstream, new, stops
        self.mtp, self.mtp_steps, self.mtp_topk = mtp, mtp_steps, mtp_topk  # the target's own MTP head, if any
        if not stops:  # no-stop: transformers' generate must not fall back to the checkpoint's eos either
            pair.target.generation_config.eos_token_id = None
        self.assistant = None if pair.hybrid else hf_assistant(pair.drafter)
        self.sync = device_sync(pair.prompts[0].device)
        self.engines: dict[tuple, ddtree.Engine] = {}

    def available(self, engine: str, method: str) -> bool:
        if method == "mtp":  # only the native engine runs the target's own MTP head
            return engine == "native" and self.mtp is not None
        if engine == "upstream":
            return self.upstream is not None
        if engine == "transformers":
            return not self.pair.hybrid and method in ("ar", "dflash")
        return True

    def one(self, engine: str, method: str, budget: int | None, ids: torch.Tensor, cell: Cell) -> None:
        p = self.pair
        self.sync()
        t0 = time.perf_counter()
        if engine == "transformers":
            kw = dict(assistant_model=self.assistant, speculation_type="dflash") if method == "dflash" else {}
            out = p.target.generate(ids, max_new_tokens=self.new, do_sample=False, eos_token_id=self.stops or None,
                                    **kw)
            self.sync()
            cell.wall_s += time.perf_counter() - t0
            toks = out[0, ids.shape[1]:].tolist()
            cell.tokens += len(toks)
            cell.outputs.append(toks)
            return
        if engine == "native":  # one ddtree.Engine per row, as ddtree.run keeps one per job (built in the warm-up)
            if (method, budget) not in self.engines and method == "mtp":  # budget None: the chain, else a tree
                self.engines[(method, budget)] = ddtree.Engine(
                    p.target, self.mtp, method=method, budget=budget, steps=self.mtp_steps,
                    topk=1 if budget is None else self.mtp_topk)
            if (method, budget) not in self.engines:
                self.engines[(method, budget)] = ddtree.Engine(p.target, p.drafter, method=method, budget=budget)
            r = self.engines[(method, budget)].generate(ids, max_new_tokens=self.new, stop_token_ids=self.stops)
        else:
            from ddtree.upstream.engine import generate_upstream

            r = generate_upstream(self.upstream, p.target, p.drafter, ids, method=method, budget=budget,
                                  max_new_tokens=self.new, stop_token_ids=self.stops)
        self.sync()
        cell.wall_s += time.perf_counter() - t0
        cell.tokens += r.num_new_tokens
        cell.ttft_s += r.ttft_s
        cell.decode_s += r.decode_s
        cell.rounds += sum(1 for n in r.acceptance_lengths if n)  # upstream's last round may keep 0 tokens
        for k in STAGES:
            cell.stage_s[k] += r.stage_seconds.get(k, 0.0)
        cell.outputs.append(list(r.output_ids))


def load_upstream(path: str | None):
    if not path:
        print("# upstream: skipped — pass --upstream PATH or set DDTREE_UPSTREAM to a checkout of "
              "https://github.com/liranringel/ddtree (their code is never committed here)")
        return None
    from ddtree.errors import ConfigError
    from ddtree.upstream.engine import load_upstream_engine

    try:
        return load_upstream_engine(path)
    except ConfigError as e:
        print(f"# upstream: skipped — {e}")
        return None


def median_ratio(a: list[Cell], b: list[Cell]) -> dict | None:
    ratios = [x.tok_s / y.tok_s for x, y in zip(a, b, strict=True) if y.tok_s]
    return Spread.of(ratios).cell(2) if ratios else None


def tau(cells: list[Cell], n_prompts: int) -> float | None:
    c = cells[0]
    return round((c.tokens - n_prompts) / c.rounds, 2) if c.rounds else None  # the prefill's token is not a round


def stage_ratio(nat: list[Cell], up: list[Cell], stage: str) -> str | None:
    def per_round(cells: list[Cell]) -> float:
        return statistics.median(c.stage_s[stage] / max(1, c.rounds) for c in cells)

    a, b = per_round(nat), per_round(up)
    return f"{1e3 * a:.2f}/{1e3 * b:.2f}" if a or b else None


def ceiling(nat: list[Cell], up: list[Cell]) -> float | None:
    """The native/upstream ratio if everything of ours but the target's forwards took no time: the
    authors' wall over our prefill + verification time (both engines run the same target code)."""
    bounds = [u.wall_s / (n.ttft_s + n.stage_s["verify"]) for n, u in zip(nat, up, strict=True)
              if n.ttft_s + n.stage_s["verify"] > 0]
    return round(statistics.median(bounds), 2) if bounds else None


def overhead_share(nat: list[Cell]) -> str | None:
    """The share outside the forwards of the decode time with each generation's setup, and (in brackets) of the
    rounds alone."""
    cells = [c for c in nat if c.wall_s > c.ttft_s and c.decode_s > 0]
    if not cells:
        return None
    forwards = [c.stage_s["draft"] + c.stage_s["verify"] for c in cells]
    whole = statistics.median((c.wall_s - c.ttft_s - f) / (c.wall_s - c.ttft_s) for c, f in zip(cells, forwards, strict=True))
    rounds = statistics.median((c.decode_s - f) / c.decode_s for c, f in zip(cells, forwards, strict=True))
    return f"{100 * whole:.1f}% ({100 * rounds:.1f}%)"


def run_pair(pair: Pair, upstream, args) -> dict:
    """Every row on every engine that runs, interleaved; the table as a record's table (see _common)."""
    mtp = mtp_head(pair)
    rows = rows_of(args, mtp is not None)
    stops = [] if args.no_stop else pair.stops
    runner = Runner(pair, upstream, args.new, stops, mtp, args.mtp_steps, args.mtp_topk)
    engines = [e for e in ENGINES if e == "native" or (e == "upstream" and upstream is not None)
               or (e == "transformers" and not pair.hybrid)]
    if pair.hybrid:
        print(f"# transformers: skipped on {pair.name} — its DFlash refuses stateful (hybrid) targets")
    for method, budget in rows:  # warm-up: one prompt per engine and row
        for e in engines:
            if runner.available(e, method):
                runner.one(e, method, budget, pair.prompts[0], Cell())
    cells: dict[tuple, list[Cell]] = {}
    for p in range(args.passes):
        for method, budget in rows:
            here = [e for e in engines if runner.available(e, method)]
            row = {e: Cell() for e in here}
            for i, ids in enumerate(pair.prompts):
                shift = (p + i) % len(here)
                for e in here[shift:] + here[:shift]:
                    runner.one(e, method, budget, ids, row[e])
            for e, cell in row.items():
                cells.setdefault((method, budget, e), []).append(cell)
        print(f"# {pair.name}: pass {p + 1}/{args.passes} done", file=sys.stderr)
    workload = (f"up to {args.new} new tokens each, stopping at the answer's end" if stops
                else f"{args.new} new tokens each (no stop)")

    head = ["method", "budget"] + [f"{e} tok/s" for e in engines]
    head += [f"native/{e}" for e in engines if e != "native"]
    head += ["tau native", "tau upstream"] if upstream is not None else ["tau native"]
    head += ["same output"]
    if upstream is not None:
        head += [f"{s} ms nat/up" for s in STAGES]
    head += ["overhead"]
    if upstream is not None:
        head += ["ceiling"]
    table = []
    for method, budget in rows:
        nat = cells[(method, budget, "native")]
        label = (f"mtp {args.mtp_steps}" + ("" if budget is None else f"x{args.mtp_topk}")) if method == "mtp" else method
        row = [label, budget]
        for e in engines:
            c = cells.get((method, budget, e))
            row.append(round(statistics.median(x.tok_s for x in c), 1) if c else None)
        for e in engines[1:]:
            c = cells.get((method, budget, e))
            row.append(median_ratio(nat, c) if c else None)
        row.append(tau(nat, len(pair.prompts)))
        up = cells.get((method, budget, "upstream"))
        if upstream is not None:
            row.append(tau(up, len(pair.prompts)) if up else None)
        same = []
        for e in engines[1:]:
            c = cells.get((method, budget, e))
            if c:
                same.append(f"{e[:2]} {sum(a == b for a, b in zip(nat[0].outputs, c[0].outputs, strict=True))}/{len(pair.prompts)}")
        if method == "mtp":  # no peer runs it: its outputs against the native AR row's
            ar = cells[("ar", None, "native")][0].outputs
            same.append(f"ar {sum(a == b for a, b in zip(nat[0].outputs, ar, strict=True))}/{len(pair.prompts)}")
        row.append(", ".join(same) or None)
        if upstream is not None:
            row += [stage_ratio(nat, up, s) for s in STAGES] if up else [None] * len(STAGES)
        row.append(overhead_share(nat) if method != "ar" else None)
        if upstream is not None:
            row.append(ceiling(nat, up) if up else None)
        table.append(row)
    formats = {c: "{:.1f}" for c in head if c.endswith("tok/s")} | {c: "{:.2f}x" for c in head if c.startswith("native/")}
    formats |= {"tau native": "{:.2f}", "tau upstream": "{:.2f}", "ceiling": "{:.2f}x"}
    return {"title": f"{pair.name}: {len(pair.prompts)} prompts, {workload}, median of {args.passes} interleaved passes",
            "columns": head, "rows": table, "formats": formats}


def rows_of(args, mtp: bool = False) -> list[tuple[str, int | None]]:
    rows = [("ar", None), ("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",") if b]
    if mtp:  # the target's own MTP head: a chain, and EAGLE-style trees of these budgets
        rows += [("mtp", None)] + [("mtp", int(b)) for b in args.mtp_budgets.split(",") if b]
    return rows


def mtp_head(pair: Pair):
    """The MTP head stored with the pair's target (the checkpoint it was loaded from), or None."""
    from ddtree.engine.drafter import MTPHead
    from ddtree.errors import ConfigError

    try:
        return MTPHead.from_target(pair.target)
    except ConfigError as e:
        print(f"# {pair.name}: no MTP rows — {e}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upstream", default=os.environ.get("DDTREE_UPSTREAM"))
    ap.add_argument("--pairs", default="toy,toy_pure")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--pure-prompts", type=int, default=4)
    ap.add_argument("--no-stop", action="store_true", help="exactly --new tokens per prompt (no stop token)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--mtp-steps", type=int, default=3, help="method=mtp rows: draft steps a round")
    ap.add_argument("--mtp-topk", type=int, default=4, help="method=mtp tree rows: children per expanded node")
    ap.add_argument("--mtp-budgets", default="16", help="method=mtp tree rows (the chain row always runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: as torch chose)")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    add_json_arg(ap, "bench_engines")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    upstream = load_upstream(args.upstream)
    # process-wide: set before any engine runs, so every engine and row runs under the same allocator
    alloc = tune_host_allocator() if args.device == "cpu" else "untouched (not a CPU run)"
    lines = [f"## Engines side by side ({args.device}, {args.dtype})", "", f"Machine: {machine()}",
             f"Host allocator (every engine): {alloc}",
             f"Command: `{' '.join(['python', *sys.argv])}`"]
    rec = Record("bench_engines", f"Engines side by side ({args.device}, {args.dtype})",
                 "The native engine against the DDTree authors' code (upstream) and transformers' own DFlash and "
                 "generate, interleaved per prompt in one process, greedy. native/peer = the median of the per-pass "
                 "tok/s ratios (min-max in brackets); stage columns: native/upstream ms per round; overhead = the "
                 "share of the native decode time outside the drafter and target forwards, with each generation's "
                 "setup (of the rounds alone in brackets); ceiling = the authors' wall time over our target-forward "
                 "time.", params=params(args, upstream=args.upstream is not None, host_allocator=str(alloc)))
    for name in args.pairs.split(","):
        dev = args.device
        pair = (load_pair(name, args.prompts, device=dev, dtype=dtype) if name in TRAINED
                else random_pair(args.pure_prompts, device=dev, dtype=dtype))
        if pair is None:
            print(f"# {name}: skipped — assets/{name} is missing (make {name.replace('_', '-')})")
            continue
        table = run_pair(pair, upstream, args)
        rec.tables.append(table)
        lines += [f"\n### {table['title']}\n", render_table(table)]
        text = "\n".join(lines) + "\n"
        print("\n" + text, flush=True)  # after each pair: a later pair's failure keeps this one's table
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
        rec.write(args.json)


if __name__ == "__main__":
    main()
