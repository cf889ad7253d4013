"""Each compat patch on code in the shape of what it fixes (tests/compat_fixtures/legacy_code.py).

Every test applies only the patch under test (compat.apply(only=[...])), checks the legacy code now
gives the result of an independent reference, and that without the patch the break is real.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from compat_fixtures import legacy_code
from transformers import DynamicCache

import compat
from compat.core import Patcher
from compat.patches import embedding_access, qwen3_import_shims
from ddtree.errors import ConfigError
from ddtree.tiny import tiny_config, tiny_model


@pytest.fixture(autouse=True)
def _clean_registry():
    compat.revert()
    yield
    compat.revert()


def only(patch_id: str) -> dict:
    [entry] = [e for e in compat.apply(only=[patch_id]) if e["id"] == patch_id]
    assert entry["status"] == "applied", entry
    return entry


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model("qwen3_5_text", seed=0)


def _filled_cache(n: int = 12) -> DynamicCache:
    cache = DynamicCache()
    torch.manual_seed(0)
    for layer in range(2):
        cache.update(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), layer)
    return cache


# --------------------------------------------------------------------------- cache-crop-absolute


def test_cache_crop_absolute_keeps_the_first_n_tokens():
    cache = _filled_cache(12)
    keys = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match="positive value"):  # the break the patch exists for
        legacy_code.rollback(cache, 10)
    only("cache-crop-absolute")
    legacy_code.rollback(cache, 10)
    assert cache.get_seq_length() == 10
    assert all(torch.equal(layer.keys, k[..., :10, :]) for layer, k in zip(cache.layers, keys, strict=True))
    legacy_code.rollback(cache, 10)  # crop to the current length: no-op, as in 4.x
    legacy_code.rollback(cache, 50)  # longer than the cache: no-op
    assert cache.get_seq_length() == 10
    cache.crop(max_length=7)  # the 4.x keyword
    assert cache.get_seq_length() == 7
    cache.crop(torch.tensor(5))  # a 0-d integer tensor, e.g. from .sum()
    assert cache.get_seq_length() == 5


def test_cache_crop_absolute_leaves_the_5x_api_alone():
    only("cache-crop-absolute")
    cache = _filled_cache(12)
    cache.crop(-3)
    assert cache.get_seq_length() == 9
    cache.crop(0)
    assert cache.get_seq_length() == 9
    cache.crop(tokens_to_remove=-4)
    assert cache.get_seq_length() == 5


# --------------------------------------------------------------------------- hybrid-cache-config


def test_hybrid_cache_config_bare_cache_works_on_a_hybrid(hybrid):
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))
    with pytest.raises(IndexError):  # the break: a bare DynamicCache on a hybrid target
        legacy_code.prefill_then_step(hybrid, ids)
    only("hybrid-cache-config")
    logits, cache = legacy_code.prefill_then_step(hybrid, ids)
    # reference: the same two steps with a cache built from the config
    ref_cache = DynamicCache(config=hybrid.config)
    with torch.no_grad():
        out = hybrid(ids, cache=ref_cache, use_cache=True)
        step = hybrid(out.logits[:, -1:].argmax(-1), cache=ref_cache, use_cache=True)
    ref = torch.cat([out.logits[:, -1:], step.logits[:, -1:]], dim=1)
    torch.testing.assert_close(logits, ref)
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in ref_cache.layers]
    assert cache.layer_class_to_replicate is None  # the caller's object was rebuilt in place


def test_hybrid_cache_config_leaves_pure_attention_models_alone(qwen3):
    only("hybrid-cache-config")
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    logits, cache = legacy_code.prefill_then_step(qwen3, ids)
    assert cache.layer_class_to_replicate is not None  # still the lazily filled bare cache
    with torch.no_grad():
        full = qwen3(torch.cat([ids, logits[:, :1].argmax(-1)], dim=1)).logits[:, -2:]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- cache-kwarg


def test_cache_kwarg_renames_past_key_values_without_warning(qwen3):
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = qwen3(ids, cache=DynamicCache(), use_cache=True).logits
    only("cache-kwarg")
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecation warning would raise here
        with torch.no_grad():
            out = qwen3(ids, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(out.logits, ref)
    assert cache.get_seq_length() == 6 and out.cache is cache


def test_cache_kwarg_keeps_past_key_values_for_forwards_that_take_it():
    from transformers import PreTrainedModel, Qwen3Config

    class LegacyDrafter(PreTrainedModel):  # like the authors' DFlashDraftModel: forward takes past_key_values
        config_class = Qwen3Config

        def __init__(self, config):
            super().__init__(config)
            self.post_init()

        def forward(self, x, past_key_values=None, **kwargs):
            return past_key_values, kwargs

    only("cache-kwarg")
    drafter = LegacyDrafter(tiny_config("qwen3"))
    marker = object()
    assert drafter(1, past_key_values=marker) == (marker, {})


def test_cache_kwarg_refuses_two_different_caches(qwen3):
    only("cache-kwarg")
    with pytest.raises(TypeError, match="both `cache=` and `past_key_values=`"):
        qwen3(torch.tensor([[1, 2]]), cache=DynamicCache(), past_key_values=DynamicCache())


# --------------------------------------------------------------------------- embedding-access


@pytest.fixture(scope="module")
def multimodal():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5_text").to_dict(), vision_config=vision)
    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration(cfg).eval()


def test_embedding_access_on_a_multimodal_wrapper(multimodal):
    ids = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(6))
    hidden = torch.randn(1, 4, 64)
    with pytest.raises(AttributeError):  # the break: .model nests the text model
        legacy_code.draft_inputs(multimodal, ids, hidden)
    only("embedding-access")
    emb, logits = legacy_code.draft_inputs(multimodal, ids, hidden)
    text = multimodal.model.language_model
    assert multimodal.model.embed_tokens is text.embed_tokens is multimodal.get_input_embeddings()
    torch.testing.assert_close(emb, text.embed_tokens(ids))
    torch.testing.assert_close(logits, multimodal.lm_head(hidden))
    with pytest.raises(AttributeError):
        multimodal.model.no_such_attribute  # noqa: B018 - other misses still raise
    assert not hasattr(multimodal.model, "lm_head")  # only the names the patch lists
    compat.revert()
    assert not hasattr(multimodal.model, "embed_tokens")


def test_embedding_access_does_not_change_model_construction(multimodal):
    from transformers import Qwen3_5ForConditionalGeneration

    only("embedding-access")
    torch.manual_seed(0)
    built = Qwen3_5ForConditionalGeneration(multimodal.config).eval()
    assert list(built.state_dict()) == list(multimodal.state_dict())
    assert built.get_input_embeddings() is built.model.language_model.embed_tokens


def test_embedding_access_lm_head_through_a_nested_causal_lm(qwen3):
    from torch import nn

    class Wrapper(nn.Module):  # the shape of a wrapper whose head lives on its nested causal LM
        def __init__(self, lm):
            super().__init__()
            self.language_model = lm

        def get_output_embeddings(self):
            return None

    p = Patcher("embedding-access")
    p.wrap(Wrapper, "__getattr__", embedding_access.make_fallback(("lm_head",)))
    try:
        assert Wrapper(qwen3).lm_head is qwen3.lm_head
    finally:
        p.undo()
    assert not hasattr(Wrapper(qwen3), "lm_head")
    only("embedding-access")
    from transformers.models.nemotron_h_omni import modeling_nemotron_h_omni as nemotron

    assert hasattr(vars(nemotron.NemotronH_Omni_Reasoning_V3)["__getattr__"], "__wrapped__")


# --------------------------------------------------------------------------- flash-s-aux


def _fa2_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """The signature of a flash kernel without attention sinks (FA2-style)."""


def _fa3_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    s_aux=None,
):
    """The signature of a flash kernel that takes sinks as `s_aux` (FA3 vllm-style)."""


def _no_window_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
):
    """A kernel without `window_size`."""


def _flash_kwargs(kernel, **call):
    """What transformers hands the kernel: the processing partial built from the kernel's signature."""
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    process = _lazy_define_process_function(kernel)
    base = dict(
        query_length=4,
        key_length=12,
        is_causal=False,
        dropout=0.0,
        softmax_scale=None,
        sliding_window=None,
        use_top_left_mask=False,
        softcap=None,
        deterministic=None,
    )
    return process(**{**base, **call})


