"""DFlash drafter: public checkpoint format, attention backends, sliding windows, context cache."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.engine.drafter import DFlashConfig, DFlashDrafter
from ddtree.errors import ConfigError
from ddtree.tiny import tiny_config, tiny_model

H = 64  # tiny_config hidden size


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3")


def make_drafter(layer_types=("sliding_attention", "full_attention"), window=5, seed=0, **kw) -> DFlashDrafter:
    return DFlashDrafter.random_for_target(tiny_config("qwen3"), num_layers=len(layer_types),
                                           layer_types=list(layer_types), sliding_window=window, seed=seed, **kw)


def inputs(drafter: DFlashDrafter, context: int = 20, block: int = 6, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n_ids = len(drafter.target_layer_ids)
    noise = torch.randn(batch, block, H, generator=g)
    features = torch.randn(batch, context, n_ids * H, generator=g)
    ctx_pos = torch.arange(context).expand(batch, -1)
    blk_pos = torch.arange(context, context + block).expand(batch, -1)
    return noise, features, ctx_pos, blk_pos


def reference_forward(drafter: DFlashDrafter, noise, features, ctx_pos, blk_pos) -> torch.Tensor:
    """Dense float64 DFlash forward from the state dict: softmax over an explicit |Δpos| < w mask."""
    cfg = drafter.config
    w = {k: v.double() for k, v in drafter.state_dict().items()}
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w[name]

    def lin(x, name):
        bias = w.get(name + ".bias")
        return x @ w[name + ".weight"].T + (0 if bias is None else bias)

    inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(x, pos):  # x [B, n, heads, d]
        angle = pos[..., None].double() * inv_freq
        cos, sin = torch.cat([angle.cos()] * 2, -1)[:, :, None], torch.cat([angle.sin()] * 2, -1)[:, :, None]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    b, q, _ = noise.shape
    context = rms(lin(features.double(), "fc"), "hidden_norm.weight")
    key_pos = torch.cat([ctx_pos, blk_pos], 1)
    delta = blk_pos[:, :, None] - key_pos[:, None, :]
    x = noise.double()
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, p + "input_layernorm.weight")
        kv_in = torch.cat([context, h], 1)
        queries = rope(rms(lin(h, p + "self_attn.q_proj").view(b, q, nh, d), p + "self_attn.q_norm.weight"), blk_pos)
        keys = rms(lin(kv_in, p + "self_attn.k_proj").view(b, -1, nkv, d), p + "self_attn.k_norm.weight")
        keys = rope(keys, key_pos).repeat_interleave(nh // nkv, dim=2)
        values = lin(kv_in, p + "self_attn.v_proj").view(b, -1, nkv, d).repeat_interleave(nh // nkv, dim=2)
        visible = torch.ones_like(delta, dtype=torch.bool)
        sliding = cfg.layer_types[i] == "sliding_attention"
        if sliding:
            visible &= delta.abs() < cfg.sliding_window
        # declared causality applies to every layer; undeclared, only sliding layers are causal
        if cfg.is_causal or (cfg.is_causal is None and sliding):
            visible &= delta >= 0
        scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) / math.sqrt(d)
        probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        x = x + lin(torch.einsum("bhqk,bkhd->bqhd", probs, values).reshape(b, q, -1), p + "self_attn.o_proj")
        h = rms(x, p + "post_attention_layernorm.weight")
        x = x + lin(torch.nn.functional.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"),
                    p + "mlp.down_proj")
    return rms(x, "norm.weight")


# ----- (1) checkpoint format -----

def test_save_load_round_trip(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} <= set(saved)
    assert not any(k.startswith("model.") or "rotary" in k for k in saved)

    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config == DFlashConfig.from_dict(drafter.config.to_dict() | {"dtype": "float32"})
    args = inputs(drafter)
    torch.testing.assert_close(loaded(*args), drafter(*args), rtol=0, atol=0)


def test_load_tolerates_model_prefix(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({f"model.{k}": v for k, v in state.items()}, tmp_path / "model.safetensors")
    args = inputs(drafter)
    torch.testing.assert_close(DFlashDrafter.from_pretrained(tmp_path)(*args), drafter(*args), rtol=0, atol=0)


def test_load_names_missing_and_unexpected_keys(tmp_path):
    make_drafter().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state.pop("hidden_norm.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"hidden_norm\.weight.*lm_head\.weight"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_load_dtype(tmp_path):
    cast = make_drafter().to(torch.bfloat16)
    assert cast.rotary_emb.inv_freq.dtype == torch.float32  # RoPE precision survives a cast
    cast.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert DFlashDrafter.from_pretrained(tmp_path).dtype == torch.bfloat16  # None = the checkpoint's
    assert DFlashDrafter.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16
    loaded = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.dtype == torch.float32 and loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert DFlashDrafter.from_pretrained(tmp_path, torch_dtype="float32").dtype == torch.float32
    with pytest.raises(ConfigError, match="drafter.dtype"):
        DFlashDrafter.from_pretrained(tmp_path, dtype="int8")


def test_random_init_is_seeded():
    a, b, c = make_drafter(seed=3), make_drafter(seed=3), make_drafter(seed=4)
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, c.fc.weight)
    assert abs(a.fc.weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.norm.weight, torch.ones(H))


# ----- (2) backends, (3) sliding windows -----

@pytest.mark.parametrize("is_causal", [None, True])
def test_eager_matches_sdpa(is_causal):
    drafter = make_drafter()
    drafter.config.is_causal = is_causal
    noise, features, ctx_pos, blk_pos = inputs(drafter)
    outs = []
    for name in ("eager", "sdpa"):
        drafter.set_attn_implementation(name)
        cache = drafter.new_cache()
        drafter(noise, features[:, :8], ctx_pos[:, :8], blk_pos, cache)
        outs.append(drafter(noise, features[:, 8:], ctx_pos[:, 8:], blk_pos, cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


def test_unknown_attn_implementation_is_config_error():
    with pytest.raises(ConfigError, match="attn_implementation.*'eager', 'sdpa'"):
        make_drafter().set_attn_implementation("flash_attention_2")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("layer_types", "is_causal"), [
    (("full_attention", "full_attention"), None),
    (("sliding_attention", "full_attention"), None),
    (("sliding_attention", "sliding_attention"), None),
    (("sliding_attention", "full_attention"), True),
])
def test_matches_dense_reference(layer_types, is_causal, attn):
    drafter = make_drafter(layer_types, window=5, attn_implementation=attn)
    drafter.config.is_causal = is_causal
    args = inputs(drafter, context=20, block=6)  # context 4x the window: the window matters
    torch.testing.assert_close(drafter(*args).double(), reference_forward(drafter, *args), rtol=0, atol=1e-5)


def test_window_changes_output():
    sliding = make_drafter(("sliding_attention", "sliding_attention"), window=5)
    full = make_drafter(("full_attention", "full_attention"), window=None)
    sliding.config.is_causal = full.config.is_causal = False  # compare the window alone
    full.load_state_dict(sliding.state_dict())
    args = inputs(sliding, context=20)
    assert (sliding(*args) - full(*args)).abs().max() > 1e-3
    # A window wider than every |Δpos| hides nothing.
    wide = make_drafter(("sliding_attention", "sliding_attention"), window=64)
    wide.config.is_causal = False
    wide.load_state_dict(sliding.state_dict())
    torch.testing.assert_close(wide(*args), full(*args), rtol=0, atol=1e-6)


# ----- (4) context cache -----

def test_cache_split_equals_one_call():
    drafter = make_drafter()
    noise, features, ctx_pos, blk_pos = inputs(drafter, context=13)
    whole = drafter(noise, features, ctx_pos, blk_pos)

    cache = drafter.new_cache()
    first_blk = torch.arange(7, 13).expand(2, -1)
    drafter(noise, features[:, :7], ctx_pos[:, :7], first_blk, cache)
    assert len(cache) == 7
    split = drafter(noise, features[:, 7:], ctx_pos[:, 7:], blk_pos, cache)
    assert len(cache) == 13
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)

    # No new context: the block's K/V were not kept, so the same call gives the same answer.
    again = drafter(noise, None, None, blk_pos, cache)
    assert len(cache) == 13
    torch.testing.assert_close(again, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
@pytest.mark.parametrize("layer_types", [("full_attention",), ("sliding_attention", "full_attention")])
def test_preallocated_cache_over_many_rounds_equals_whole_context(layer_types, grad):
    """Round after round (buffers growing past their hint), the cached drafter equals one call over the whole
    context: the plain path without a cache, and the float64 dense reference. Under inference mode (the engine's)
    the cache writes by index_copy_, under autograd into fresh views."""
    if not grad:
        with torch.inference_mode():
            return test_preallocated_cache_over_many_rounds_equals_whole_context(layer_types, True)
    drafter = make_drafter(layer_types, window=5)
    g = torch.Generator().manual_seed(3)
    n_ids, block = len(drafter.target_layer_ids), 6
    features = torch.randn(1, 96, n_ids * H, generator=g)
    cache = drafter.new_cache(capacity=8)  # far too small: exercises the doubling
    held = 0
    for c in (7, 1, 6, 3, 0, 5, 6, 2, 6, 1) * 2 + (19,):
        noise = torch.randn(1, block, H, generator=g)
        blk_pos = torch.arange(held + c, held + c + block)[None]
        out = drafter(noise, features[:, held: held + c], torch.arange(held, held + c)[None], blk_pos, cache)
        held += c
        assert len(cache) == held
        args = noise, features[:, :held], torch.arange(held)[None], blk_pos
        torch.testing.assert_close(out, drafter(*args), rtol=0, atol=1e-5)
        torch.testing.assert_close(out.double(), reference_forward(drafter, *args), rtol=0, atol=1e-5)
    assert cache.keys[0].shape[-2] >= held + block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [1.0, 0.5])
def test_rope_table_is_bitwise_the_qwen3_modules(dtype, scaling):
    """The drafter's RoPE forward (the module's formula without its no-op ops) against Qwen3RotaryEmbedding's."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary = make_drafter().rotary_emb
    rotary.attention_scaling = scaling
    x = torch.zeros(1, 1, 4, dtype=dtype)
    pos = torch.tensor([[0, 1, 5, 77, 4096, 131071]])
    got, want = rotary(x, pos), Qwen3RotaryEmbedding.forward(rotary, x, pos)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and torch.equal(g, w)


