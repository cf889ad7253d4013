"""What a decoding round asks of a GPU: aten ops per stage, host syncs, compiled-graph calls, and a predicted
H200 round time from a stated cost model, for a target structure given by a hub-style config.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_launches.py [--structures qwen3_6_27b,qwen3_8b]
        [--methods ar,dflash,ddtree:16,ddtree:64,ddtree:256] [--rounds 6] [--path device|host]
        [--contexts 1024,4096,16384] [--drafter-contexts 1024,4096,16384] [--out docs/bench/bench_launches.json]
        [--compile [--compile-backend eager]]   # the compiled round: ops outside its graphs, graph calls
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_launches.py --tp 2 [--structures qwen3_6_27b]
        [--methods ar,dflash,ddtree:64] [--tp-gpus 2,4]  # tensor parallel: per-rank ops and collectives, TP1 vs TP2

Each structure (bench/configs/<name>.json: the real layer count and layer types) is built at tiny width (hidden 64)
with a random 5-layer DFlash drafter reading target layers 1/16/31/46/61 (evenly spaced on a shallower target),
block 16, bf16, sdpa; `dflash2`, `dflash2_marginal:B`, `dflash2_pair:B` (not in the default --methods): a random
DFlash2 drafter of the same dims (ddtree.engine.drafter.dflash2: rank-16 top-8 selector), its chain and DDTree under
each scoring. Per method, a warm-up generation, then two greedy generations of the same prompt, one
--rounds rounds longer than the other, under `ddtree.testing.dispatch.DispatchCount`: their difference divided by
the extra rounds is one steady-state round (the prefill and the first rounds cancel out). --path device (default)
runs a CPU on the branches a CUDA run takes (`ddtree.engine.host.device_path`); --path host keeps the CPU-only ones.

Columns: ops dispatched per round by stage (draft, tree, verify, commit, other = the loop between stages), of which
`kernel` launch a kernel (views and allocations do not), host syncs (device->host reads: see dispatch.py), compiled
graph calls (--compile: the compiled round's verify and commit, ddtree.engine.compiled; counted by DispatchCount and,
with --profile or on CUDA, torch.profiler's "Torch-Compiled Region" events), and on CUDA
the real kernel launches (torch.profiler: cudaLaunchKernel and friends, memcpy/memset included).

Cost model (H200, bf16, batch 1; every constant a flag):
  device  = max(bytes / 4.8 TB/s, FLOPs / (989 TFLOP/s x 0.7))
            bytes: the REAL model's weights read once a round (target without its embedding table, the drafter's
            layers and fc, the lm_head a second time for the drafter's block), the target's KV rows (attention
            layers) and GDN states (fp32, read and written), the drafter's KV (a sliding layer: its window only);
            FLOPs: 2 x parameters x tokens (the verified tree's nodes, the drafter's block)
  host    = kernel ops x 6 us + other ops x 1 us (launch and dispatch from Python, no graphs)
            + compiled-graph calls x 30 us (--compile: a CUDA graph replay and its guards; its kernels then cost the
            host nothing, and the device side inside a graph is taken as the bandwidth/FLOP bound above)
  round   = max(device, host) + syncs x 20 us (the queue drains at each host read; host and device overlap else)
  MTP rows (mtp: 3 steps; mtp_tree: 3 steps, top-4, budget 16) count a random head's ops; their bytes leave
            the head out (one decoder layer and its fc: about 1/64 of the 27B target's weights).
  tok/s   = tau / round, with tau the toy pair's (README: AR 1, DFlash 5.70, DDTree 6.29 / 7.51 at 16 / 64;
            7.6 assumed at 256; the toy MTP head 2.96 / 3.35); `ceiling` is the bandwidth bound, bytes / 4.8 TB/s.
Context growth: the round at 1k / 4k / 16k context (KV bytes grow; ops and syncs are measured once, at --prompt,
and checked to be independent of the context with --check-context), and the drafter's forward timed on this CPU
at those contexts, with sliding-window layers (4 sliding at window 2048 + 1 full) against all-full layers.

Tensor parallel (--tp N; the script starts itself under `torch.distributed.run --nproc_per_node=N`, gloo on a CPU,
NCCL on GPUs): each rank builds the same structure, rank 0 counts it whole (TP 1), then every rank loads it sharded
over the N ranks (transformers' tp_plan, as `model.tp_plan=auto` does: ddtree.pipeline.models.sharded_copy) and
counts its own round; collectives (all-reduces, all-gathers) are counted apart from the ops. Its record
(docs/bench/bench_launches_tp.json) adds the cost model's round for the real model over --tp-gpus H100s (bf16,
--tp-bandwidth a GPU), tensor parallel against a device map:
  TP n        device = (target weights / n + attention KV / n + GDN states + drafter) / bandwidth
                       + collectives x --collective-us (a small NCCL all-reduce or all-gather over NVLink: the
                       GPUs wait for each other once per sharded row-wise projection, GDN projection and head)
              host   = this rank's ops (the counts at --tp, the same per rank for any n: one collective a projection)
  device map  device = every byte / bandwidth (the layers run one GPU after another) + (n - 1) x --hop-us
              host   = TP 1's ops (one process drives every GPU)
  round = max(device, host) + syncs x --sync-us; tok/s = tau / round (the toy pair's tau, as above).

Results go to --out as JSON (command, commit, machine, date, results) and to stdout as a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import Record, params
from _costmodel import H200, predict, real_config, real_dims

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: import ddtree from DIR (an export of an older commit, e.g. `git archive main ddtree | tar -x -C DIR`)
CODE = next((sys.argv[i + 1] for i, v in enumerate(sys.argv[:-1]) if v == "--code"), None)
sys.path.insert(0, str(Path(CODE).resolve() if CODE else ROOT))
if CODE:  # _common imported this checkout's ddtree already: forget it, so the import below reads DIR's
    for _name in [m for m in sys.modules if m == "ddtree" or m.startswith("ddtree.")]:
        del sys.modules[_name]

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import ddtree  # noqa: E402

try:
    from ddtree.engine import batch  # noqa: E402
except ImportError:  # code from before the batched round (--code): --concurrency cannot count it
    batch = None
from ddtree.engine.drafter import DFlashDrafter  # noqa: E402
from ddtree.engine.drafter.config import evenly_spaced_layer_ids  # noqa: E402
from ddtree.engine.families import model_type  # noqa: E402
from ddtree.engine.methods import supports  # noqa: E402

try:
    from ddtree.engine.host import device_path  # noqa: E402
except ImportError:  # code from before the switch (--code): its CPU-only branches patched to a CUDA run's choices
    device_path = None
from ddtree.testing.dispatch import DispatchCount  # noqa: E402
from ddtree.tiny import slow_decay_  # noqa: E402

STAGES = ("draft", "tree", "verify", "commit", "other")
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            vocab_size=512)
DRAFTER_IDS = {64: [1, 16, 31, 46, 61]}  # Qwen3.6-27B's public DFlash drafter
TAU = {"ar": 1.0, "dflash": 5.70, "ddtree:16": 6.29, "ddtree:64": 7.51, "ddtree:256": 7.6, "mtp": 2.96,
       "mtp_tree:16": 3.35}
MTP = {"mtp": dict(steps=3, topk=1), "mtp_tree": dict(steps=3, topk=4)}  # method=mtp: a chain, an EAGLE-style tree
# a random DFlash2 drafter of the DFlash one's dims (conv taps 4, groups of hidden / 8, selector rank 16, top-8): its
# chain (method=dflash) and DDTree under each scoring; tau the toy DFlash2 drafter's (docs/dflash2.md)
DFLASH2 = {"dflash2": ("dflash", None), "dflash2_marginal": ("ddtree", "marginal"), "dflash2_pair": ("ddtree", "pair")}
TAU.update({"dflash2": 7.00, "dflash2_marginal:16": 7.70, "dflash2_marginal:32": 8.56, "dflash2_pair:16": 7.90,
            "dflash2_pair:32": 8.56})
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")


def tiny_of(real) -> object:
    kw = real.to_dict()
    for k in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        kw.pop(k, None)
    kw.update({k: v for k, v in TINY.items() if k in kw or not k.startswith("linear_")})
    return AutoConfig.for_model(real.model_type, **kw)


# ----- the cost model: bench/_costmodel.py (real_dims, predict; the H200's constants are the flags' defaults) ------

@contextlib.contextmanager
def legacy_device_path():
    """For --code older than ddtree.engine.host.device_path: the decision points it had, set as a CUDA run sets
    them (the device tree build and walk, split attention, no lazy head, the upstream GDN step, unfused norms).
    A chain's walk on host lists stays (no switch there): a few ops of the commit stage."""
    import functools

    from ddtree.engine import forward, gdn, proposers, target, tree

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    init = target.TargetBinding.__init__

    def binding_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.dense_auto = False

    norm = forward.lean_norm
    patch(proposers, "best_first_tree", functools.partial(tree.best_first_tree, host=False))
    patch(target.TargetBinding, "__init__", binding_init)
    patch(target.TargetSession, "lazy_head", lambda self, t: False)
    patch(gdn, "_step_forward", lambda *args, **kwargs: None)
    patch(forward, "lean_norm", lambda module, fused=False: norm(module, False))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# ----- counting -------------------------------------------------------------------------------------------------

