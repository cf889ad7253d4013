"""The tree-exact GDN layer as a GPU pays for it: aten ops dispatched per layer (each a kernel launch without
graphs), and capturability (torch.compile fullgraph, no graph breaks). Exactness is tests/test_gdn_tree.py's."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from ddtree.engine import gdn
from ddtree.engine.tree import tree_from_parents
from ddtree.engine.verification import tree_verification
from ddtree.testing.dispatch import DispatchCount
from ddtree.tiny import tiny_model

PROMPT = 12
# a DDTree-like 33-node tree: a main line with branches
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 1, 2, 3, 12, 13, 4, 5, 6, 19, 20, 7, 8, 0, 26, 2, 15, 9, 11, 31]
# ops = kernels + views (DispatchCount(decompose=True) counts composites by what they dispatch: a view inside F.linear
# counts; F.rms_norm counts as the one fused kernel a GPU runs, dispatch.DEVICE_FUSED; a fused op of
# ddtree.engine.kernels.gdn as its one launch); on a GPU without graphs the host pays a view's dispatch too. Today: the
# tree verification proper 4 fused ops (the decays, the conv, the q/k norm, the solve) and no view; the gated norm 1
# fused op; the layer with its input projections and out_proj 9 kernels + 12 views, of which the 4 Linear layers' own
# decompositions are 12 (before the fused ops: 17, 3 and 24 kernels + 13 views; before that 19 (20) + 6, and
# 29 (30) kernels; 29 kernels + 72 views before the views were made once)
CORE_MAX = 4  # the tree verification proper: decays, conv, q/k normalisation, solve and output
NORM_MAX = 1  # the gated output norm
LAYER_MAX = 21  # the whole layer (qwen3_5 layout: three input projections, out_proj)


def _counter() -> DispatchCount:
    """Ops as a GPU without graphs pays them in one layer: composites by what they dispatch, no stage booking."""
    return DispatchCount(stages=False, decompose=True)


@functools.cache
def _model(model_type: str, dtype: torch.dtype):
    # two value heads per key head, as Qwen3.5/3.6 (48 value / 16 key heads at 27B)
    return tiny_model(model_type, attn_implementation="sdpa", dtype=dtype, vocab_size=64,
                      linear_num_key_heads=2, linear_num_value_heads=4)


def _layer_and_cache(model):
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.arange(PROMPT)[None], cache=cache, use_cache=True)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    return layer, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_ops_per_gdn_layer(model_type, dtype, monkeypatch):
    """As the engine runs it (inference mode, the cache's shared buffers, a round's metadata built by the layer
    before), in ops (kernels and views): the tree verification <= 4, the gated norm <= 1, the whole layer with its
    projections <= 21."""
    model = _model(model_type, dtype)
    gdn.install()
    tree = tree_from_parents(list(range(len(PARENTS))), PARENTS)
    hidden = torch.randn(1, len(PARENTS), model.config.hidden_size, dtype=dtype)
    counter, norm = _counter(), _counter()

    def paused(fn):
        def run(*args, **kwargs):
            with counter.paused():
                return fn(*args, **kwargs)
        return run

    with torch.inference_mode():
        layer, cache = _layer_and_cache(model)
        with tree_verification(tree):
            layer(hidden, cache=cache)  # the round's first layer builds the metadata; the cache its constants
            whole = _counter()
            with whole:
                layer(hidden, cache=cache)
            real_norm, real_project = gdn.layer._gated_norm, gdn.layer._projections

            def counted_norm(*args):
                with norm:
                    return real_norm(*args)

            monkeypatch.setattr(gdn.layer, "_gated_norm", paused(counted_norm))
            monkeypatch.setattr(gdn.layer, "_projections", paused(real_project))
            monkeypatch.setattr(layer.out_proj, "forward", paused(layer.out_proj.forward))
            with counter:
                layer(hidden, cache=cache)
    def ops(c):
        return c.total(c.ops, exclude=())

    assert ops(counter) <= CORE_MAX, (dict(counter.kernel_names), dict(counter.view_names))
    assert ops(norm) <= NORM_MAX, (dict(norm.kernel_names), dict(norm.view_names))
    print(f"{model_type} {dtype}: tree verification {ops(counter)} {dict(counter.kernel_names)}; gated norm "
          f"{ops(norm)}; whole layer {whole.total(whole.kernel_ops)} kernels + {sum(whole.view_names.values())} views")
    if model_type != "qwen3_next":  # (its fused projections are reordered by upstream code: ~12 ops more)
        assert ops(whole) <= LAYER_MAX, (dict(whole.kernel_names), dict(whole.view_names))


def test_the_counter_counts_rms_norm_as_the_fused_kernel_a_gpu_runs():
    """decompose=True: F.rms_norm is one op (a GPU's _fused_rms_norm), not the CPU's decomposition (pow, mean, add_,
    rsqrt, mul, mul), where the weight has the input's dtype; with another weight dtype a GPU runs the composite too."""
    import warnings

    import torch.nn.functional as F

    x = torch.randn(2, 5, 8)
    counts = []
    for weight in (torch.ones(8), None, torch.ones(8, dtype=torch.float64)):
        c = _counter()
        with torch.inference_mode(), c, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the mismatched dtype's "cannot dispatch to fused implementation")
            F.rms_norm(x, (8,), weight, 1e-6)
        counts.append(c.total(c.kernel_ops, exclude=()))
    assert counts[:2] == [1, 1] and counts[2] > 1, counts


def test_tree_layer_compiles_without_graph_breaks():
    """tree_layer (one GDN layer's tree verification, its metadata and buffers passed in) is one graph."""
    from torch._dynamo.utils import counters

    model = _model("qwen3_5_text", torch.float32)
    tree = tree_from_parents(list(range(len(PARENTS))), PARENTS)
    hidden = torch.randn(1, len(PARENTS), model.config.hidden_size)
    with torch.no_grad():
        layer, cache = _layer_and_cache(model)
        conv, state = cache.get_conv_state(layer.layer_idx, 0), cache.get_recurrent_state(layer.layer_idx, 0)
        with tree_verification(tree) as ctx:
            meta = gdn.tree_meta(ctx, layer.conv_kernel_size, hidden.device)
        consts = gdn.layer_consts(layer)
        channels = layer.conv1d.weight.shape[0]
        eager_bufs = gdn.new_buffers(layer, hidden, consts, channels)
        want = gdn.tree_layer(layer, hidden, conv, state, meta, consts, eager_bufs)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(gdn.tree_layer, fullgraph=True, backend="eager")
        bufs = gdn.new_buffers(layer, hidden, consts, channels)
        got = compiled(layer, hidden, conv, state, meta, consts, bufs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bufs.deltas, eager_bufs.deltas, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_one_verification_context_serves_the_attention_and_the_gdn(monkeypatch):
    """TargetSession.verify sets one TreeVerification; the split tree attention and the GDN layers read that same
    object (one ContextVar), and nothing is left set afterwards."""
    import random

    from ddtree.engine import attention, verification
    from ddtree.engine.target import TargetSession
    from ddtree.testing.reference import random_tree

    assert attention.tree_verification is verification.tree_verification is gdn.tree_verification
    model = _model("qwen3_5_text", torch.float32)
    session = TargetSession(model, tree_attention="split")
    seen: dict[str, list] = {"attention": [], "gdn": []}
    for name, module in (("attention", attention), ("gdn", gdn.forward)):
        real = module._active_tree

        def spy(_real=real, _name=name):
            ctx = _real()
            if ctx is not None:
                seen[_name].append(ctx)
            return ctx

        monkeypatch.setattr(module, "_active_tree", spy)
    session.prefill(torch.arange(PROMPT)[None])
    tree = random_tree(9, 64, random.Random(1))
    assert not tree.is_chain
    session.verify(tree)
    contexts = {id(c) for c in seen["attention"] + seen["gdn"]}
    assert len(contexts) == 1 and seen["attention"] and seen["gdn"]
    assert verification.active() is None
