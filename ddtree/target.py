"""The target side of a generation: prefill, verify a tree in one forward, commit the accepted path."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from .errors import ConfigError
from .tree import DraftTree, tree_attention_mask

# Families whose caches hold recurrent state. qwen3_5/qwen3_next GDN layers are made
# tree-exact by compat.gdn_tree; the others are refused for multi-token trees.
GDN_MODEL_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
UNSUPPORTED_STATEFUL = {
    "falcon_h1", "nemotron_h", "granitemoehybrid", "mamba", "mamba2", "lfm2", "lfm2_moe", "lfm2_vl",
    "jamba", "bamba", "zamba", "zamba2", "falcon_mamba", "recurrent_gemma", "rwkv", "minimax", "olmo_hybrid",
}


def model_type(model: PreTrainedModel) -> str:
    cfg = model.config
    text = getattr(cfg, "text_config", None)
    return getattr(text, "model_type", None) or cfg.model_type


def check_target_supported(model_type_name: str, method: str) -> None:
    """Refuse families whose verification would be silently wrong (before any generation)."""
    if method != "ar" and model_type_name in UNSUPPORTED_STATEFUL:
        raise ConfigError(
            "method", f"{method} on a '{model_type_name}' target is not supported: its recurrent layers cannot "
            "verify a draft tree or roll back rejected tokens exactly", "use method=ar for this model family")


def context_features(hidden_states: tuple, layer_ids: list[int]) -> torch.Tensor:
    """DFlash context features: hidden_states[i + 1] of each target layer id, concatenated."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class TargetSession:
    """One generation's target state: the cache, its committed length, feature extraction."""

    def __init__(self, model: PreTrainedModel, feature_layers: list[int] | None = None):
        self.model = model
        self.feature_layers = feature_layers
        self.hidden_ids = [i + 1 for i in feature_layers] if feature_layers else None
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.mtype = model_type(model)
        self.gdn = self.mtype in GDN_MODEL_TYPES
        if self.gdn:
            from compat import gdn_tree

            gdn_tree.install()  # idempotent; inert outside a tree_verification context
            self._gdn = gdn_tree

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 logits_to_keep: int = 0):
        kw = {}
        if self.hidden_ids:
            kw["output_hidden_states"] = self.hidden_ids
        out = self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                         use_cache=True, logits_to_keep=logits_to_keep, **kw)
        feats = context_features(out.hidden_states, self.feature_layers) if self.hidden_ids else None
        return out.logits[0], feats

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt; returns the last position's logits [V] and the prompt's features."""
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0)
        logits, feats = self._forward(input_ids, pos, None, logits_to_keep=1)
        self.length = n
        return logits[-1], feats

    @torch.inference_mode()
    def verify(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over [root] + nodes; logits [n, V] (row i: the target after node i)."""
        ids = tree.tokens.unsqueeze(0)
        pos = (tree.depths + self.length).unsqueeze(0)
        # a chain's ancestor mask is the causal mask the model builds itself
        mask = None if tree.is_chain else tree_attention_mask(tree, self.length, self.model.dtype)
        if self.gdn and len(tree) > 1:
            with self._gdn.tree_verification(tree.parents):
                return self._forward(ids, pos, mask)
        return self._forward(ids, pos, mask)

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        """Keep the committed prefix plus the accepted path (flat indices, root first); drop the rest."""
        n, k = len(tree), accepted.shape[0]
        contiguous = tree.is_chain  # a chain's accepted path is always its first k nodes
        for layer in self.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                continue  # GDN states are committed below
            if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
                raise NotImplementedError(f"cannot roll back a {type(layer).__name__} cache layer exactly")
            if not layer.is_initialized:
                continue
            if contiguous:
                layer.crop(k - n)
            else:
                keep = torch.cat([torch.arange(self.length, device=accepted.device), self.length + accepted])
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
        if self.gdn:
            if len(tree) > 1:
                self._gdn.commit_linear_states(self.cache, accepted)
        self.length += k
