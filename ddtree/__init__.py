"""ddtree: lossless speculative decoding (AR, DFlash, DDTree) on Hugging Face models.

    import ddtree
    result = ddtree.generate(target, drafter, input_ids, method="ddtree", budget=64)

    engine = ddtree.Engine(target, drafter, method="ddtree", budget=64)  # many prompts: set up once
    results = [engine.generate(ids) for ids in prompts]

Heavy modules load on first use, so `ddtree.errors` / config validation stay cheap.
"""

from importlib import import_module

from ddtree.errors import ConfigError

_ENGINE = ("generate", "Engine", "GenerationResult", "DFlashDrafter", "DraftTree")  # ddtree.engine's lazy names

__all__ = [*_ENGINE, "ConfigError"]


def __getattr__(name):
    if name in _ENGINE:
        return getattr(import_module("ddtree.engine"), name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