def _method(spec: str) -> tuple[str, int | None]:
    name, _, budget = spec.partition(":")
    return name, int(budget) if budget else None


def _compiled_and_launches(engine, ids, short: int, long: int, rounds: int) -> tuple[float | None, float | None]:
    """(compiled-graph calls, CUDA kernel launches) per round from torch.profiler, the same two generations."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    counts = []
    for new in (short, long):
        with profile(activities=acts) as prof:
            engine.generate(ids, max_new_tokens=new)
        names = [e.name for e in prof.events()]
        counts.append((sum(n.startswith("Torch-Compiled Region") for n in names),
                       sum(n in LAUNCH_NAMES for n in names)))
    graphs = (counts[1][0] - counts[0][0]) / rounds
    launches = (counts[1][1] - counts[0][1]) / rounds if ids.device.type == "cuda" else None
    return graphs, launches


def _names(counter) -> collections.Counter:
    return collections.Counter(getattr(counter, "collective_names", {}))


def count_method(target, drafter, spec: str, ids: torch.Tensor, a) -> dict:
    method, budget = _method(spec)
    path = contextlib.nullcontext()
    if a.path == "device":
        path = device_path() if device_path is not None else legacy_device_path()
    kw = dict(compile="true", compile_backend=a.compile_backend) if a.compile else {}
    with path:
        if method in MTP:  # the target's own MTP head (random, at the structure's tiny width)
            from ddtree.engine.drafter.mtp import MTPHead

            head = MTPHead.random_for_target(target, seed=0).to(device=ids.device, dtype=target.dtype)
            engine = ddtree.Engine(target, head, method="mtp", budget=budget, **MTP[method], **kw)
        elif method in DFLASH2:
            base, scoring = DFLASH2[method]
            engine = ddtree.Engine(target, dflash2_like(target, drafter), method=base, budget=budget, scoring=scoring, **kw)
        else:
            engine = ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget, **kw)
        if hasattr(engine, "kernel_checks"):  # what its fused ops' checks find (each engine its own)
            KERNEL_CHECKS.append(engine.kernel_checks)
        engine.generate(ids, max_new_tokens=4)  # warm-up: lazy buffers, the allocator, kernel choices
        short = engine.generate(ids, max_new_tokens=a.warm_tokens)
        runs, outs = [], []
        for new in (a.warm_tokens, None):
            if new is None:  # as many tokens as it takes for --rounds more rounds (acceptance is deterministic)
                new = a.warm_tokens + a.rounds * max(1, round(short.tau))
            with DispatchCount(layers=True) as c:
                res = engine.generate(ids, max_new_tokens=new)
            runs.append(c)
            outs.append(res)
        rounds = outs[1].rounds - outs[0].rounds
        if rounds <= 0:
            raise RuntimeError(f"{spec}: no extra rounds ({outs[0].rounds} vs {outs[1].rounds})")
        per = {}
        for key in ("ops", "kernel_ops", "syncs", "graphs", "collectives"):
            long_c, short_c = getattr(runs[1], key, None), getattr(runs[0], key, None)
            if long_c is None:  # --code: a DispatchCount from before collectives were counted
                long_c = short_c = {}
            per[key] = {s: (long_c.get(s, 0) - short_c.get(s, 0)) / rounds for s in STAGES}
        # the verification's ops by where they run: per decoder layer of each kind (lean layers), and outside them
        layers = {}
        for kind in ("linear_attention", "full_attention", "outside"):
            ops = runs[1].layer_ops[("verify", kind)] - runs[0].layer_ops[("verify", kind)]
            calls = runs[1].layer_calls[("verify", kind)] - runs[0].layer_calls[("verify", kind)]
            if kind == "outside":
                layers[kind] = ops / rounds
            elif calls:
                layers[kind] = ops / calls
        graphs, launches = (sum(per["graphs"].values()), None)  # the compiled round's calls (DispatchCount)
        if a.profile or ids.device.type == "cuda":
            profiled, launches = _compiled_and_launches(engine, ids, a.warm_tokens, new, rounds)
            graphs = max(graphs, profiled)
        t = time.perf_counter()
        timed = engine.generate(ids, max_new_tokens=new)
        wall = (time.perf_counter() - t) / max(1, timed.rounds)
    method = DFLASH2.get(method, (method,))[0]
    nodes = 1 if method == "ar" else (budget + 1 if method == "ddtree" else drafter.block_size)
    if method in MTP:  # the verified chain (steps + 1) or tree (the budget's nodes + 1), not the drafter's block
        nodes = engine.proposer.max_nodes
    return dict(method=spec, rounds=rounds, ops=per["ops"], kernel_ops=per["kernel_ops"], syncs=per["syncs"],
                total_ops=sum(per["ops"].values()), total_kernel_ops=sum(per["kernel_ops"].values()),
                total_syncs=sum(per["syncs"].values()), collectives=per["collectives"],
                total_collectives=sum(per["collectives"].values()),
                collective_names=dict(_names(runs[1]) - _names(runs[0])),
                graph_calls=graphs, cuda_launches=launches, nodes=nodes,
                verify_per_layer=layers,
                host_ms_per_round_here=1e3 * wall,
                sync_names=dict(runs[1].sync_names - runs[0].sync_names))


def count_batched(target, drafter, spec: str, ids: torch.Tensor, streams: int, a) -> dict:
    """One steady-state round of the batched round (Engine.generate_many, ddtree.engine.batch) at `streams` streams:
    `streams` copies of the prompt in as many slots (every stream accepts the same tokens, so all of them run every
    round), two generations --rounds rounds apart, their difference over the extra rounds, as count_method."""
    method, budget = _method(spec)
    path = contextlib.nullcontext()
    if a.path == "device":
        path = device_path() if device_path is not None else legacy_device_path()
    prompts = [ids] * streams
    with path:
        engine = ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget,
                               compile="false")
        # the batched round itself (generate_many runs the one-stream round at one slot and T = 0)
        def many(p, new):
            return batch.generate_many(engine, p, len(p), 0.0, new, None, 0, budget)

        many(prompts, 4)  # warm-up (constants cached per shape)
        short = many(prompts, a.warm_tokens)[0]
        runs, outs = [], []
        for new in (a.warm_tokens, a.warm_tokens + a.rounds * max(1, round(short.tau))):
            with DispatchCount() as c:
                res = many(prompts, new)
            if any(r.rounds != res[0].rounds for r in res):
                raise RuntimeError(f"{spec} at {streams} streams: the copies ran different rounds")
            runs.append(c)
            outs.append(res[0])
    rounds = outs[1].rounds - outs[0].rounds
    if rounds <= 0:
        raise RuntimeError(f"{spec} at {streams} streams: no extra rounds ({outs[0].rounds} vs {outs[1].rounds})")
    per = {key: {s: (getattr(runs[1], key).get(s, 0) - getattr(runs[0], key).get(s, 0)) / rounds for s in STAGES}
           for key in ("ops", "kernel_ops", "syncs", "graphs")}
    nodes = 1 if method == "ar" else (budget + 1 if method == "ddtree" else drafter.block_size)
    return dict(method=spec, streams=streams, rounds=rounds, ops=per["ops"], kernel_ops=per["kernel_ops"],
                syncs=per["syncs"], total_ops=sum(per["ops"].values()), total_kernel_ops=sum(per["kernel_ops"].values()),
                total_syncs=sum(per["syncs"].values()), graph_calls=sum(per["graphs"].values()), nodes=nodes,
                sync_names=dict(runs[1].sync_names - runs[0].sync_names))


def concurrency_main(a) -> None:
    """--concurrency N,...: the batched round's ops, kernel ops, host reads and graph calls per round at each N
    (module docstring), for each structure and method; the single-stream engine's (Engine.generate) beside them."""
    record: dict[str, list[dict]] = {}
    notes: dict[str, str] = {}
    for name in a.structures.split(","):
        label = name
        _, target, drafter = build(name, a)
        ids = torch.randint(0, 500, (1, a.prompt), generator=torch.Generator().manual_seed(5)).to(a.device)
        rows = []
        for spec in a.methods.split(","):
            single = count_method(target, drafter, spec, ids, a) if a.single else None
            for n in a.concurrency:
                t0 = time.perf_counter()
                r = count_batched(target, drafter, spec, ids, n, a)
                r["single_stream_ops"] = None if single is None else single["total_ops"]
                r["single_stream_syncs"] = None if single is None else single["total_syncs"]
                rows.append(r)
                print(f"  {label} {spec} at {n} streams: {r['total_ops']:.0f} ops/round ({r['total_kernel_ops']:.0f} "
                      f"kernel; " + ", ".join(f"{s} {r['ops'][s]:.0f}" for s in STAGES) + f"), "
                      f"{r['total_syncs']:.1f} host reads ({r['sync_names']}), {time.perf_counter() - t0:.0f} s",
                      flush=True)
        record[label] = rows
        del target, drafter
    base = {(label, r["method"]): r for label, rows in record.items() for r in rows if r["streams"] == a.concurrency[0]}
    rec = Record("bench_launches_concurrency",
                 "The batched round (Engine.generate_many): ops, host reads and graphs per round at N streams",
                 "Per steady-state round of the batched round (ddtree.engine.batch), counted on this machine at tiny "
                 f"width with the real layer structure; {a.path} path, {a.dtype}, eager (the batched round is not "
                 "compiled). N copies of one prompt decode in N slots, so every stream runs every round. `x N=1`: "
                 f"the round's ops over those at {a.concurrency[0]} stream(s); single-stream engine: Engine.generate's "
                 "round (the lean forward) on the same models. Counts, not timings: the machine's load does not move "
                 "them. " + " ".join(f"{k}: {v}." for k, v in notes.items()),
                 params=params(argparse.Namespace(**{k: v for k, v in vars(a).items()
                                                     if k not in ("torch_dtype", "out")})))
    for label, rows in record.items():
        rec.table(f"{label}: per round at N streams",
                  ["method", "N", *STAGES, "ops", "kernel ops", "x N=1", "host reads", "graphs",
                   "single-stream engine ops", "single-stream engine host reads"],
                  [[r["method"], r["streams"], *(round(r["ops"][s]) for s in STAGES), round(r["total_ops"]),
                    round(r["total_kernel_ops"]), round(r["total_ops"] / base[label, r["method"]]["total_ops"], 2),
                    round(r["total_syncs"], 1), round(r["graph_calls"]),
                    None if r["single_stream_ops"] is None else round(r["single_stream_ops"]),
                    None if r["single_stream_syncs"] is None else round(r["single_stream_syncs"], 1)] for r in rows],
                  formats={"x N=1": "{:.2f}x"})
    out = rec.as_dict()
    out["counts"] = {label: [{k: v for k, v in r.items()} for r in rows] for label, rows in record.items()}
    out["dims"] = {name: real_dims(name) for name in a.structures.split(",")}  # the real sizes the cost model reads
    if a.out != "-":
        Path(a.out).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(f"# record: {a.out}")


