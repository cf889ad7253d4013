"""A lean target forward: the model's own modules driven directly, without the model-level wrappers.

A decode-sized forward of a small target is mostly host work, and about a tenth of it is spent above
the decoder layers: the output-capturing hooks and `ModelOutput` records, the config-default and
deprecation decorators, and a causal-mask build whose result the engine already knows (no mask for
a single token or a split tree verification; its own dense tree mask otherwise). `LeanForward` runs
the same modules in the same order — embeddings, rotary table, each decoder layer's forward, final
norm, head — so its logits and hidden states are bitwise those of `model(...)` (tested per family).

It only runs where that equality is known to hold: a family whose table row names its position
layout (`Family.lean`), the base model class that row was checked against, an eager or sdpa backend
(theirs or our tree wrapper of it), no sliding-window layers, no accelerate device map, and, per call,
a mask the engine knows (`TargetSession` decides). Everything else goes through `model(...)`.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ddtree.engine.families import MROPE_TEXT, ROPE, family, model_type

__all__ = ["LeanForward", "lean_forward_for"]


class LeanForward:
    """`model(input_ids, position_ids, attention_mask, cache)` for one supported model, minus the wrappers.

    Returns (logits [T', V], hidden states by index): hidden[0] is the embeddings, hidden[i] the output of
    decoder layer i - 1, the last one after the final norm, as `output_hidden_states` numbers them.
    """

    def __init__(self, model: PreTrainedModel, base: torch.nn.Module, positions: str):
        self.base = base
        self.head = model.lm_head
        self.layers = list(base.layers[: base.config.num_hidden_layers])
        types = getattr(base.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.linear = [t == "linear_attention" for t in types[: len(self.layers)]]
        self.positions = positions

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
                 keep: list[int] | None = None, logits_to_keep: int = 0) -> tuple[torch.Tensor, dict]:
        base = self.base
        hidden = base.embed_tokens.forward(ids)
        rope_ids = position_ids if self.positions == ROPE else position_ids[None].expand(3, *position_ids.shape)
        rope = base.rotary_emb.forward(hidden, rope_ids)
        wanted = set(keep or ())
        kept = {0: hidden} if 0 in wanted else {}
        last = len(self.layers)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, attention_mask=None if self.linear[i] else mask,
                                   position_embeddings=rope, position_ids=position_ids, cache=cache)
            if i + 1 in wanted and i + 1 != last:
                kept[i + 1] = hidden
        hidden = base.norm.forward(hidden)
        if last in wanted:
            kept[last] = hidden
        rows = hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
        return self.head.forward(rows), kept


# base model classes whose forward LeanForward reproduces (checked against transformers 5.24; tests/test_forward.py)
_BASES = {"Qwen3Model", "LlamaModel", "Qwen3NextModel", "Qwen3_5TextModel", "Qwen3_5MoeTextModel"}


def lean_forward_for(model: PreTrainedModel) -> LeanForward | None:
    """The lean forward of `model`, or None where the plain model call must run (see the module docstring)."""
    positions = family(model_type(model)).lean
    base = getattr(model, "model", None)
    if positions not in (ROPE, MROPE_TEXT) or type(base).__name__ not in _BASES or not hasattr(model, "lm_head"):
        return None
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        return None  # accelerate's hooks move activations between devices at the model level too
    if any(hasattr(m, "_hf_hook") for m in (model, base, base.embed_tokens, model.lm_head)):
        return None
    return LeanForward(model, base, positions)
