"""Target forward cost of 1 / 16 / 64 / 256 / 1024 tokens per attention backend, and the predicted speedup.

    # GPU, a Qwen3-8B-shaped random model in bf16 (the defaults):
    python bench/device_forward.py --prefix 4096 --tau 3,4,5
    # CPU smoke test (tiny shape, slow but complete):
    OMP_NUM_THREADS=1 python bench/device_forward.py --device cpu --dtype float32 --hidden 64 --layers 2 \
        --heads 4 --kv-heads 2 --head-dim 16 --intermediate 128 --vocab 256 --prefix 128 --tokens 1,16,64 --repeats 2 \
        --json -

Random weights (no download) of a Qwen3 with the given shape. After a --prefix prefill, it times one target
forward of t tokens through the engine's TargetSession: t = 1 is an AR step (plain backend); t > 1 is the
verification of a DDTree-shaped tree of t tokens (best-first under random draft log-probabilities, 16
levels), the cache rolled back after each. Backends (those available here):
    sdpa/dense   the 4-D additive mask over past + tree (how the authors verified)
    sdpa/split   ddtree.engine.attention: prefix without a mask on a fused kernel + tree part, merged by LSE
    flash_attention_2/split, flash_attention_3/split   the same, prefix on flash-attn
    flex_attention   one compiled flex call with a BlockMask from the ancestor matrix
Per cell: median milliseconds over --repeats after --warmup, and the peak extra memory of the forward
(CUDA allocator). Then, for each tau, the predicted speedup tau * t(1) / (t(n) + draft_ms) with n = budget + 1
(--draft-ms: the drafter's time per round, 0 = an upper bound). Also checks that split and dense
verification agree (max |logit difference|, argmax agreement) where both ran. Writes docs/bench/device_forward.json.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from _common import Record, add_json_arg, device_sync, params, timed

from ddtree.engine import attention
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import best_first_tree


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=12288)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--sliding-window", type=int, default=None, help="make every other layer a sliding layer")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--tokens", default="1,16,64,256,1024")
    ap.add_argument("--backends", default="auto", help="comma list of backend/mode, or auto (all available)")
    ap.add_argument("--tau", default="3,4,5", help="mean accepted tokens per round to predict for")
    ap.add_argument("--draft-ms", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    add_json_arg(ap, "device_forward")
    return ap.parse_args()


def available_backends(device: str) -> list[str]:
    out = ["sdpa/dense", "sdpa/split"]
    if device.startswith("cuda"):
        if importlib.util.find_spec("flash_attn") is not None:
            out.append("flash_attention_2/split")
        if importlib.util.find_spec("flash_attn_interface") is not None:
            out.append("flash_attention_3/split")
    out.append("flex_attention/split")
    return out


def build_model(a, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
              num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate,
              vocab_size=a.vocab, max_position_embeddings=max(32768, a.prefix + 2048), tie_word_embeddings=False)
    if a.sliding_window:
        kw.update(use_sliding_window=True, sliding_window=a.sliding_window, max_window_layers=0,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(a.layers)])
    cfg = AutoConfig.for_model("qwen3", **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def draft_tree(n: int, vocab: int, device) -> object:
    g = torch.Generator().manual_seed(n)
    logp = torch.log_softmax(torch.randn(16, min(vocab, 4096), generator=g) * 4, dim=-1).to(device)
    return best_first_tree(torch.tensor(7, device=device), logp, n - 1)


def time_backend(model, backend: str, a, device, trees, prefix_ids):
    base, mode = backend.split("/")
    model.set_attn_implementation(base)  # the plain backend; a split session wraps it itself
    sess = TargetSession(model, tree_attention=mode, capacity=a.prefix + max(trees) + 8)
    sess.prefill(prefix_ids)
    sync = device_sync(device)
    sync()
    res, logits = {}, {}
    for n, tree in trees.items():
        def once(n=n, tree=tree, sess=sess):
            out = sess.verify(tree)
            for layer in sess.cache.layers:  # roll back: the next forward sees the same prefix
                if layer.is_initialized:
                    layer.crop(-n)
            return out

        for _ in range(a.warmup):
            once()
        sync()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
        spread = timed(once, a.repeats, warmup=0, sync=sync).scaled(1e3)
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20 if device.startswith("cuda") else float("nan")
        res[n] = (spread, peak)
        logits[n] = once()[0].float()
    return res, logits


def main() -> None:
    a = parse()
    device, dtype = a.device, getattr(torch, a.dtype)
    tokens = [int(t) for t in a.tokens.split(",")]
    backends = available_backends(device) if a.backends == "auto" else a.backends.split(",")
    model = build_model(a, device, dtype)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"# {name}; qwen3 shape hidden {a.hidden}, layers {a.layers}, heads {a.heads}/{a.kv_heads} x {a.head_dim}, "
          f"ffn {a.intermediate}, vocab {a.vocab}, sliding {a.sliding_window}; {a.dtype}; prefix {a.prefix}; "
          f"torch {torch.__version__}")
    prefix_ids = torch.randint(0, a.vocab, (1, a.prefix), generator=torch.Generator().manual_seed(0)).to(device)
    from ddtree.engine.tree import root_tree

    trees = {n: (root_tree(torch.tensor(7, device=device)) if n == 1 else draft_tree(n, a.vocab, device)) for n in tokens}
    table, all_logits = {}, {}
    for b in backends:
        try:
            table[b], all_logits[b] = time_backend(model, b, a, device, trees, prefix_ids)
        except Exception as e:  # a backend this stack lacks: say so and go on
            print(f"# {b}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    print("\n# target forward, median ms (peak extra MiB during the forward)")
    print(f"{'backend':>24} " + " ".join(f"{n:>17}" for n in tokens))
    for b, row in table.items():
        print(f"{b:>24} " + " ".join(f"{row[n][0].median:9.2f} ({row[n][1]:5.0f})" for n in tokens))
    print(f"\n# kernels used by the split path: {attention.chosen_kernels()}")
    if "sdpa/dense" in all_logits:
        for b, lg in all_logits.items():
            if b == "sdpa/dense":
                continue
            for n in tokens:
                ref = all_logits["sdpa/dense"][n]
                diff = float((lg[n] - ref).abs().max())
                agree = float((lg[n].argmax(-1) == ref.argmax(-1)).float().mean())
                print(f"# {b} vs sdpa/dense, {n} tokens: max |dlogit| {diff:.3g}, argmax agreement {100 * agree:.1f}%")
    taus = [float(t) for t in a.tau.split(",")]
    print(f"\n# predicted speedup tau * t(1) / (t(n) + {a.draft_ms} ms draft), n = budget + 1")
    print(f"{'backend':>24} {'n':>5} " + " ".join(f"{'tau=' + str(t):>8}" for t in taus))
    predicted = []
    for b, row in table.items():
        ar = row[1][0].median if 1 in row else None
        for n in tokens:
            if n == 1 or ar is None:
                continue
            pred = [t * ar / (row[n][0].median + a.draft_ms) for t in taus]
            print(f"{b:>24} {n:>5} " + " ".join(f"{x:8.2f}" for x in pred))
            predicted.append([b, n, *(round(x, 2) for x in pred)])
    rec = Record("device_forward", f"Target forward per backend and tree size ({name}, {a.dtype})",
                 f"One target forward of n tokens after a {a.prefix}-token prefix, random weights of a Qwen3 shape "
                 f"(hidden {a.hidden}, {a.layers} layers, heads {a.heads}/{a.kv_heads} x {a.head_dim}); n = 1 is an "
                 "AR step, n > 1 a DDTree-shaped tree. Split kernels: " + str(attention.chosen_kernels()),
                 params=params(a, device_name=name))
    rec.table("Target forward, ms", ["backend", *(f"n = {n}" for n in tokens)],
              [[b, *(row[n][0].cell(2) for n in tokens)] for b, row in table.items()],
              formats={f"n = {n}": "{:.2f}" for n in tokens})
    rec.table(f"Predicted speedup tau x t(1) / (t(n) + {a.draft_ms} ms draft)", ["backend", "n",
              *(f"tau = {t:g}" for t in taus)], predicted, formats={f"tau = {t:g}": "{:.2f}x" for t in taus})
    rec.write(a.json)


if __name__ == "__main__":
    main()
