"""The draft models: our DFlash drafter (the public checkpoint format, its forward and loader), DFlash2 (the same
body with convolutions and a candidate selector; DFlashDrafter.from_pretrained loads either) and the target's own
MTP head (Qwen3.5 / Qwen3.6 / Qwen3-Next, read from the target's checkpoint)."""

from ddtree.engine.drafter.config import DFlashConfig
from ddtree.engine.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from ddtree.engine.drafter.model import DFlashDrafter
from ddtree.engine.drafter.mtp import MTPHead

__all__ = ["DFlash2Config", "DFlash2Drafter", "DFlashConfig", "DFlashDrafter", "MTPHead"]
