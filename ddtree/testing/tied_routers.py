"""Tiny MoE targets whose routers tie on purpose (tests of the verdict's shape ties: docs/validation.md)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ddtree.engine.families import family
from ddtree.tiny import tiny_model


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