def test_flash_s_aux_empty_is_dropped_and_real_sinks_are_never_dropped_silently():
    empty, sinks = torch.empty(0), torch.randn(4)
    assert "s_aux" not in _flash_kwargs(_fa2_varlen, s_aux=sinks)  # the silent drop the patch stops
    only("flash-s-aux")
    assert "s_aux" not in _flash_kwargs(_fa3_varlen, s_aux=empty)
    assert "s_aux" not in _flash_kwargs(_fa3_varlen, s_aux=None)
    assert _flash_kwargs(_fa3_varlen, s_aux=sinks)["s_aux"] is sinks
    assert "s_aux" not in _flash_kwargs(_fa2_varlen, s_aux=None)
    with pytest.raises(ConfigError, match="attention: the loaded flash-attention kernel takes no `s_aux`"):
        _flash_kwargs(_fa2_varlen, s_aux=sinks)


def test_flash_s_aux_reaches_kwargs_cached_before_apply():
    from transformers import modeling_flash_attention_utils as fa

    fa_before = fa._process_flash_kwargs_fn
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(_fa2_varlen)  # as if FA2 loaded earlier
    try:
        only("flash-s-aux")
        with pytest.raises(ConfigError, match="attention: the loaded flash-attention kernel takes no `s_aux`"):
            fa._process_flash_kwargs_fn(query_length=1, key_length=1, is_causal=True, s_aux=torch.ones(2))
        compat.revert()
        assert fa._process_flash_kwargs_fn.func is fa._process_flash_attention_kwargs
    finally:
        fa._process_flash_kwargs_fn = fa_before


