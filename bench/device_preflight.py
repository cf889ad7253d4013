"""The first minute on a GPU machine (bench/device_all.sh's first step): what is there, and whether the compiled round
runs at all, before any long step.

    python bench/device_preflight.py --out OUTDIR/preflight.json

Prints and writes: versions (Python, torch, CUDA, triton, transformers, hydra-core, omegaconf, mlflow or its
absence) and where each was imported from (the carried kit or the image); the GPU; fp32 matmul precision
(torch.get_float32_matmul_precision, TF32 flags); torch's own SDPA choice (`torch._fused_sdp_choice`) for the
compiled verify's attention at Qwen3.6-27B's dims (24 query heads, 4 KV heads, head dim 256, DDTree-64: 65 nodes,
capacity 8192, bf16) in the grouped layout the graph uses (ddtree.engine.fixed_kv.grouped_attention) and in the
masked enable_gqa call of before, with the project's rule (`fused_sdpa_refusal`) beside it; then one tiny compiled
DDTree round (compile=true: inductor, CUDA graphs) on a tiny hybrid against HF greedy, timed. Each part is caught
on its own: a failing part is recorded and the next one runs. Exit 0 unless the compiled round fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "hydra", "omegaconf", "antlr4", "mlflow", "huggingface_hub",
                 "tokenizers", "safetensors"):
        try:
            mod = importlib.import_module(name)
            out[name] = f"{getattr(mod, '__version__', '?')} ({Path(mod.__file__).parent.parent})"
        except Exception as e:  # absent: said, not fatal (mlflow: run with tracking=none)
            out[name] = f"absent ({type(e).__name__})"
    import torch

    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return out


def precision() -> dict:
    import torch

    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}


def sdpa_choice(nodes: int = 65, capacity: int = 8192) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    from ddtree.engine.compiled import fused_sdpa_refusal
    from ddtree.engine.fixed_kv import grouped_bias

    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    dev, dt = "cuda", torch.bfloat16
    heads, kv, d = 24, 4, 256
    q = torch.randn(1, heads, nodes, d, device=dev, dtype=dt)
    k = torch.randn(1, kv, capacity, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    visible = torch.rand(nodes, capacity, device=dev) < 0.5
    visible[:, 0] = True
    out = {}
    g = heads // kv
    grouped_q = q.reshape(1, kv, g * nodes, d)
    bias = grouped_bias(visible, g, dt)
    cases = {"grouped (the compiled verify)": (grouped_q, bias, False),
             "masked enable_gqa (before)": (q, visible.view(1, 1, nodes, capacity), True)}
    for label, (qq, mask, gqa) in cases.items():
        choice = torch._fused_sdp_choice(qq, k, v, mask, 0.0, False, enable_gqa=gqa)
        out[label] = {"torch": names.get(int(choice), str(choice)),
                      "rule (fused_sdpa_refusal)": fused_sdpa_refusal(qq, k, v, mask, gqa) or "fused kernel takes it"}
        torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=gqa)  # runs
    torch.cuda.synchronize()
    return out


def compiled_round() -> dict:
    import torch

    import ddtree
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.testing.reference import hf_greedy
    from ddtree.tiny import tiny_model

    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12).cuda()
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3).cuda()
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1)).cuda()
    engine = ddtree.Engine(target, drafter, method="ddtree", budget=8, compile="true")
    t = time.perf_counter()
    engine.generate(ids, max_new_tokens=4)
    first = time.perf_counter() - t
    t = time.perf_counter()
    res = engine.generate(ids, max_new_tokens=16)
    torch.cuda.synchronize()
    again = time.perf_counter() - t
    exact = res.output_ids == hf_greedy(target, ids, 16)
    return {"compiled": engine.static is not None, "exact": exact, "first_generation_s": round(first, 1),
            "second_generation_s": round(again, 3), "rounds": res.rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    report: dict = {}
    rc = 0
    for name, part in (("versions", versions), ("precision", precision), ("sdpa_choice", sdpa_choice),
                       ("compiled_round", compiled_round)):
        t = time.perf_counter()
        try:
            report[name] = part()
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            rc = 1 if name == "compiled_round" else rc
        print(f"{name} ({time.perf_counter() - t:.1f} s): "
              + json.dumps({k: v for k, v in report[name].items() if k != "trace"}, default=str), flush=True)
        if a.out != "-":  # written after each part: a killed call keeps what came before
            Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    if report.get("compiled_round", {}).get("exact") is False:
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
