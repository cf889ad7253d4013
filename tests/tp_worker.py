"""The engine on a tiny random target sharded over torchrun's ranks, against HF greedy decoding of the whole model,
with what each round ran counted (tests/test_tensor_parallel.py):

    torchrun --nproc_per_node=2 tests/tp_worker.py OUT.json [--model-type qwen3_5_text]
        [--methods ar,dflash,ddtree:8,pair:8,dflash2,mtp,mtp:8] [--tokens 12] [--vocab 16]
    python tests/tp_worker.py OUT.json ...                 # one process: the same target whole (TP 1)

Every rank builds the same seeded target and loads it sharded over all ranks (ddtree.pipeline.models.sharded_copy,
transformers' tp_plan); each method decodes two prompts with each rank's counters on. Rank 0 writes OUT.json:
{"world", "paths" (ddtree.engine.sharded.paths), "methods": {spec: {"exact" (equal to HF greedy, per prompt),
"outputs", "lean_layer_calls", "model_calls" (the plain model call's), "split_attention_calls", "rounds",
"ops_per_round", "syncs_per_round", "collectives_per_round", "collective_names"}}, "compiled_round" (what
compile=true says of the target: the refusal's line where it cannot run)}; every rank's outputs are checked equal
to rank 0's (an all-gather of the token lists).

Method specs: ar, dflash, ddtree:B (a random DFlash drafter), dflash2 (a random DFlash2 drafter's chain),
marginal:B / pair:B (DDTree over a DFlash2 drafter under each scoring), mtp (the target's own head: a chain of 3),
mtp:B (a top-2 tree of B nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch


def _engine(spec: str, target, plain):
    import ddtree
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.engine.drafter.dflash2 import DFlash2Drafter
    from ddtree.engine.drafter.mtp import MTPHead

    name, _, b = spec.partition(":")
    budget = int(b) if b else None
    kw = dict(block_size=4, seed=1, num_layers=1)
    if name == "ar":
        return ddtree.Engine(target, None, method="ar")
    if name in ("dflash", "ddtree"):
        return ddtree.Engine(target, DFlashDrafter.random_for_target(plain.config, **kw), method=name, budget=budget)
    if name in ("dflash2", "marginal", "pair"):
        drafter = DFlash2Drafter.random_for_target(plain.config, **kw)
        if name == "dflash2":
            return ddtree.Engine(target, drafter, method="dflash")
        return ddtree.Engine(target, drafter, method="ddtree", budget=budget, scoring=name)
    if name == "mtp":
        head = MTPHead.random_for_target(plain, seed=0)
        return ddtree.Engine(target, head, method="mtp", steps=3, topk=2 if budget else 1, budget=budget)
    raise SystemExit(f"unknown method spec {spec!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model-type", default="qwen3_5_text")
    ap.add_argument("--methods", default="ar,dflash,ddtree:8")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16)  # small: random drafts get accepted past the root
    ap.add_argument("--path", choices=("device", "host"), default="device",
                    help="device: the branches a CUDA run takes (split tree attention, ...); host: the CPU's own")
    a = ap.parse_args(argv)

    import torch.distributed as dist

    import ddtree
    from ddtree.engine import attention
    from ddtree.engine.forward import LeanLayer, lean_forward_for
    from ddtree.engine.host import device_path
    from ddtree.engine.sharded import paths
    from ddtree.errors import ConfigError
    from ddtree.pipeline import distributed as D
    from ddtree.pipeline.models import sharded_copy
    from ddtree.testing.dispatch import DispatchCount
    from ddtree.testing.reference import hf_greedy
    from ddtree.tiny import tiny_model

    world = D.world_from_env()
    if world.is_distributed:
        dist.init_process_group("gloo")
    plain = tiny_model(a.model_type, seed=2, attn_implementation="sdpa", vocab_size=a.vocab)
    target = plain
    if world.is_distributed:
        tp = D.TensorParallel(world.world_size, 0, world.rank, 1)
        target = sharded_copy(tiny_model(a.model_type, seed=2, attn_implementation="sdpa", vocab_size=a.vocab), tp,
                              "sdpa")
    counts = {"lean": 0, "model": 0, "split": 0}
    lean_call, split_verify = LeanLayer.__call__, attention._split_verify

    def counted_lean(self, *args, **kwargs):
        counts["lean"] += 1
        return lean_call(self, *args, **kwargs)

    def counted_split(*args, **kwargs):
        counts["split"] += 1
        return split_verify(*args, **kwargs)

    LeanLayer.__call__, attention._split_verify = counted_lean, counted_split
    target.model.register_forward_pre_hook(lambda *_: counts.__setitem__("model", counts["model"] + 1))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, a.vocab, (1, n), generator=gen) for n in (5, 11)]
    refs = [hf_greedy(plain, ids, a.tokens) for ids in prompts]
    report = {"world": world.world_size, "paths": paths(target, lean_forward_for(target)), "methods": {}}
    for spec in a.methods.split(","):
        with device_path() if a.path == "device" else contextlib.nullcontext():
            engine = _engine(spec, target, plain)
            engine.generate(prompts[0], max_new_tokens=4)  # warm-up: lazy buffers and first-call costs out of the counts
            for k in counts:
                counts[k] = 0
            outs, rounds = [], 0
            with DispatchCount() as c:
                for ids in prompts:
                    res = engine.generate(ids, max_new_tokens=a.tokens)
                    outs.append(res.output_ids)
                    rounds += res.rounds
            engine.close()
        per = {key: sum(v for s, v in getattr(c, key).items() if s != "prefill") / rounds
               for key in ("ops", "syncs", "collectives")}
        report["methods"][spec] = {
            "exact": [o == r for o, r in zip(outs, refs, strict=True)], "outputs": outs, "rounds": rounds,
            "lean_layer_calls": counts["lean"], "model_calls": counts["model"], "split_attention_calls": counts["split"],
            "ops_per_round": per["ops"], "syncs_per_round": per["syncs"], "collectives_per_round": per["collectives"],
            "collective_names": dict(c.collective_names)}
    LeanLayer.__call__, attention._split_verify = lean_call, split_verify
    try:  # the compiled round on a sharded target: refused with why (compile=auto: the eager round, with that note)
        ddtree.Engine(target, None, method="ar", compile="true").close()
        report["compiled_round"] = "compiled"
    except ConfigError as err:
        report["compiled_round"] = str(err)
    if world.is_distributed:  # every rank decoded the same tokens
        everyone = [None] * world.world_size
        dist.all_gather_object(everyone, {s: m["outputs"] for s, m in report["methods"].items()})
        report["ranks_agree"] = all(e == everyone[0] for e in everyone)
        dist.destroy_process_group()
    if world.is_main:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
