from .drafter import DFlashDraftModel
from .utils import extract_context_feature, load_and_process_dataset, sample

__all__ = ["DFlashDraftModel", "extract_context_feature", "load_and_process_dataset", "sample"]