# ----- (5) compatibility with a target -----

def test_check_compatible(target):
    make_drafter().check_compatible(target)

    deeper = DFlashDrafter.random_for_target(tiny_config("qwen3", num_hidden_layers=8), target_layer_ids=[1, 7])
    with pytest.raises(ConfigError, match=r"target_layer_ids: \[7\] out of range .* 4 layers"):
        deeper.check_compatible(target)

    narrow = tiny_model("qwen3", hidden_size=32, head_dim=8, intermediate_size=64)
    with pytest.raises(ConfigError, match="hidden_size: drafter hidden size 64 != target hidden size 32"):
        make_drafter().check_compatible(narrow)

    with pytest.raises(ConfigError, match="mask_token_id: 200 is outside the target's vocabulary of 128"):
        make_drafter(mask_token_id=200).check_compatible(target)


# ----- (6) config: public field names, validation -----

def test_config_uses_public_field_names():
    drafter = make_drafter()
    raw = drafter.config.to_dict()
    assert raw["dflash_config"] == {"target_layer_ids": drafter.target_layer_ids, "mask_token_id": 127}
    assert raw["block_size"] == drafter.block_size == 16
    assert raw["num_target_layers"] == 4 and raw["sliding_window"] == 5 and raw["use_sliding_window"]
    assert raw["layer_types"] == ["sliding_attention", "full_attention"]
    assert DFlashConfig.from_dict(json.loads(json.dumps(raw))) == drafter.config


