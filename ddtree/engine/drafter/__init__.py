"""The draft models: our DFlash drafter (the public checkpoint format, its forward and loader) and the target's own
MTP head (Qwen3.5 / Qwen3.6 / Qwen3-Next, read from the target's checkpoint)."""

from ddtree.engine.drafter.model import DFlashConfig, DFlashDrafter
from ddtree.engine.drafter.mtp import MTPHead

__all__ = ["DFlashConfig", "DFlashDrafter", "MTPHead"]
