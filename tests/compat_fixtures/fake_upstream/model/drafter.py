"""Stand-in for the authors' drafter module: the same import style, none of their code."""

import torch
from datasets import load_dataset
from transformers.models.qwen3.modeling_qwen3 import (
    FlashAttentionKwargs,
    GradientCheckpointingLayer,
    rotate_half,
)

IMPORTED = (FlashAttentionKwargs, GradientCheckpointingLayer, rotate_half)


class ToyDrafter(torch.nn.Module):
    """Proposes the last token repeated: enough to exercise verify / accept / rollback."""

    def propose(self, last_token: torch.Tensor, k: int) -> torch.Tensor:
        return last_token.repeat(1, k)


def sample(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def load_prompts(name: str):
    return load_dataset(name)
