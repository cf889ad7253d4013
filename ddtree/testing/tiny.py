"""Tiny random models built from configs (tests, smoke runs). No downloads."""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, PreTrainedModel

from ddtree.engine.families import auto_model_class, family

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)


def tiny_config(model_type: str = "qwen3", vocab_size: int = 128, num_hidden_layers: int = 4, **overrides):
    """A small config of a real transformers model type (its family's hints from ddtree.engine.families)."""
    row = family(model_type)
    kw = dict(_COMMON, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers, **row.tiny)
    if row.hybrid_every:  # hybrid: linear-attention (GDN) layers, every n-th one full attention
        kw["layer_types"] = [("full_attention" if (i + 1) % row.hybrid_every == 0 else "linear_attention")
                             for i in range(num_hidden_layers)]
    elif row.sliding_every:  # sliding-window layers, every n-th one full attention
        kw["layer_types"] = [("full_attention" if (i + 1) % row.sliding_every == 0 else "sliding_attention")
                             for i in range(num_hidden_layers)]
    if "vocab_size_per_layer_input" in AutoConfig.for_model(row.tiny_text or model_type).to_dict():  # Gemma 4
        kw["vocab_size_per_layer_input"] = kw["vocab_size"]
    kw.update(overrides)
    if row.tiny_text:  # a multimodal wrapper: the tiny text config inside it, a tiny vision tower beside
        return AutoConfig.for_model(model_type, text_config=AutoConfig.for_model(row.tiny_text, **kw).to_dict(),
                                    **row.tiny_outer)
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
    model = auto_model_class(model_type).from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    if slow_decay:
        slow_decay_(model)
    real_sinks_(model)
    return model.eval()


def real_sinks_(model: PreTrainedModel, std: float = 1.0) -> PreTrainedModel:
    """Attention sinks (gpt-oss) of a real model's spread: initialised near 0 they barely move a row's weights."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
