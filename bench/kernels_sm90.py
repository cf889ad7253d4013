"""Every fused op's Triton kernels through Triton's real compiler for an sm_90 GPU (H100 / H200), no GPU needed.

    python bench/kernels_sm90.py [--arch 90] [--budgets 16,64] [--out -]

Triton's interpreter (the CPU tests) is lax: it checks no types, layouts, register budgets or `tl.dot` rules. This
compiles each kernel the way a CUDA run would launch it: a real generation (AR, DFlash, DDTree per budget; the
device path) runs on the CPU on a 2-layer model with Qwen3.6-27B's widths and head dims (one GDN layer, one gated
attention layer; the MLP narrowed), every fused op called with the engine's real arguments. Each call runs its
Triton launcher with `JITFunction.run` replaced by `triton.compile(..., target=GPUTarget("cuda", arch, 32))` (the
signature read from the arguments), then the composite (whose result the generation uses). Prints, per kernel and
specialisation: registers a thread, spilled bytes, shared memory; and the ops whose launcher fell back to the
composite on a real call (a layout or size the kernel does not take). Exit 1 if a kernel fails to compile or an op
never reached its kernel. Needs Triton with its NVIDIA backend (ptxas ships with it), and TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int64": "i64",
          "torch.int32": "i32", "torch.bool": "i1", "torch.int8": "i8", "torch.uint8": "u8", "torch.float64": "fp64"}


def _signature(fn, args, kwargs) -> tuple[dict, dict]:
    import torch

    sig, consts = {}, {}
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    const_idx = {fn.arg_names[i] for i in getattr(fn, "constexprs", [])}
    for name in fn.arg_names:
        v = bound[name]
        if name in const_idx:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[str(v.dtype)]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v is None:
            sig[name], consts[name] = "constexpr", None
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return sig, consts


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers a thread, spilled bytes: stores + loads) of a kernel's PTX, from the ptxas Triton ships (-v)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", str(src),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True)
    out = run.stderr + run.stdout
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return regs, spills


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--out", default="-", help="a JSON file for the table ('-': none)")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernels_sm90: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
    import torch
    import triton
    from transformers import AutoConfig, AutoModelForCausalLM
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    import ddtree
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.engine.host import device_path
    from ddtree.engine.kernels import FusedOp

    target_arch = GPUTarget("cuda", a.arch, 32)
    compiled: dict[tuple, dict] = {}
    failures: list[str] = []
    launched = [0]

    def compile_instead(fn, *args, grid, warmup, **kwargs):
        launched[0] += 1
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        sig, consts = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
               tuple(sorted(options.items())))
        if key in compiled:
            return None
        try:
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts),
                               target=target_arch, options=options)
            regs, spills = _ptxas_usage(k.asm["ptx"], a.arch)
            compiled[key] = dict(kernel=fn.__name__, constexprs={n: v for n, v in consts.items() if v is not None},
                                 warps=options.get("num_warps", 4), regs=regs, spills=spills,
                                 shared=k.metadata.shared)
        except Exception as exc:  # noqa: BLE001 -- recorded and reported
            compiled[key] = dict(kernel=fn.__name__, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            failures.append(f"{fn.__name__} {consts}: {exc}")
        return None

    reached: collections.Counter = collections.Counter()
    fell_back: collections.Counter = collections.Counter()
    real_call = FusedOp.__call__

    def through_launcher(op, *args):
        if op.launch is not None:
            before = launched[0]
            trial = [x.clone() if isinstance(x, torch.Tensor) and i in op.mutated else x for i, x in enumerate(args)]
            op.launch(*trial)
            (reached if launched[0] > before else fell_back)[op.name] += 1
        return real_call(op, *args)

    JITFunction.run = compile_instead
    FusedOp.__call__ = through_launcher

    raw = json.loads((ROOT / "bench" / "configs" / "qwen3_6_27b.json").read_text())["text_config"]
    kw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "torch_dtype")}
    kw.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=512,
              intermediate_size=1024)
    cfg = AutoConfig.for_model("qwen3_5_text", **kw)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    drafter = DFlashDrafter.random_for_target(cfg, num_layers=1, block_size=16, target_layer_ids=[0, 1], seed=1)
    drafter.to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    runs = [("ar", None), ("dflash", None)] + [("ddtree", int(b)) for b in a.budgets.split(",")]
    with device_path():
        for method, budget in runs:
            engine = ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget or 16)
            engine.generate(ids, max_new_tokens=6)

    rows = sorted(compiled.values(), key=lambda r: r["kernel"])
    print(f"Triton {triton.__version__}, target sm_{a.arch}: {len(rows)} kernel specialisations from "
          f"{sum(reached.values())} fused calls")
    print("| kernel | constexprs | warps | registers | spilled bytes | shared bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | – | – | error | {r['error']} | – |")
        else:
            print(f"| {r['kernel']} | {r['constexprs']} | {r['warps']} | {r['regs']} | {r['spills']} | {r['shared']} |")
    never = sorted(set(fell_back) - set(reached))
    if fell_back:
        print("launcher fell back to the composite on real calls: " + ", ".join(f"{k} x{v}" for k, v in
                                                                              sorted(fell_back.items())))
    if a.out != "-":
        Path(a.out).write_text(json.dumps(dict(arch=a.arch, triton=triton.__version__, kernels=rows,
                                               fell_back=dict(fell_back), reached=dict(reached)), indent=1))
    if failures or never:
        print("FAILED: " + "; ".join(failures + [f"{k}: no real call reached its kernel" for k in never]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