def test_config_reads_a_legacy_public_config():
    raw = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6, "torch_dtype": "bfloat16",
        "block_size": 8, "num_target_layers": 36, "attention_bias": True,
        "dflash_config": {"mask_token_id": 151669, "selector_rank": 4},
    }
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.target_layer_ids == [1, 33]  # the public fallback: spread over [1, L-3]
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg.dtype == "bfloat16" and cfg.layer_types == ["full_attention"] * 2
    out = cfg.to_dict()
    assert out["auto_map"] == raw["auto_map"] and out["dflash_config"]["selector_rank"] == 4
    assert DFlashConfig.from_dict(out) == cfg
    drafter = DFlashDrafter(cfg)
    assert "layers.0.self_attn.q_proj.bias" in drafter.state_dict()


@pytest.mark.parametrize(("change", "setting"), [
    ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"dflash_config": {"target_layer_ids": [], "mask_token_id": 1}}, "target_layer_ids"),
    ({"hidden_size": None, "head_dim": None}, "hidden_size"),
    ({"intermediate_size": 0}, "intermediate_size"),
])
def test_config_validation(change, setting):
    raw = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "head_dim": 16, "dflash_config": {"target_layer_ids": [1], "mask_token_id": 1}} | change
    with pytest.raises(ConfigError, match=setting):
        DFlashConfig.from_dict(raw)


@pytest.mark.parametrize("declared", [None, True])
def test_the_forward_over_a_fixed_cache_equals_the_growing_cache(declared):
    """FixedDrafterCache (the compiled round's drafter cache: fixed buffers, the length on the device, the context
    rows padded) under the drafter's one forward: the block's hidden states are the growing cache's (float64: the
    fixed cache attends over every row with `grouped_attention`), sliding windows and the padding included."""
    from ddtree.engine.drafter.model import FixedDrafterCache

    drafter = make_drafter(window=3, seed=4, is_causal=declared).double()
    q, width = 4, len(drafter.target_layer_ids) * H
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 9, width, generator=g, dtype=torch.float64)
    noise = torch.randn(1, q, H, generator=g, dtype=torch.float64)
    cache = drafter.new_cache()
    drafter(noise, feats[:, :6], torch.arange(6)[None], torch.arange(6, 6 + q)[None], cache)
    fixed = FixedDrafterCache.like(cache, 32)
    fixed.load(cache)
    ref = drafter(noise, feats[:, 6:8], torch.arange(6, 8)[None], torch.arange(8, 8 + q)[None], cache)
    count = torch.tensor([2])  # 3 context rows, 2 real: the block follows them, over the padding
    got = drafter(noise, feats[:, 6:9], (fixed.length + torch.arange(3))[None],
                  (fixed.length + count + torch.arange(q))[None],
                  FixedDrafterCache(fixed.keys, fixed.values, fixed.length, count, q))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert fixed.length.item() == cache.length == 8
