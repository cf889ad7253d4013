"""Tiny random models built from configs (tests, smoke runs). No downloads."""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ddtree.engine.families import family

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
    if "vocab_size_per_layer_input" in AutoConfig.for_model(model_type).to_dict():  # Gemma 4's per-layer inputs
        kw["vocab_size_per_layer_input"] = kw["vocab_size"]
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


def tie_routers_(model: PreTrainedModel, nudged: int = 4, amplify: float = 2.0) -> PreTrainedModel:
    """Routers that tie on purpose: every MoE layer's expert 1 scores like expert 0 to within bf16 rounding (its
    router row equals expert 0's but for `nudged` weights, each one representable step away), and the experts'
    weights are scaled by `amplify` so that picking the other one moves the logits far. In bf16 the target then
    picks other experts for the same token when the shape of the computation changes (one forward over the
    sequence, a cached step, a verification block): the target disagreeing with itself (docs/validation.md)."""
    from ddtree.engine.routing import routers

    with torch.no_grad():
        for _, router, block in routers(model):
            w = router.weight
            w[1] = w[0]
            up, down = torch.tensor(float("inf"), dtype=w.dtype), torch.tensor(float("-inf"), dtype=w.dtype)
            for c in range(nudged):
                w[1, c] = torch.nextafter(w[0, c], up if c % 2 == 0 else down)
            for name, p in block.named_parameters():
                if name.startswith("experts."):
                    p.mul_(amplify)
    return model


def tied_router_model(model_type: str = "qwen3_moe", seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny bf16 MoE target of two experts, one chosen a token, whose routers tie on purpose (tie_routers_)."""
    key = next(k for k in ("num_local_experts", "n_routed_experts", "num_experts") if k in family(model_type).tiny)
    experts = {key: 2}
    model = tiny_model(model_type, seed=seed, dtype=torch.bfloat16, attn_implementation="sdpa",
                       num_experts_per_tok=1, **experts, **overrides)
    return tie_routers_(model)
