"""Cost of tree-aware Gated DeltaNet verification (ddtree.engine.gdn) against an unpatched chain.

    .venv/bin/python bench/bench_gdn.py [--budgets 16 64 256] [--repeats 30] [--threads 1] [--layer]

Model level: the tiny hybrid target (ddtree.testing.tiny, qwen3_5_text by default), a prefilled cache, then
one verification forward of [root] + `budget` nodes:
  * chain     unpatched flat causal forward of the same length (what DFlash pays),
  * masked    unpatched forward with the 4-D tree mask (attention right, GDN wrong),
  * chunk     tree-aware GDN, ancestor-masked single chunk,
  * recurrent tree-aware GDN, one batched step per depth,
plus the commit of a deepest root-to-leaf path. --layer adds one GDN layer alone at Qwen3.6-27B-like
widths (48 value heads, 16 key heads, head dim 128) to show how the GDN part itself scales.
Times are medians in milliseconds; each run starts from a fresh copy of the prefilled cache.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddtree.engine import gdn as gdn_tree  # noqa: E402
from ddtree.engine.tree import tree_attention_mask, tree_from_parents  # noqa: E402
from ddtree.testing.tiny import tiny_model  # noqa: E402


def draft_tree(budget: int, max_depth: int = 16, seed: int = 0) -> list[int]:
    """A DDTree-like shape: a deep main line with branches, most of them near the root."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for i in range(1, budget + 1):
        while True:
            if torch.rand((), generator=gen).item() < 0.5:
                p = i - 1  # extend the newest node
            else:  # branch, biased towards shallow nodes
                p = int(torch.randint(0, i, (), generator=gen).item() * torch.rand((), generator=gen).item())
            if depth[p] < max_depth:
                break
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def median_ms(variants: dict, setup, repeats: int) -> dict[str, float]:
    """Median wall time of each variant; variants alternate within a repeat so load drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repeats + 2):  # two warm-up rounds
        for name, fn in variants.items():
            arg = setup(name)
            t0 = time.perf_counter()
            fn(arg)
            if rep >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_model(model_type: str, budgets: list[int], repeats: int, prompt_len: int) -> None:
    model = tiny_model(model_type, attn_implementation="sdpa")
    cfg = model.config
    print(f"\n{model_type} tiny: {cfg.num_hidden_layers} layers ({cfg.layer_types.count('linear_attention')} GDN), "
          f"hidden {cfg.hidden_size}, prompt {prompt_len}; median ms over {repeats} runs, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'budget':>6} {'depth':>5} {'chain':>8} {'masked':>8} {'chunk':>8} {'recurrent':>9} "
          f"{'commit':>7} {'chunk/chain':>11} {'rec/chain':>9}")
    gdn_tree.install()
    cache = model(input_ids=torch.randint(0, cfg.vocab_size, (1, prompt_len)), use_cache=True).cache
    for budget in budgets:
        depth, t = _model_budget(model, cache, budget, repeats, prompt_len)
        print(f"{budget:>6} {depth:>5} {t['chain']:>8.2f} {t['masked']:>8.2f} {t['chunk']:>8.2f} "
              f"{t['recurrent']:>9.2f} {t['commit']:>7.2f} {t['chunk'] / t['chain']:>11.2f} "
              f"{t['recurrent'] / t['chain']:>9.2f}")


def _model_budget(model, cache, budget: int, repeats: int, prompt_len: int) -> tuple[int, dict[str, float]]:
    parents = draft_tree(budget)
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    pos = torch.tensor([depths]) + prompt_len
    # token ids do not change the mask; distinct ids keep siblings valid
    tree = tree_from_parents(list(range(len(parents))), parents)  # the engine's DraftTree, as TargetSession passes
    mask = tree_attention_mask(tree, prompt_len, torch.float32)
    leaf = max(range(n), key=lambda i: depths[i])
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    accepted = torch.tensor(path[::-1])

    def chain(c):
        model(input_ids=ids, cache=c, use_cache=True)

    def masked(c):
        model(input_ids=ids, cache=c, position_ids=pos, attention_mask=mask, use_cache=True)

    def tree_forward(method):
        def run(c):
            with gdn_tree.tree_verification(tree, method=method):
                model(input_ids=ids, cache=c, position_ids=pos, attention_mask=mask, use_cache=True)
        return run

    def setup(name):
        c = copy.deepcopy(cache)
        if name == "commit":
            tree_forward("chunk")(c)
        return c

    return max(depths), median_ms({
        "chain": chain,
        "masked": masked,
        "chunk": tree_forward("chunk"),
        "recurrent": tree_forward("recurrent"),
        "commit": lambda c: gdn_tree.commit_linear_states(c, accepted),
    }, setup, repeats)


def bench_layer(budgets: list[int], repeats: int, prompt_len: int) -> None:
    """One GDN layer at large-model widths: upstream chain forward vs the tree-aware forward."""
    from transformers import AutoConfig, DynamicCache
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = AutoConfig.for_model("qwen3_5_text", hidden_size=5120, num_hidden_layers=1, num_attention_heads=8,
                               num_key_value_heads=2, layer_types=["linear_attention"], linear_num_value_heads=48,
                               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, vocab_size=16)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        layer.A_log.fill_(-3.0)
    gdn_tree.install()
    cache = DynamicCache(config=cfg)
    layer(torch.randn(1, prompt_len, cfg.hidden_size) * 0.1, cache=cache)
    print(f"\none GDN layer, hidden 5120, 48 v-heads x 128, 16 k-heads x 128 (fp32, CPU); median ms over {repeats}")
    print(f"{'budget':>6} {'chain':>8} {'chunk':>8} {'recurrent':>9} {'chunk/chain':>11} {'rec/chain':>9}")
    for budget in budgets:
        t = _layer_budget(layer, cache, budget, repeats, cfg.hidden_size)
        print(f"{budget:>6} {t['chain']:>8.2f} {t['chunk']:>8.2f} {t['recurrent']:>9.2f} "
              f"{t['chunk'] / t['chain']:>11.2f} {t['recurrent'] / t['chain']:>9.2f}")


def _layer_budget(layer, cache, budget: int, repeats: int, hidden_size: int) -> dict[str, float]:
    parents = draft_tree(budget)
    hidden = torch.randn(1, len(parents), hidden_size) * 0.1
    tree = torch.tensor(parents)

    def tree_forward(method):
        def run(c):
            with gdn_tree.tree_verification(tree, method=method):
                layer(hidden, cache=c)
        return run

    return median_ms({"chain": lambda c: layer(hidden, cache=c), "chunk": tree_forward("chunk"),
                      "recurrent": tree_forward("recurrent")}, lambda name: copy.deepcopy(cache), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=["qwen3_5_text"])
    ap.add_argument("--layer", action="store_true", help="also time one GDN layer at large-model widths")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.no_grad():
        for model_type in args.models:
            bench_model(model_type, args.budgets, args.repeats, args.prompt_len)
        if args.layer:
            bench_layer(args.budgets, max(3, args.repeats // 5), args.prompt_len)


if __name__ == "__main__":
    main()
