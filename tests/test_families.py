"""The model-family table (ddtree.engine.families) agrees with the code and with transformers."""

from __future__ import annotations

import importlib

import pytest
from transformers import CONFIG_MAPPING
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from compat.patches import embedding_access
from ddtree.engine import families, gdn
from ddtree.engine.families import FAMILIES, NESTED, family, model_type
from ddtree.engine.methods import METHOD_NAMES, check_target_supported, family_methods
from ddtree.errors import ConfigError
from ddtree.tiny import tiny_config, tiny_model


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_row_is_a_transformers_model_type_with_known_methods():
    for name, row in FAMILIES.items():
        assert name == row.model_type and name in CONFIG_MAPPING, name
        methods = family_methods(name)
        assert methods and set(methods) <= set(METHOD_NAMES) and methods[0] == "ar", name
        assert (row.embedding_access == NESTED) == (row.wrapper_class is not None), name
        assert ("mtp" in methods) == (row.mtp_layer is not None) == (row.mtp_norm is not None), name
        if row.mtp_layer:  # the MTP head is built from the family's own decoder layer and norm
            assert _load(row.mtp_layer).__name__.endswith("DecoderLayer"), name
            assert _load(row.mtp_norm).__name__.endswith("RMSNorm"), name


def test_gdn_rows_are_the_classes_the_gdn_module_wraps():
    assert {cls for cls in gdn.target_classes()} == {_load(p) for p in families.gdn_classes()}
    assert len(gdn.TARGETS) == len(families.gdn_classes())


@pytest.mark.parametrize("name", [n for n, r in FAMILIES.items() if r.hybrid_every and r.embedding_access != NESTED])
def test_tiny_hybrids_have_the_table_gdn_class_and_linear_cache_layers(name):
    model = tiny_model(name, num_hidden_layers=4)
    row = family(model_type(model))
    assert row.gdn and any(isinstance(m, _load(row.gdn_class)) for m in model.modules())
    assert any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=model.config).layers)


@pytest.mark.parametrize("name", [n for n, r in FAMILIES.items() if r.tiny_text])
def test_a_wrappers_tiny_model_is_tiny(name):
    """model.tiny.model_type=<a multimodal wrapper> builds the tiny text config inside the wrapper's (and a tiny
    vision tower), not the wrapper's full-size defaults (a Qwen3.5 wrapper's did not fit in 23 GB)."""
    text = tiny_config(name).get_text_config()
    assert (text.hidden_size, text.num_hidden_layers) == (64, 4)
    assert sum(p.numel() for p in tiny_model(name).parameters()) < 2_000_000


@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma2"])
def test_attention_rows_have_no_linear_cache_layers(name):
    cfg = tiny_config(name)
    assert not family(name).gdn and family_methods(name) == tuple(m for m in METHOD_NAMES if m != "mtp")  # but mtp
    assert not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=cfg).layers)


def test_ar_only_rows_are_refused_for_tree_methods_and_unknown_types_are_not():
    ar_only = [n for n in FAMILIES if family_methods(n) == ("ar",)]
    assert ar_only == [n for n, r in FAMILIES.items() if r.recurrent]
    assert "mamba2" in ar_only and "falcon_h1" in ar_only
    for name in ar_only:
        check_target_supported(name, "ar")
        with pytest.raises(ConfigError, match=name):
            check_target_supported(name, "ddtree")
    check_target_supported("some_future_model", "ddtree")  # unknown: the cache is checked at run time


def test_nested_embedding_rows_are_the_classes_compat_resolves():
    """compat may not import the engine, so its embedding-access patch keeps its own class list: the same one."""
    compat_classes = {f"{module}:{cls}" for module, cls, _ in embedding_access.CLASSES}
    table = {r.wrapper_class for r in FAMILIES.values() if r.embedding_access == NESTED}
    assert compat_classes == table


def test_model_type_reads_a_wrappers_text_config():
    from transformers import Qwen3_5Config

    cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5_text", vocab_size=12).to_dict())

    class Wrapped:
        config = cfg

    assert model_type(Wrapped()) == "qwen3_5_text" and family("qwen3_5").gdn
