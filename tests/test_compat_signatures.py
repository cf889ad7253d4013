"""Signature pins for every transformers object a compat patch replaces or relies on.

A transformers upgrade that renames, reorders or adds a required parameter to any of these fails
here, loudly, before a patch silently stops matching what it wraps. Pins are parameter names,
kinds (*args, **kwargs, kw-only) and defaults; annotations are left out (their repr varies by Python).
When a pin fails: read the new code, re-check the patch (and its version range), then update the pin.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re

import pytest
import transformers

import compat
from compat.patches import qwen3_import_shims

_ATTN_SDPA = (
    "module",
    "query",
    "key",
    "value",
    "attention_mask",
    "dropout=0.0",
    "scaling=None",
    "is_causal=None",
    "position_bias=None",
    "**kwargs",
)
_ATTN_FLEX = (
    "module",
    "query",
    "key",
    "value",
    "attention_mask",
    "scaling=None",
    "softcap=None",
    "s_aux=None",
    "position_bias=None",
    "**kwargs",
)
_PROCESS_FLASH = (
    "query_length",
    "key_length",
    "is_causal",
    "dropout=0.0",
    "softmax_scale=None",
    "sliding_window=None",
    "use_top_left_mask=False",
    "softcap=None",
    "deterministic=None",
    "s_aux=None",
    "max_seqlen_q=None",
    "max_seqlen_k=None",
    "supports_mapping=None",
    "block_table=None",
    "cache_seqlens=None",
    "**kwargs",
)
_MODULE_GETATTR = ("self", "name")
_CAUSAL_LM_FORWARD = (
    "self",
    "input_ids=None",
    "attention_mask=None",
    "position_ids=None",
    "cache=None",
    "inputs_embeds=None",
    "labels=None",
    "use_cache=None",
    "logits_to_keep=0",
    "**kwargs",
)
_GDN_FORWARD = ("self", "hidden_states", "cache=None", "attention_mask=None", "**kwargs")

# every transformers target of the table (checked by test_every_transformers_target_is_pinned)
TARGET_PINS = {
    "transformers.modeling_utils:PreTrainedModel.__call__": ("self", "*args", "**kwargs"),
    "transformers.cache_utils:Cache.crop": ("self", "tokens_to_remove"),
    "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5Model.__getattr__": _MODULE_GETATTR,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeModel.__getattr__": _MODULE_GETATTR,
    "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLModel.__getattr__": _MODULE_GETATTR,
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeModel.__getattr__": _MODULE_GETATTR,
    "transformers.models.nemotron_h_omni.modeling_nemotron_h_omni:NemotronH_Omni_Reasoning_V3.__getattr__": _MODULE_GETATTR,
    "transformers.models.muse_glimmer.modeling_muse_glimmer:MuseGlimmerModel.__getattr__": _MODULE_GETATTR,
    "transformers.modeling_flash_attention_utils:_process_flash_attention_kwargs": _PROCESS_FLASH,
    "transformers.integrations.sdpa_attention:sdpa_attention_forward": _ATTN_SDPA,
    "transformers.models.qwen3.modeling_qwen3:eager_attention_forward": (
        "module",
        "query",
        "key",
        "value",
        "attention_mask",
        "scaling",
        "dropout=0.0",
        "**kwargs",
    ),
    "transformers.integrations.flex_attention:flex_attention_forward": _ATTN_FLEX,
    "transformers.modeling_utils:AttentionInterface._global_mapping['sdpa']": _ATTN_SDPA,
    "transformers.modeling_utils:AttentionInterface._global_mapping['flex_attention']": _ATTN_FLEX,
    # ddtree/engine/gdn/ (engine code, not a compat row; pinned here like every transformers target)
    "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5GatedDeltaNet.forward": _GDN_FORWARD,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeGatedDeltaNet.forward": _GDN_FORWARD,
    "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextGatedDeltaNet.forward": _GDN_FORWARD,
}

# what the patches call or rely on without replacing it
RELIED_ON_PINS = {
    "transformers.cache_utils:DynamicCache.__init__": (
        "self",
        "ddp_cache_data=None",
        "config=None",
        "offloading=False",
        "offload_only_non_sliding=False",
    ),
    "transformers.cache_utils:get_layer_types_and_kwargs": ("config",),
    "transformers.cache_utils:Cache.get_seq_length": ("self", "layer_idx=0"),
    # upstream-gdn-tree crops the attention layers of the authors' target cache itself
    "transformers.cache_utils:DynamicLayer.crop": ("self", "tokens_to_remove"),
    "transformers.modeling_flash_attention_utils:_lazy_define_process_function": ("flash_function",),
    "transformers.models.qwen3.modeling_qwen3:Qwen3ForCausalLM.forward": _CAUSAL_LM_FORWARD,
    "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5ForCausalLM.forward": _CAUSAL_LM_FORWARD,
    "transformers.modeling_utils:PreTrainedModel.get_input_embeddings": ("self",),
    "transformers.modeling_utils:PreTrainedModel.get_output_embeddings": ("self",),
}


@pytest.fixture(autouse=True)
def _unpatched():
    compat.revert()
    yield
    compat.revert()


def _resolve(target: str):
    module, _, qual = target.partition(":")
    key = None
    if m := re.fullmatch(r"(.*)\['(.+)'\]", qual):
        qual, key = m.groups()
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj[key] if key is not None else obj


def _params(obj) -> tuple[str, ...]:
    out = []
    for p in inspect.signature(obj).parameters.values():
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.default is not p.empty:
            text += f"={p.default!r}"
        out.append(("kw:" if p.kind == p.KEYWORD_ONLY else "") + text)
    return tuple(out)


@pytest.mark.parametrize("target", sorted({**TARGET_PINS, **RELIED_ON_PINS}))
def test_signature_pin(target):
    expected = {**TARGET_PINS, **RELIED_ON_PINS}[target]
    if importlib.util.find_spec(target.partition(":")[0]) is None:  # a family this transformers does not ship
        pytest.skip(f"{target.partition(':')[0]} is not in transformers {transformers.__version__}")
    assert _params(_resolve(target)) == expected, f"{target} changed: re-check the compat patch, then the pin"


@pytest.mark.parametrize("target", [t for t in qwen3_import_shims.PATCH.targets])
def test_qwen3_import_shims_targets_are_the_canonical_objects(target):
    """The shimmed names are re-exports: pinned as identity with their home (what the shim would install)."""
    name = target.rpartition(":")[2]
    home = qwen3_import_shims.HOMES[name][0]
    assert _resolve(target) is _resolve(home)


def test_every_transformers_target_is_pinned():
    shims = set(qwen3_import_shims.PATCH.targets)
    unpinned = [
        t
        for p in compat.PATCHES
        for t in p.targets
        if t.startswith("transformers") and t not in TARGET_PINS and t not in shims
    ]
    assert not unpinned, f"add signature pins for: {unpinned}"


def test_facts_the_patches_rely_on():
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin
    from transformers.modeling_utils import AttentionInterface

    assert issubclass(DYNAMIC_LAYER_TYPE_MAPPING["linear_attention"], LinearAttentionCacheLayerMixin)
    assert {"sdpa", "flex_attention", "flash_attention_2"} <= set(AttentionInterface._global_mapping)
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    assert "embed_tokens" not in vars(Qwen3_5Model) and hasattr(Qwen3_5Model, "get_input_embeddings")
