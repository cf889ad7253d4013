"""Code in the shape of 4.x-era speculative decoding loops; each compat patch is tested on it."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def rollback(cache, keep: int) -> None:
    """After verification: keep the first `keep` tokens (4.x: crop takes the absolute length)."""
    cache.crop(keep)


def prefill_then_step(target, input_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Prefill with a bare DynamicCache, then feed the greedy token; returns both logits rows and the cache."""
    cache = DynamicCache()
    out = target(input_ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    step = target(nxt, past_key_values=cache, use_cache=True)
    return torch.cat([out.logits[:, -1:], step.logits[:, -1:]], dim=1), cache


def draft_inputs(target, block_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a DFlash drafter reads from its target: the input embeddings and the LM head."""
    return target.model.embed_tokens(block_ids), target.lm_head(hidden)


class SlidingBlockAttention(nn.Module):
    """A drafter attention layer: non-causal block queries over [context || block] keys, sliding window,
    called with attention_mask=None like the DFlash drafters do."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int, impl: str):
        super().__init__()
        self.num_key_value_groups = num_heads // num_kv_heads
        self.scaling = head_dim**-0.5
        self.is_causal = False
        self.sliding_window = sliding_window
        self.impl = impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.impl == "eager":
            from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward as attn_fn
        else:
            attn_fn = ALL_ATTENTION_FUNCTIONS[self.impl]
        out, _ = attn_fn(
            self,
            q,
            k,
            v,
            None,
            dropout=0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return out
