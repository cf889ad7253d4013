"""Tiny random models built from configs (tests, smoke runs). No downloads."""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)


def tiny_config(model_type: str = "qwen3", vocab_size: int = 128, num_hidden_layers: int = 4, **overrides):
    """A small config of a real transformers model type."""
    kw = dict(_COMMON, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers)
    if model_type in ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"):
        # hybrid: 3 GDN layers then 1 full-attention layer, repeated
        kw.update(layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                               for i in range(num_hidden_layers)],
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4)
        if "moe" in model_type or model_type == "qwen3_next":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def slow_decay_(model: PreTrainedModel, decay: float = 0.05) -> PreTrainedModel:
    """Make GDN layers remember: random A_log forgets within ~1 token and hides rollback bugs."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            with torch.no_grad():
                p.fill_(math.log(decay))
    return model


def tiny_model(model_type: str = "qwen3", seed: int = 0, attn_implementation: str = "eager",
               dtype: torch.dtype = torch.float32, slow_decay: bool = True, **config_overrides) -> PreTrainedModel:
    cfg = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    if slow_decay:
        slow_decay_(model)
    return model.eval()