def build(name: str, a, config=None):
    real = real_config(name)
    cfg = tiny_of(config if config is not None else real)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=a.torch_dtype).eval()
    slow_decay_(target)
    target.to(a.device)
    n = cfg.num_hidden_layers
    ids = DRAFTER_IDS.get(n, evenly_spaced_layer_ids(n, 5))
    drafter = DFlashDrafter.random_for_target(cfg, num_layers=5, block_size=16, target_layer_ids=ids, seed=1)
    drafter.to(a.device, a.torch_dtype)
    return real, target, drafter


def dflash2_like(target, drafter):
    """A random DFlash2 drafter for `target` with `drafter`'s layers, target layers and block (built once)."""
    from ddtree.engine.drafter.dflash2 import DFlash2Drafter

    if getattr(drafter, "_dflash2", None) is None:
        c = drafter.config
        twin = DFlash2Drafter.random_for_target(target.config, num_layers=c.num_hidden_layers,
                                                block_size=c.block_size, target_layer_ids=list(drafter.target_layer_ids),
                                                seed=1)
        drafter._dflash2 = twin.to(drafter.device, drafter.dtype)
    return drafter._dflash2


# ----- bytes per compiled round ---------------------------------------------------------------------------------

def _empty_model(build_fn):
    """A model built on the meta device and given memory never written (`to_empty`): real dims at no RSS."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build_fn()
    finally:
        torch.set_default_dtype(default)
    for module in model.modules():  # RoPE modules that keep their frequencies through casts: real ones (tiny)
        for key, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                setattr(module, key, torch.ones(buf.shape, dtype=buf.dtype))
    return model.to_empty(device="cpu").eval()


def round_bytes(name: str, a) -> list[dict]:
    """Bytes a compiled DDTree-`a.bytes_budget` round's generated code reads and writes, by stage, at the real dims:
    Inductor's own count per fused kernel (ddtree.testing.inductor_plan: the plan of each graph, its kernels not
    built, on memory never written). The target's graphs are planned at one period of the layer pattern (Qwen3.6:
    3 GDN + 1 attention) and at two; the real depth is then exact from their difference,
    b(P) + (L / P - 1) (b(2P) - b(P)). Next to it the floor: the weights read once (the target without its
    embedding table, the drafter's layers and fc, the lm_head again for the drafter's block), the KV rows of the
    context read once (target and drafter), the GDN states read and written, the round's logits written (and the
    drafter's read by the tree build)."""
    from ddtree.engine import host
    from ddtree.engine.compiled import capacity_bucket
    from ddtree.testing.inductor_plan import round_plans

    real = real_config(name)
    types = list(getattr(real, "layer_types", None) or ["full_attention"] * real.num_hidden_layers)
    period = next((p for p in range(1, len(types) + 1) if len(types) % p == 0
                   and types == types[:p] * (len(types) // p)), len(types))
    dims = real_dims(name)
    budget, block = a.bytes_budget, 16
    n = budget + 1
    rows: list[dict] = []
    measured: dict[tuple[int, int], dict[str, int]] = {}
    for layers in (period, 2 * period):
        kw = real.to_dict()
        for k in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
            kw.pop(k, None)
        kw.update(num_hidden_layers=layers, layer_types=types[:layers])
        cfg = AutoConfig.for_model(real.model_type, **kw)
        target = _empty_model(lambda cfg=cfg: AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
        feature_ids = [min(i, layers - 1) for i in (1, 1, 2, 2, 3)]  # 5 features as the real drafter's (layers < 64)
        drafter = _empty_model(lambda cfg=cfg, ids=feature_ids: DFlashDrafter.random_for_target(
            cfg, num_layers=5, block_size=block, target_layer_ids=ids, seed=1))
        with host.device_path():
            engine = ddtree.Engine(target, drafter, method="ddtree", budget=budget, compile="true")
            for ctx in a.bytes_contexts:
                t0 = time.perf_counter()
                cap = capacity_bucket(ctx + a.bytes_new + n)
                plans = round_plans(engine, cap, capacity_bucket(ctx + a.bytes_new + n + 2 * block))
                measured[layers, ctx] = {stage: p.bytes for stage, p in plans.items()}
                print(f"  bytes: {layers} layers, context {ctx} (capacity {cap}): "
                      + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in measured[layers, ctx].items())
                      + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        del engine, target, drafter
    scale = len(types) // period - 1
    for ctx in a.bytes_contexts:
        one, two = measured[period, ctx], measured[2 * period, ctx]
        stages = {stage: one[stage] + (scale * (two[stage] - one[stage]) if stage in ("verify", "commit") else 0)
                  for stage in one}
        weights = 2 * (dims["params"] + dims["drafter"] + dims["head"])
        kv = ctx * (dims["attn_layers"] * dims["kv_row"] + 5 * dims["drafter_kv_row"])
        states = 2 * dims["gdn_layers"] * dims["gdn_state"]
        acts = n * real.vocab_size * 2 + 2 * (block - 1) * real.vocab_size * 4
        floor = weights + kv + states + acts
        total = sum(stages.values())
        rows.append(dict(context=ctx, capacity=capacity_bucket(ctx + a.bytes_new + n), stages=stages, total=total,
                         floor=floor, floor_parts=dict(weights=weights, kv=kv, gdn_states=states, activations=acts),
                         ratio=total / floor))
        print(f"  bytes per round at {ctx} context: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in stages.items())
              + f" = {total / 1e9:.2f} GB; floor {floor / 1e9:.2f} GB (weights {weights / 1e9:.2f}, KV {kv / 1e9:.2f},"
              f" GDN states {states / 1e9:.2f}, logits {acts / 1e9:.2f}): {total / floor:.3f}x", flush=True)
    return rows


# ----- the drafter at long context ------------------------------------------------------------------------------

def drafter_context(a) -> list[dict]:
    """The drafter's forward (block 16, a cache holding `context` rows) timed here: 4 sliding layers (window
    --drafter-window) + 1 full, against 5 full layers with the same weights."""
    cfg = tiny_of(real_config("qwen3_6_27b"))
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = (
        256, 512, 4, 2, 64)
    out = []
    kinds = {"sliding": ["sliding_attention"] * a.drafter_sliding + ["full_attention"] * (5 - a.drafter_sliding),
             "full": ["full_attention"] * 5}
    models = {}
    for kind, types in kinds.items():
        d = DFlashDrafter.random_for_target(cfg, num_layers=5, block_size=16, seed=2, layer_types=types,
                                            sliding_window=a.drafter_window if kind == "sliding" else None)
        models[kind] = d.eval()
    models["full"].load_state_dict(models["sliding"].state_dict())
    for d in models.values():
        d.to(a.device)
    cuda = a.device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    for ctx in a.drafter_contexts:
        feats = torch.randn(1, ctx, 5 * cfg.hidden_size, generator=g).to(a.device)
        noise = torch.randn(1, 16, cfg.hidden_size, generator=g).to(a.device)
        blk = torch.arange(ctx, ctx + 16, device=a.device)[None]
        row = {"context": ctx}
        caches = {}
        with torch.inference_mode():
            for kind, d in models.items():
                caches[kind] = d.new_cache(ctx + 16)
                d(noise, feats, torch.arange(ctx, device=a.device)[None], blk, caches[kind])
            times = {kind: [] for kind in models}
            for _ in range(a.drafter_repeats):  # interleaved: the machine's load hits both alike
                for kind, d in models.items():
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    d(noise, None, None, blk, caches[kind])
                    if cuda:
                        torch.cuda.synchronize()
                    times[kind].append(time.perf_counter() - t)
        for kind in models:
            row[f"{kind}_ms"] = 1e3 * statistics.median(times[kind])
        out.append(row)
        print(f"  drafter at context {ctx:>6}: sliding x{a.drafter_sliding} (window {a.drafter_window}) "
              f"{row['sliding_ms']:.2f} ms, all full {row['full_ms']:.2f} ms")
    return out


# ----- output ---------------------------------------------------------------------------------------------------

def table(structure: str, rows: list[dict]) -> str:
    head = ("| method | draft | tree | verify | commit | other | ops | kernel ops | syncs | graphs | CUDA launches "
            "| ceiling ms | predicted ms | predicted tok/s | ceiling tok/s |")
    lines = [f"### {structure}", "", head, "|" + " --- |" * 15]
    for r in rows:
        p = r["predicted"][str(r["context_for_table"])]
        cl = "–" if r["cuda_launches"] is None else f"{r['cuda_launches']:.0f}"
        lines.append(
            f"| {r['method']} | " + " | ".join(f"{r['ops'][s]:.0f}" for s in STAGES)
            + f" | {r['total_ops']:.0f} | {r['total_kernel_ops']:.0f} | {r['total_syncs']:.1f} | "
            f"{r['graph_calls']:.0f} | {cl} | {p['ceiling_ms']:.1f} | {p['round_ms']:.1f} | "
            f"{p['tok_s']:.0f} | {p['ceiling_tok_s']:.0f} |")
    return "\n".join(lines)


KERNEL_CHECKS: list = []  # the counted engines' fused-op checks (ddtree.engine.kernels.KernelChecks: one an engine)


def fused_ops_seen() -> list[list[str]]:
    """[op, the implementation it ran (Triton after its first-call check, or the composite), timings] for each fused
    op a CUDA run called, over every counted engine (composite where any engine fell back); [] on the CPU (where
    every fused op is its composite)."""
    from ddtree.engine.kernels import FusedOp

    rows = []
    for name in sorted(FusedOp.registry):
        states = {c.state[name] for c in KERNEL_CHECKS if name in c.state}
        if not states:
            continue
        timings = {key: t for c in KERNEL_CHECKS for key, t in c.timings.get(name, {}).items()}
        timed = ", ".join(f"{[list(k) for k in key if k is not None][0]}: {t[0]:.1f} / {t[1]:.1f}"
                          for key, t in timings.items())
        rows.append([name, "composite" if "composite" in states else "Triton", timed])
    return rows


# ----- tensor parallel (--tp) -------------------------------------------------------------------------------------

def predict_layout(dims: dict, r: dict, layout: str, n: int, context: int, block: int, a) -> dict:
    """The real model's round over `n` H100s (module docstring): `layout` "tp" (this rank's ops and collectives, the
    target's weights and attention KV divided by n) or "device_map" (every byte read one GPU after another, one
    process's ops); n = 1 is one GPU either way."""
    drafted = DFLASH2.get(_method(r["method"])[0], (_method(r["method"])[0],))[0] in ("dflash", "ddtree")
    target = 2 * dims["params"] + (2 * dims["head"] if drafted else 0)  # the drafter reads the (sharded) lm_head
    drafter = 2 * dims["drafter"] if drafted else 0
    attn_kv = dims["attn_layers"] * context * dims["kv_row"]
    gdn = dims["gdn_layers"] * dims["gdn_state"] * 2
    drafter_kv = sum(min(context, a.drafter_window) if i < a.drafter_sliding else context
                     for i in range(5)) * dims["drafter_kv_row"] if drafted else 0
    flops = 2 * dims["params"] * r["nodes"] + (2 * (dims["drafter"] + dims["head"]) * block if drafted else 0)
    if layout == "tp":
        per_gpu = (target + attn_kv) / n + gdn + drafter + drafter_kv
        collectives = r["total_collectives"] if n > 1 else 0.0
        device = max(per_gpu / a.tp_bandwidth, flops / n / (a.peak_flops * a.mfu)) + collectives * a.collective_us * 1e-6
    else:
        per_gpu = (target + attn_kv + gdn + drafter + drafter_kv) / n
        collectives = 0.0
        device = max(per_gpu * n / a.tp_bandwidth, flops / (a.peak_flops * a.mfu)) + (n - 1) * a.hop_us * 1e-6
    host = (r["total_kernel_ops"] * a.launch_us + (r["total_ops"] - r["total_kernel_ops"]) * a.dispatch_us) * 1e-6
    round_s = max(device, host) + r["total_syncs"] * a.sync_us * 1e-6
    tau = TAU.get(r["method"], 1.0)
    return dict(layout="1 GPU" if n == 1 else f"{'TP' if layout == 'tp' else 'device map'} {n}", gpus=n,
                method=r["method"], gb_per_gpu=per_gpu / 1e9, collectives=collectives, device_ms=1e3 * device,
                host_ms=1e3 * host, round_ms=1e3 * round_s, tau=tau, tok_s=tau / round_s)


def under_torchrun(n: int) -> None:
    """Start this script again under `torch.distributed.run --nproc_per_node=n` (when not already a rank)."""
    if "WORLD_SIZE" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
           *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd))


def tp_main(a) -> None:
    """--tp N: per-rank ops, syncs and collectives per round, TP 1 (rank 0, the whole target) against TP N (every rank
    its shards), and the cost model's round for the real model on --tp-gpus H100s (module docstring)."""
    import torch.distributed as dist

    from ddtree.pipeline.distributed import TensorParallel, world_from_env
    from ddtree.pipeline.models import sharded_copy

    world = world_from_env()
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(world.local_rank)
        a.device = f"cuda:{world.local_rank}"
    dist.init_process_group("nccl" if cuda else "gloo")
    results, predictions = {}, {}
    for name in a.structures.split(","):
        real, whole, drafter = build(name, a)
        dims = real_dims(name)
        ids = torch.randint(0, 500, (1, a.prompt), generator=torch.Generator().manual_seed(5)).to(a.device)
        specs = [s for s in a.methods.split(",") if not (_method(s)[0] in MTP and not supports(model_type(whole), "mtp"))]
        ones = [count_method(whole, drafter, spec, ids, a) for spec in specs] if world.is_main else []
        dist.barrier()
        sharded = sharded_copy(whole, TensorParallel(a.tp, 0, world.rank, 1), "sdpa")
        del whole
        tps = [count_method(sharded, drafter, spec, ids, a) for spec in specs]
        if world.is_main:
            results[name] = list(zip(ones, tps, strict=True))
            predictions[name] = []
            for one, r in results[name]:  # one GPU, then each count as a device map (TP 1's ops) and sharded
                layouts = [(one, "tp", 1)] + [(c, layout, n) for n in a.tp_gpus
                                              for c, layout in ((one, "device_map"), (r, "tp"))]
                predictions[name] += [predict_layout(dims, c, layout, n, a.table_context, drafter.block_size, a)
                                      for c, layout, n in layouts]
            print(f"{name}: per round and rank, TP 1 against TP {a.tp} ({a.device}, {a.dtype}, {a.path} path)")
            for one, r in results[name]:
                print(f"  {r['method']}: ops {one['total_ops']:.0f} -> {r['total_ops']:.0f} "
                      f"({r['total_ops'] / one['total_ops']:.2f}x), kernel ops {one['total_kernel_ops']:.0f} -> "
                      f"{r['total_kernel_ops']:.0f}, syncs {one['total_syncs']:.1f} -> {r['total_syncs']:.1f}, "
                      f"collectives {r['total_collectives']:.1f} ({r['collective_names']})")
            for p in predictions[name]:
                print(f"  {p['method']} on {p['layout']}: {p['gb_per_gpu']:.1f} GB a GPU, {p['collectives']:.0f} "
                      f"collectives, device {p['device_ms']:.2f} ms, host {p['host_ms']:.2f} ms, round "
                      f"{p['round_ms']:.2f} ms, {p['tok_s']:.0f} tok/s")
        del sharded
    dist.barrier()
    dist.destroy_process_group()
    if not world.is_main:
        return
    rec = Record("bench_launches_tp", f"Tensor parallel: ops, syncs and collectives per round and rank, TP 1 vs TP {a.tp}",
                 f"Per steady-state round, counted on each rank at tiny width with the real layer structure, the target "
                 f"whole (TP 1) and sharded over {a.tp} ranks (transformers' tp_plan, gloo on this CPU); {a.path} path, "
                 f"{a.dtype}. Collectives (all-reduces and all-gathers) are counted apart from the ops. Predicted: the "
                 f"cost model of `bench/bench_launches.py` for the real model on H100s ({a.tp_bandwidth / 1e12:.2f} "
                 f"TB/s a GPU, {a.collective_us:g} us a collective, {a.hop_us:g} us a device-map hop, "
                 f"{a.launch_us:g} us a kernel op, {a.sync_us:g} us a sync) at {a.table_context} tokens of context; "
                 "TP n uses the per-rank counts at TP "
                 f"{a.tp} (one collective a sharded projection, whatever n).",
                 params=params(argparse.Namespace(**{k: v for k, v in vars(a).items() if k not in ("torch_dtype", "out")}),
                               tau=TAU))
    for name, pairs in results.items():
        rec.table(f"{name}: per round and rank", ["method", "TP 1 ops", f"TP {a.tp} ops", "ratio", "TP 1 kernel ops",
                                                 f"TP {a.tp} kernel ops", "TP 1 syncs", f"TP {a.tp} syncs",
                                                 f"TP {a.tp} collectives", "collectives by name"],
                  [[r["method"], round(one["total_ops"]), round(r["total_ops"]),
                    round(r["total_ops"] / one["total_ops"], 2), round(one["total_kernel_ops"]),
                    round(r["total_kernel_ops"]), round(one["total_syncs"], 1), round(r["total_syncs"], 1),
                    round(r["total_collectives"], 1),
                    ", ".join(f"{k} {v / r['rounds']:.1f}" for k, v in sorted(r["collective_names"].items()))]
                   for one, r in pairs])
        rec.table(f"{name}: predicted round of the real model on H100s ({a.table_context} tokens of context)",
                  ["method", "layout", "GB a GPU", "collectives", "device ms", "host ms", "round ms", "tok/s"],
                  [[p["method"], p["layout"], round(p["gb_per_gpu"], 1), round(p["collectives"]),
                    round(p["device_ms"], 2), round(p["host_ms"], 2), round(p["round_ms"], 2), round(p["tok_s"])]
                   for p in predictions[name]])
    rec.write(a.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--structures", default="qwen3_6_27b,qwen3_8b")
    ap.add_argument("--methods", default="ar,dflash,ddtree:16,ddtree:64,ddtree:256,mtp,mtp_tree:16")
    ap.add_argument("--rounds", type=int, default=6, help="extra rounds counted per method")
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--path", choices=("device", "host"), default="device")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="count compiled-graph calls with torch.profiler on CPU too")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--table-context", type=int, default=1024)
    ap.add_argument("--drafter-contexts", default="1024,4096,16384", help="'' to skip the drafter timing")
    ap.add_argument("--drafter-repeats", type=int, default=7)
    ap.add_argument("--drafter-window", type=int, default=H200.drafter_window)
    ap.add_argument("--drafter-sliding", type=int, default=H200.drafter_sliding, help="sliding layers of the 5 (Qwen3.6-27B-DFlash: 4)")
    ap.add_argument("--bandwidth", type=float, default=H200.bandwidth, help="bytes/s (H200 HBM3e)")
    ap.add_argument("--peak-flops", type=float, default=H200.peak_flops, help="dense bf16 FLOP/s (H200)")
    ap.add_argument("--mfu", type=float, default=H200.mfu, help="fraction of peak FLOP/s a GEMM reaches")
    ap.add_argument("--launch-us", type=float, default=H200.launch_us, help="host cost of one kernel-launching op (eager)")
    ap.add_argument("--dispatch-us", type=float, default=H200.dispatch_us, help="host cost of a view or allocation op")
    ap.add_argument("--sync-us", type=float, default=H200.sync_us, help="cost of one host sync (the queue drains)")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled round (compile=true): ops counted outside its graphs, graph calls apart")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for --compile (default inductor; 'eager' traces only: the same "
                         "counts outside the graphs, without minutes of code generation on a CPU)")
    ap.add_argument("--graph-us", type=float, default=H200.graph_us,
                    help="host cost of one compiled-graph call (a CUDA graph replay and its Python guards)")
    ap.add_argument("--bytes-contexts", default="4096,32768",
                    help="--compile: bytes per DDTree round (Inductor's plan at the real dims) at these contexts; '' "
                         "to skip")
    ap.add_argument("--bytes-budget", type=int, default=64)
    ap.add_argument("--bytes-new", type=int, default=512, help="max_new_tokens the capacity is sized for")
    ap.add_argument("--bytes-only", action="store_true", help="only the bytes per round (--compile)")
    ap.add_argument("--code", default=None, help="import ddtree from this directory (read before the imports)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel: count each rank of a target sharded over N "
                    "ranks against the whole target (starts N processes; default methods ar,dflash,ddtree:64)")
    ap.add_argument("--tp-gpus", default="2,4", help="--tp: the GPU counts the real model's round is predicted on")
    ap.add_argument("--tp-bandwidth", type=float, default=3.35e12, help="--tp: bytes/s a GPU (H100 SXM HBM3)")
    ap.add_argument("--collective-us", type=float, default=12.0,
                    help="--tp: one small all-reduce or all-gather over NVLink (NCCL, eager)")
    ap.add_argument("--hop-us", type=float, default=10.0, help="--tp: a device map's activations to the next GPU")
    ap.add_argument("--concurrency", default="", help="the batched round (Engine.generate_many) at these stream counts, "
                    "e.g. 1,8,32 (default methods ar,dflash,ddtree:16,ddtree:32,ddtree:64 on qwen3_6_27b; record "
                    "docs/bench/bench_launches_concurrency.json)")
    ap.add_argument("--no-single", dest="single", action="store_false",
                    help="--concurrency: leave out the single-stream engine's counts")
    ap.add_argument("--out", default=None, help="'-' for none (default docs/bench/bench_launches.json, "
                    "docs/bench/bench_launches_tp.json with --tp)")
    a = ap.parse_args()
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x]
    if a.concurrency:
        a.out = a.out or str(ROOT / "docs" / "bench" / "bench_launches_concurrency.json")
        if "--methods" not in sys.argv:
            a.methods = "ar,dflash,ddtree:16,ddtree:32,ddtree:64"
        if "--structures" not in sys.argv:
            a.structures = "qwen3_6_27b"
        a.torch_dtype = getattr(torch, a.dtype)
        concurrency_main(a)
        return
    if a.tp > 1:
        under_torchrun(a.tp)
        a.out = a.out or str(ROOT / "docs" / "bench" / "bench_launches_tp.json")
        if "--methods" not in sys.argv:
            a.methods = "ar,dflash,ddtree:64"
        if "--structures" not in sys.argv:
            a.structures = "qwen3_6_27b"
        if "--drafter-contexts" not in sys.argv:
            a.drafter_contexts = ""
    a.out = a.out or str(ROOT / "docs" / "bench" / "bench_launches.json")
    a.tp_gpus = [int(x) for x in a.tp_gpus.split(",") if x]
    a.torch_dtype = getattr(torch, a.dtype)
    a.contexts = [int(x) for x in a.contexts.split(",") if x]
    a.drafter_contexts = [int(x) for x in a.drafter_contexts.split(",") if x]
    if a.table_context not in a.contexts:
        a.contexts.append(a.table_context)
    a.bytes_contexts = [int(x) for x in a.bytes_contexts.split(",") if x] if a.compile else []
    if a.tp > 1:
        tp_main(a)
        return

    results = {}
    bytes_rows = {}
    for name in a.structures.split(",") if a.bytes_contexts else ():
        print(f"{name}: bytes per compiled DDTree-{a.bytes_budget} round (Inductor's plan at the real dims)", flush=True)
        bytes_rows[name] = round_bytes(name, a)
    for name in a.structures.split(",") if not a.bytes_only else ():
        real, target, drafter = build(name, a)
        dims = real_dims(name)
        ids = torch.randint(0, 500, (1, a.prompt), generator=torch.Generator().manual_seed(5)).to(a.device)
        print(f"{name}: {real.num_hidden_layers} layers ({dims['gdn_layers']} GDN), real weights "
              f"{2 * dims['params'] / 1e9:.1f} GB bf16 (+ drafter {2 * dims['drafter'] / 1e9:.1f} GB), counted at "
              f"hidden {target.config.hidden_size} on {a.device} ({a.dtype}, {a.path} path)", flush=True)
        rows = []
        for spec in a.methods.split(","):
            method, _ = _method(spec)
            if method in MTP and not supports(model_type(target), "mtp"):
                continue  # a family without an MTP head (Qwen3): no MTP rows
            t0 = time.perf_counter()
            r = count_method(target, drafter, spec, ids, a)
            r["predicted"] = {}
            for ctx in a.contexts:
                p = predict(dims, r["total_ops"], r["total_kernel_ops"], r["total_syncs"], r["nodes"],
                            drafter.block_size, DFLASH2.get(method, (method,))[0] in ("dflash", "ddtree"), ctx, a,
                            r["graph_calls"] or 0.0)
                tau = TAU.get(spec, 1.0)
                p.update(tau=tau, tok_s=tau / p["round_ms"] * 1e3, ceiling_tok_s=tau / p["ceiling_ms"] * 1e3)
                r["predicted"][str(ctx)] = p
            r["context_for_table"] = a.table_context
            rows.append(r)
            print(f"  {spec}: {r['total_ops']:.0f} ops/round ({r['total_kernel_ops']:.0f} kernel), "
                  f"{r['total_syncs']:.1f} syncs, {time.perf_counter() - t0:.0f} s", flush=True)
        results[name] = rows
        print()
        print(table(name, rows))
        print()
        print("verify ops per GDN layer / per attention layer / outside layers: " + "; ".join(
            f"{r['method']}: " + " / ".join(f"{r['verify_per_layer'].get(k, 0):.1f}"
                                           for k in ("linear_attention", "full_attention", "outside")) for r in rows))
        print("predicted round ms (ceiling ms) by context: " + "; ".join(
            f"{r['method']}: " + ", ".join(f"{c // 1024}k {r['predicted'][str(c)]['round_ms']:.1f} "
                                           f"({r['predicted'][str(c)]['ceiling_ms']:.1f})" for c in a.contexts)
            for r in rows))
        print()
        del target, drafter
    drafter_rows = drafter_context(a) if a.drafter_contexts else []

    title, what = ("What a decoding round asks of a GPU (ops, syncs, predicted H200 round)",
                   "Per steady-state round, counted on this machine at tiny width with the real layer structure; "
                   f"{a.path} path, {a.dtype}. Predicted ms and tok/s from the cost model in `bench/bench_launches.py` "
                   f"(bandwidth {a.bandwidth / 1e12:.1f} TB/s, {a.launch_us:g} us a kernel op, {a.dispatch_us:g} us a "
                   f"view, {a.sync_us:g} us a sync; tau: the toy pair's) at {a.table_context} tokens of context.")
    if a.bytes_only:
        title, what = (f"Bytes per compiled DDTree-{a.bytes_budget} round at the real dims (Inductor's plan)",
                       "What the compiled round's generated code reads and writes, by stage, counted from Inductor's "
                       "plan of each graph at the structure's real dims (ddtree.testing.inductor_plan; the depth from "
                       "one and two periods of the layer pattern), at each context with the KV capacity the engine "
                       "allocates for it (context + --bytes-new + the tree); floor: the weights, the context's KV rows, "
                       "the GDN states read and written, the logits (docs/gpu.md).")
    rec = Record("bench_launches", title, what,
                 params=params(argparse.Namespace(**{k: v for k, v in vars(a).items() if k not in ("torch_dtype", "out")}),
                               cost_model=dict(bandwidth=a.bandwidth, peak_flops=a.peak_flops, mfu=a.mfu,
                                                  launch_us=a.launch_us, dispatch_us=a.dispatch_us, sync_us=a.sync_us,
                                                  graph_us=a.graph_us, tau=TAU)))
    for name, rows in results.items():
        rec.table(name, ["method", *STAGES, "ops", "kernel ops", "syncs", "graphs", "ceiling ms", "predicted ms",
                         "predicted tok/s", "ceiling tok/s"],
                  [[r["method"], *(round(r["ops"][s]) for s in STAGES), round(r["total_ops"]),
                    round(r["total_kernel_ops"]), round(r["total_syncs"], 1), round(r["graph_calls"]),
                    *(round(r["predicted"][str(a.table_context)][k], 1)
                      for k in ("ceiling_ms", "round_ms", "tok_s", "ceiling_tok_s"))] for r in rows])
        rec.table(f"{name}: the verification's ops per decoder layer (lean layers) and outside them, a round",
                  ["method", "per GDN layer", "per attention layer", "outside layers"],
                  [[r["method"], *(round(r["verify_per_layer"][k], 1) if k in r["verify_per_layer"] else "–"
                                   for k in ("linear_attention", "full_attention", "outside"))] for r in rows])
        rec.table(f"{name}: predicted round ms (ceiling ms) by context", ["method", *(f"{c // 1024}k" for c in a.contexts)],
                  [[r["method"], *(f"{r['predicted'][str(c)]['round_ms']:.1f} ({r['predicted'][str(c)]['ceiling_ms']:.1f})"
                                   for c in a.contexts)] for r in rows])
    for name, brows in bytes_rows.items():
        stages = list(brows[0]["stages"])
        rec.table(f"{name}: bytes per compiled DDTree-{a.bytes_budget} round (GB; Inductor's plan at the real dims)",
                  ["context", "capacity", *stages, "total", "floor", "total / floor"],
                  [[r["context"], r["capacity"], *(round(r["stages"][s] / 1e9, 3) for s in stages),
                    round(r["total"] / 1e9, 2), round(r["floor"] / 1e9, 2), round(r["ratio"], 3)] for r in brows])
    fused = fused_ops_seen()
    if fused:  # on CUDA: which implementation each fused op ran, and the timed ones' measurements
        print("fused ops (ddtree.engine.kernels): " + "; ".join(f"{r[0]} {r[1]}" + (f" ({r[2]})" if r[2] else "")
                                                             for r in fused))
        rec.table("Fused ops on this device (ddtree.engine.kernels)", ["op", "runs", "timed (shapes: kernel / "
                                                                      "composite us)"], fused)
    if drafter_rows:
        rec.table("Drafter forward by context (ms on this machine)", list(drafter_rows[0]),
                  [[round(v, 2) if isinstance(v, float) else v for v in row.values()] for row in drafter_rows])
    rec.write(a.out)


if __name__ == "__main__":
    main()
