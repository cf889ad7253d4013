from .drafter import ToyDrafter, load_prompts, sample

__all__ = ["ToyDrafter", "load_prompts", "sample"]