# --------------------------------------------------------------------------- sliding-window


def _qkv(q_len=4, kv_len=12, heads=4, kv_heads=2, dim=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, heads, q_len, dim, generator=g),
        torch.randn(1, kv_heads, kv_len, dim, generator=g),
        torch.randn(1, kv_heads, kv_len, dim, generator=g),
    )


def _windowed_reference(q, k, v, window, causal):
    """Per query, softmax over exactly the keys flash-attention's window keeps (bottom-right aligned)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    rows = []
    for i in range(q_len):
        pos = kv_len - q_len + i
        keep = [j for j in range(kv_len) if abs(pos - j) <= window - 1 and (not causal or j <= pos)]
        scores = (q[:, :, i : i + 1] @ k[:, :, keep].transpose(-1, -2)) * q.shape[-1] ** -0.5
        rows.append(scores.softmax(-1) @ v[:, :, keep])
    return torch.cat(rows, dim=2).transpose(1, 2)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sliding_window_drafter_layer_keeps_its_window(impl):
    q, k, v = _qkv()
    layer = legacy_code.SlidingBlockAttention(4, 2, 8, sliding_window=3, impl=impl)
    ref = _windowed_reference(q, k, v, window=3, causal=False)
    assert not torch.allclose(layer(q, k, v, is_causal=False), ref, atol=1e-3)  # the silent full attention
    only("sliding-window")
    torch.testing.assert_close(layer(q, k, v, is_causal=False), ref, rtol=1e-5, atol=1e-5)
    short = _qkv(kv_len=3)  # keys within the window: nothing to mask, same as before
    torch.testing.assert_close(
        layer(*short, is_causal=False), _windowed_reference(*short, window=99, causal=False)
    )


def test_sliding_window_sdpa_causal_is_bottom_right():
    only("sliding-window")
    q, k, v = _qkv()
    layer = legacy_code.SlidingBlockAttention(4, 2, 8, sliding_window=3, impl="sdpa")
    torch.testing.assert_close(
        layer(q, k, v, is_causal=True), _windowed_reference(q, k, v, 3, causal=True), rtol=1e-5, atol=1e-5
    )


def test_sliding_window_refused_where_no_mask_can_be_built():
    only("sliding-window")
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="attention: flex_attention: sliding_window=3"):
        legacy_code.SlidingBlockAttention(4, 2, 8, sliding_window=3, impl="flex_attention")(q, k, v)
    with pytest.raises(ConfigError, match="no `window_size`"):
        _flash_kwargs(_no_window_varlen, sliding_window=3)
    assert _flash_kwargs(_fa2_varlen, sliding_window=3)["window_size"] == (2, 2)
    assert "window_size" not in _flash_kwargs(_no_window_varlen, sliding_window=20)  # window covers all keys


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sliding_window_native_models_unchanged(impl):
    model = tiny_model(
        "qwen3",
        seed=1,
        attn_implementation=impl,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=2,
    )
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(ids).logits
        only("sliding-window")
        torch.testing.assert_close(model(ids).logits, ref)


# --------------------------------------------------------------------------- qwen3-import-shims


_AUTHORS_IMPORT = """
from {name} import (
    Qwen3RMSNorm, Qwen3RotaryEmbedding, Qwen3Config, Qwen3PreTrainedModel, Qwen3MLP,
    GradientCheckpointingLayer, FlashAttentionKwargs, rotate_half, eager_attention_forward, ALL_ATTENTION_FUNCTIONS,
)
"""


def _stand_in_modeling_qwen3(without: tuple[str, ...]) -> types.ModuleType:
    """modeling_qwen3 as a future transformers might ship it: some incidental imports gone."""
    from transformers.models.qwen3 import modeling_qwen3

    module = types.ModuleType("compat_test_modeling_qwen3")
    module.__dict__.update(
        {k: v for k, v in vars(modeling_qwen3).items() if k not in without and not k.startswith("__")}
    )
    return module


def test_qwen3_import_shims_restore_vanished_names():
    stand_in = _stand_in_modeling_qwen3(("FlashAttentionKwargs", "GradientCheckpointingLayer", "Qwen3Config"))
    sys.modules[stand_in.__name__] = stand_in
    try:
        with pytest.raises(ImportError):
            exec(_AUTHORS_IMPORT.format(name=stand_in.__name__), {})
        patcher = Patcher("qwen3-import-shims")
        detail = qwen3_import_shims.install(patcher, stand_in)
        assert detail == "added GradientCheckpointingLayer, FlashAttentionKwargs, Qwen3Config"
        exec(_AUTHORS_IMPORT.format(name=stand_in.__name__), {})
        from transformers.modeling_layers import GradientCheckpointingLayer

        assert stand_in.GradientCheckpointingLayer is GradientCheckpointingLayer
        patcher.undo()
        assert not hasattr(stand_in, "FlashAttentionKwargs")
    finally:
        del sys.modules[stand_in.__name__]


def test_qwen3_import_shims_fail_loudly_on_renamed_definitions():
    stand_in = _stand_in_modeling_qwen3(("rotate_half",))
    with pytest.raises(RuntimeError, match="rotate_half"):
        qwen3_import_shims.install(Patcher("qwen3-import-shims"), stand_in)


def test_qwen3_import_shims_on_this_transformers():
    entry = only("qwen3-import-shims")
    assert "nothing missing: all 10 names present" in entry["detail"]
    exec(_AUTHORS_IMPORT.format(name="transformers.models.qwen3.modeling_qwen3"), {})
