"""LeanForward: bitwise the plain model call, on every family the table enables it for, every mask path."""

from __future__ import annotations

import random

import pytest
import torch

import ddtree
from ddtree.engine.families import FAMILIES
from ddtree.engine.forward import LeanLayer, RopeTables, lean_forward_for, lean_norm, lean_text_rotary
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import chain_tree, walk
from ddtree.testing.reference import hf_greedy, random_tree
from ddtree.tiny import tiny_model

LEAN = sorted(name for name, row in FAMILIES.items() if row.lean)
CASES = [(t, a, mode) for t in LEAN for a in ("eager", "sdpa") for mode in ("auto", "split", "dense")]


def _model(model_type: str, attn: str):
    return tiny_model(model_type, seed=2, attn_implementation=attn, vocab_size=80)


def test_the_table_enables_the_families_it_was_checked_on():
    assert LEAN == ["llama", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"]
    for name in LEAN:
        assert lean_forward_for(_model(name, "sdpa")) is not None
    assert lean_forward_for(_model("gemma2", "eager")) is None  # no row value: the plain call


def test_every_layer_of_the_lean_families_runs_as_a_lean_layer():
    """So the bitwise tests below exercise LeanLayer on every layer kind (attention, gated attention, GDN, MoE)."""
    for name in LEAN:
        lean = lean_forward_for(_model(name, "sdpa"))
        assert all(layer is not None for layer in lean.lean_layers), name
    # a layer class it was not checked against runs its own forward
    model = _model("qwen3", "sdpa")
    layer = model.model.layers[0]
    layer.__class__ = type("MyDecoderLayer", (type(layer),), {})
    assert not LeanLayer.supports(layer)
    assert lean_forward_for(model).lean_layers[0] is None
    # transformers' own output-capturing hooks (left by any output_hidden_states call) do not count
    model(torch.randint(0, 80, (1, 4)), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.model.layers[1].modules())
    assert lean_forward_for(model).lean_layers[1] is not None
    # a layer with a hook of anyone else's somewhere inside runs its own forward (and so calls the hook)
    calls = []
    model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    lean = lean_forward_for(model)
    assert lean.lean_layers[1] is None and lean.lean_layers[2] is not None
    TargetSession(model, None, capacity=64).prefill(torch.randint(0, 80, (1, 5)))
    assert calls == [1]
    # an accelerate hook (offload) on a submodule, however deep, sends the layer to its own forward too
    model.model.layers[2].mlp.down_proj._hf_hook = object()
    assert not LeanLayer.supports(model.model.layers[2]) and LeanLayer.supports(model.model.layers[3])


@pytest.mark.parametrize("cls", ["qwen3.Qwen3RMSNorm", "llama.LlamaRMSNorm", "qwen3_5.Qwen3_5RMSNorm",
                                 "qwen3_next.Qwen3NextRMSNorm", "qwen3_5_moe.Qwen3_5MoeRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_is_bitwise_the_module(cls, dtype):
    """One F.rms_norm call against the module's six-op formula: equal bit for bit on the CPU (fp32 and bf16).
    The same call serves every device (tests/test_gpu.py checks it on CUDA)."""
    import importlib

    family_dir, name = cls.split(".")
    norm_cls = getattr(importlib.import_module(f"transformers.models.{family_dir}.modeling_{family_dir}"), name)
    g = torch.Generator().manual_seed(0)
    for width in (32, 192, 1000):
        norm = norm_cls(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=g))
        fused = lean_norm(norm)
        assert fused is not norm.forward
        for shape in ((1, 1, width), (1, 17, width), (1, 5, 3, width)):
            x = (torch.randn(*shape, generator=g) * 3).to(dtype)
            assert torch.equal(fused(x), norm(x)), (cls, dtype, width, shape)
        with torch.no_grad():  # a weight changed in place after the first call: the fused call follows it
            norm.weight.mul_(-0.5)
        assert torch.equal(fused(x), norm(x)), (cls, dtype, width, "changed weight")


@pytest.mark.parametrize("family_dir", ["llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_tables_are_bitwise_the_modules_rope(family_dir, dtype):
    """RopeTables (4 ops a tensor) against each module's apply_rotary_pos_emb, full and partial rotary, with zeros of
    both signs among the inputs (x * 1 + x * 0 keeps the sign of a zero): equal bit for bit."""
    import importlib

    apply = importlib.import_module(f"transformers.models.{family_dir}.modeling_{family_dir}").apply_rotary_pos_emb
    g = torch.Generator().manual_seed(1)
    partial = family_dir not in ("llama", "qwen3")  # (those two rotate every dim)
    for head_dim, rotary in ((16, 16), (32, 32)) + (((16, 4), (64, 16)) if partial else ()):
        pos = torch.arange(9, dtype=torch.float32)[None, :, None] * torch.rand(rotary // 2, generator=g)
        angles = torch.cat([pos, pos], dim=-1) * 40
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        q, k = ((torch.randn(1, h, 9, head_dim, generator=g) * 2).to(dtype) for h in (4, 2))
        q[0, 0, 0, :4] = 0.0
        q[0, 0, 1, -4:] = -0.0
        tables = RopeTables()
        t = tables.tables(cos, sin, head_dim)
        assert tables.tables(cos, sin, head_dim)[0] is t[0]  # built once for a forward's (cos, sin)
        want_q, want_k = apply(q, k, cos, sin)
        for got, want in ((RopeTables.apply(q, t), want_q), (RopeTables.apply(k, t), want_k)):
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), (head_dim, rotary)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [1.0, 0.75])
def test_the_text_mrope_table_is_bitwise_the_modules(model_type, dtype, scaling):
    """lean_text_rotary (8 ops) against the module's three-row M-RoPE forward for text positions, bit for bit."""
    rotary = _model(model_type, "sdpa").model.rotary_emb
    rotary.attention_scaling = scaling
    fn = lean_text_rotary(rotary)
    assert fn is not None
    x = torch.zeros(1, 1, 4, dtype=dtype)
    pos = torch.tensor([[0, 1, 7, 300, 4095, 123457, 9, 9]])
    got, want = fn(x, pos), rotary.forward(x, pos[None].expand(3, *pos.shape))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and torch.equal(g, w)
    rotary.rope_type = "dynamic"
    assert lean_text_rotary(rotary) is None  # a dynamic RoPE rescales inv_freq: the module's forward


@pytest.mark.parametrize("model_type,attn,mode", CASES, ids=lambda v: str(v))
def test_lean_verify_is_bitwise_the_model_call(model_type, attn, mode, monkeypatch):
    """Same trees, same commits: logits and context features equal bit for bit, round after round."""
    from ddtree.engine import target as target_mod

    monkeypatch.setattr(target_mod, "CHAIN_PREFILL_MAX", 0)  # the same (plain) prefill for both
    model = _model(model_type, attn)
    layers = [0, model.config.num_hidden_layers - 1]  # a middle feature and the last (after the final norm)
    lean = TargetSession(model, layers, tree_attention=mode, capacity=256)
    plain = TargetSession(model, layers, tree_attention=mode, capacity=256, lean=False)
    assert lean.lean is not None and plain.lean is None
    ids = torch.randint(0, 80, (1, 11), generator=torch.Generator().manual_seed(0))
    (a, fa), (b, fb) = lean.prefill(ids), plain.prefill(ids)  # sdpa: the lean prefill too
    assert torch.equal(a, b) and torch.equal(fa, fb)
    rng = random.Random(4)
    root = torch.tensor(5)
    for n in (1, 7, 1, 24, 5, 1, 40):
        tree = random_tree(n, 80, rng, root=int(root)) if n % 2 == 0 else chain_tree(
            root, torch.randint(0, 80, (n - 1,), generator=torch.Generator().manual_seed(n)))
        (a, fa), (b, fb) = lean.verify(tree), plain.verify(tree)
        assert torch.equal(a, b) and torch.equal(fa, fb), (n, (a - b).abs().max(), (fa - fb).abs().max())
        w = walk(tree, a.argmax(-1))
        for s in (lean, plain):
            s.commit(tree, w.path)
        root = w.next_root


@pytest.mark.parametrize("model_type", LEAN)
def test_generations_through_the_lean_forward_equal_hf_greedy(model_type):
    model = _model(model_type, "sdpa")
    ids = torch.randint(0, 80, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = hf_greedy(model, ids, 16)
    assert ddtree.generate(model, None, ids, method="ar", max_new_tokens=16).output_ids == ref


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_greedy_trees_with_the_head_on_walked_rows_only_equal_hf_greedy(model_type, monkeypatch):
    """TargetSession.lazy_head on every tree (its size floor lowered): outputs still HF greedy's, and the head
    really read fewer rows than the trees had."""
    from ddtree.engine import target as target_mod

    monkeypatch.setattr(target_mod, "LAZY_HEAD_MIN", 2)
    monkeypatch.setattr(target_mod, "LAZY_TAIL_MIN", 2)  # and the last layer on those rows only (LazyTail)
    model = _model(model_type, "sdpa")
    drafter = ddtree.DFlashDrafter.random_for_target(model.config, block_size=6)
    rows, plain = [], model.lm_head.forward

    def counted(x):
        rows.append(x.shape[-2] if x.ndim > 1 else 1)
        return plain(x)

    monkeypatch.setattr(model.lm_head, "forward", counted)  # the lean forward calls the head's forward directly
    ids = torch.randint(0, 80, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(model, ids, 24)
    rows.clear()
    res = ddtree.generate(model, drafter, ids, method="ddtree", budget=30, max_new_tokens=24)
    assert res.output_ids == ref
    assert rows and sum(rows) < len(res.acceptance_lengths) * 31 / 2  # trees of 31 rows: the head read far fewer


@pytest.mark.parametrize("model_type", LEAN)
def test_the_lazy_last_layer_gives_the_full_forwards_rows_features_and_cache(model_type, monkeypatch):
    """verify(head=False) on a dense-mask tree: argmax, final rows and path features as the full verify's, the
    last layer run for the asked rows only, and the cache after the commit the full verify's too."""
    from ddtree.engine import target as target_mod

    monkeypatch.setattr(target_mod, "LAZY_TAIL_MIN", 2)
    model = _model(model_type, "sdpa")
    layers = [0, model.config.num_hidden_layers - 1]  # a middle feature and the last (the lazy rows)
    lazy, full = (TargetSession(model, layers, capacity=256) for _ in range(2))
    assert lazy.lean.lazy_tail == (not lazy.lean.linear[-1])
    ids = torch.randint(0, 80, (1, 11), generator=torch.Generator().manual_seed(0))
    lazy.prefill(ids), full.prefill(ids)
    rng = random.Random(7)
    root = 5
    for n in (40, 9, 64):
        tree = random_tree(n, 80, rng, root=root)
        rows, none = lazy.verify(tree, head=False)
        logits, feats = full.verify(tree)
        assert none is None
        w = walk(tree, logits.argmax(-1))
        asked = [0, *w.path_list[1:], n - 1]
        assert rows.argmax(asked) == logits[asked].argmax(-1).tolist()
        head = model.lm_head.forward(rows.final(asked))
        torch.testing.assert_close(head, logits[asked], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows.features(w.path_list), feats[:, w.path], rtol=1e-5, atol=1e-5)
        if lazy.lean.lazy_tail:
            assert len(rows.final.__self__._rows) == len(set(asked)) < n  # only the asked rows ran
        for s in (lazy, full):
            s.commit(tree, w.path)
        for a, b in zip(lazy.cache.layers, full.cache.layers, strict=True):
            for name in ("keys", "values", "conv_states", "recurrent_states"):
                x, y = getattr(a, name, None), getattr(b, name, None)
                if isinstance(x, torch.Tensor):
                    torch.testing.assert_close(x[..., : lazy.length, :] if name in ("keys", "values") else x,
                                               y[..., : full.length, :] if name in ("keys", "values") else y)
        root = w.tokens[-1]


HYBRIDS = [name for name in LEAN if FAMILIES[name].gdn]


@pytest.mark.parametrize("model_type", HYBRIDS)
@pytest.mark.parametrize("n", [2, 9, 64, 65])
def test_hybrid_chain_prefill_equals_the_plain_prefill(model_type, n, monkeypatch):
    """A short prompt on a CPU hybrid prefills as one committed chain: same logits, features and states."""
    from ddtree.engine import target as target_mod

    model = _model(model_type, "sdpa")
    ids = torch.randint(0, 80, (1, n), generator=torch.Generator().manual_seed(n))
    chain = TargetSession(model, [1, 3], capacity=256)
    seen = []
    monkeypatch.setattr(target_mod, "chain_tree", lambda *a: seen.append(1) or chain_tree(*a))
    a, fa = chain.prefill(ids)
    assert seen == ([1] if n <= target_mod.CHAIN_PREFILL_MAX else [])
    plain = TargetSession(model, [1, 3], capacity=256, lean=False)
    b, fb = plain.prefill(ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(fa, fb, atol=1e-5, rtol=0)
    assert chain.length == plain.length == n
    for x, y in zip(chain.cache.layers, plain.cache.layers, strict=True):
        if hasattr(x, "recurrent_states"):
            torch.testing.assert_close(x.conv_states[0], y.conv_states[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(x.recurrent_states[0], y.recurrent_states[0], atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(x.keys, y.keys, atol=1e-5, rtol=0)
    tok = torch.tensor([[7]])  # and the next token agrees
    (c, _), (d, _) = (s.verify(chain_tree(tok[0, 0], tok[0, 1:])) for s in (chain, plain))
    torch.testing.assert_close(c, d, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_a_cpu_sdpa_generation_never_takes_the_plain_model_call(model_type, monkeypatch):
    """Prefill, AR steps, DFlash chains and DDTree trees all go through the lean forward here."""
    from ddtree.engine.drafter import DFlashDrafter

    model = _model(model_type, "sdpa")
    drafter = DFlashDrafter.random_for_target(model.config, block_size=4, seed=0)
    ids = torch.randint(0, 80, (1, 70), generator=torch.Generator().manual_seed(2))
    prompts = (ids, ids[:, :12])  # past the chain prefill's bound, and within it
    refs = [hf_greedy(model, p, 9) for p in prompts]  # before the plain call is taken away

    def refuse(*args, **kwargs):
        raise AssertionError("the plain model call ran")

    monkeypatch.setattr(type(model), "forward", refuse)
    for method in ("ar", "dflash", "ddtree"):
        for prompt, ref in zip(prompts, refs, strict=True):
            assert ddtree.generate(model, drafter, prompt, method=method, budget=6, max_new_tokens=9).output_ids == ref


def test_the_loader_keeps_transformers_hub_kernels_off(tmp_path):
    """From 5.25 `from_pretrained` kernelizes a model wherever the `kernels` package is installed (hub kernels swapped
    into its norms, RoPE and GDN ops on a GPU): the pipeline's loader turns that off, so the model's own forward
    computes what the lean forward does; and the lean layer reads the plain RoPE function through its hub wrapper."""
    import transformers.models.qwen3.modeling_qwen3 as modeling

    from ddtree.engine.forward import _plain_function
    from ddtree.pipeline.models import load_checkpoint
    from ddtree.tiny import tiny_tokenizer

    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    loaded, _ = load_checkpoint(str(tmp_path), device="cpu", dtype=torch.float32, attn_implementation="eager")
    assert loaded.use_kernels is False
    rotary = _plain_function(modeling.apply_rotary_pos_emb)
    assert not isinstance(rotary, torch.nn.Module) and rotary.__name__ == "apply_rotary_pos_emb"
    layer = LeanLayer(loaded.model.layers[0])
    assert layer.rotary is rotary
