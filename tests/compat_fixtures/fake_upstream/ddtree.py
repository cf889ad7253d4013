"""Stand-in for the authors' ddtree.py: imports its siblings by top-level name."""

from dflash import cuda_time, dflash_generate
from loguru import logger
from model import ToyDrafter

__all__ = ["ToyDrafter", "cuda_time", "ddtree_generate"]


def ddtree_generate(target, input_ids, max_new_tokens, block_size=4):
    logger.info("ddtree_generate (stand-in: a chain is a tree)")
    return dflash_generate(target, input_ids, max_new_tokens, block_size)
