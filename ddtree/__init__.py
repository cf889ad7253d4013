"""ddtree: lossless speculative decoding (AR, DFlash, DDTree) on Hugging Face models.

    import ddtree
    result = ddtree.generate(target, drafter, input_ids, method="ddtree", budget=64)

Heavy modules load on first use, so `ddtree.errors` / config validation stay cheap.
"""

from importlib import import_module

from ddtree.errors import ConfigError

_ENGINE = ("generate", "GenerationResult", "DFlashDrafter", "DraftTree")  # ddtree.engine's lazy names

__all__ = [*_ENGINE, "ConfigError"]


def __getattr__(name):
    if name in _ENGINE:
        return getattr(import_module("ddtree.engine"), name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
