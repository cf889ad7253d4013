"""Our DFlash drafter: the public checkpoint format (config, weights), its forward and its loader."""

from ddtree.engine.drafter.model import DFlashConfig, DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]
