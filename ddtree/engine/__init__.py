"""The engine: a plain library (no Hydra, no MLflow). One loop for every method:
propose a tree -> verify it in one target forward -> walk it -> commit the accepted path.

    from ddtree.engine import generate, DFlashDrafter
"""

from importlib import import_module

_LAZY = {
    "generate": ("ddtree.engine.loop", "generate"),
    "Engine": ("ddtree.engine.loop", "Engine"),
    "GenerationResult": ("ddtree.engine.result", "GenerationResult"),
    "DFlashDrafter": ("ddtree.engine.drafter", "DFlashDrafter"),
    "DFlashConfig": ("ddtree.engine.drafter", "DFlashConfig"),
    "DraftTree": ("ddtree.engine.tree", "DraftTree"),
    "TargetSession": ("ddtree.engine.target", "TargetSession"),
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(import_module(mod), attr)
    raise AttributeError(f"module 'ddtree.engine' has no attribute {name!r}")
