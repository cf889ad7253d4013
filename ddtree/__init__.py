"""ddtree: lossless speculative decoding (AR, DFlash, DDTree) on Hugging Face models.

    import ddtree
    result = ddtree.generate(target, drafter, input_ids, method="ddtree", budget=64)

Heavy modules load on first use, so `ddtree.errors` / config validation stay cheap.
"""

from importlib import import_module

_LAZY = {
    "generate": ("ddtree.engine.loop", "generate"),
    "GenerationResult": ("ddtree.engine.result", "GenerationResult"),
    "DFlashDrafter": ("ddtree.engine.drafter", "DFlashDrafter"),
    "DraftTree": ("ddtree.engine.tree", "DraftTree"),
    "ConfigError": ("ddtree.errors", "ConfigError"),
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(import_module(mod), attr)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
