"""Hybrid cache construction: a bare `DynamicCache()` handed to a hybrid model is built from its config.

Hybrid models (qwen3_5, qwen3_5_moe, qwen3_next, ...) need `DynamicCache(config=...)`: a bare
`DynamicCache()` lazily creates plain attention layers, and the first linear-attention layer fails
(IndexError). Code written for pure-attention targets does `cache = DynamicCache()` and then passes
it to the model. The fix runs in `PreTrainedModel.__call__`: when the cache passed as `cache=` or
`past_key_values=` is a config-less, still empty `DynamicCache` and the model's config has
linear-attention layers, that same object is re-initialised in place with the model's config. In
place, because the caller keeps its reference and passes it again next round.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..core import UPSTREAM, Patch, Patcher, resolve

ID = "hybrid-cache-config"
TARGET = ("transformers.modeling_utils", "PreTrainedModel.__call__")


def is_hybrid(config: Any) -> bool:
    """Whether `config` describes layers whose cache is a linear-attention (recurrent) state."""
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        LinearAttentionCacheLayerMixin,
        get_layer_types_and_kwargs,
    )

    try:
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config we cannot read is not treated as hybrid
        return False
    for layer_type in layer_types:
        layer_cls = DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
        if isinstance(layer_cls, type) and issubclass(layer_cls, LinearAttentionCacheLayerMixin):
            return True
    return False


def is_bare_empty(cache: Any) -> bool:
    """A `DynamicCache()` made without config that has not stored anything yet."""
    from transformers.cache_utils import DynamicCache

    return (
        type(cache) is DynamicCache
        and len(cache.layers) == 0
        and getattr(cache, "layer_class_to_replicate", None) is not None
    )


def build_from_config(cache: Any, config: Any) -> None:
    """Re-initialise a bare, empty `DynamicCache` in place as `DynamicCache(config=config)`."""
    from transformers.cache_utils import DynamicCache

    DynamicCache.__init__(
        cache,
        config=config,
        offloading=cache.offloading,
        offload_only_non_sliding=getattr(cache, "only_non_sliding", False),
    )


def fill_hybrid_cache(wrapped, instance, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and instance is not None and is_bare_empty(cache):
        config = getattr(instance, "config", None)
        if config is not None and is_hybrid(config):
            build_from_config(cache, config)
    return wrapped(*args, **kwargs)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    owner, _, _ = resolve(TARGET[0], TARGET[1])
    resolve("transformers.cache_utils", "get_layer_types_and_kwargs")
    resolve("transformers.cache_utils", "LinearAttentionCacheLayerMixin")
    patcher.wrap(owner, "__call__", fill_hybrid_cache)
    return "config-less empty DynamicCache passed to a hybrid model is built from the model config"


PATCH = Patch(
    id=ID,
    targets=(":".join(TARGET),),
    versions={"transformers": ">=5.0"},
    reason="hybrid targets need DynamicCache(config=...); a bare DynamicCache() raises IndexError",
    install=install,
    for_engines=frozenset({UPSTREAM}),
    condition_doc="at call time: the model's config has linear-attention layers",
)
