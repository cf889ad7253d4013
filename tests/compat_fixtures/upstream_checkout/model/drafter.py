"""Stand-in DFlash drafter class: the public checkpoint's module names, the authors' call interface.

`forward(position_ids, noise_embedding, target_hidden, past_key_values, use_cache, ...)` appends the
new context's and the block's keys/values to a transformers DynamicCache; the caller crops the block
away. Every block query sees every cached context key and every block key (non-causal).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def _rotate(x, cos, sin):
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class _Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        width, kv_width = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, cache):
        bsz, q_len, _ = x.shape
        both = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(bsz, both.shape[1], -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(bsz, both.shape[1], -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos[:, -q_len:], sin[:, -q_len:]), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attended = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o_proj(attended.transpose(1, 2).reshape(bsz, q_len, -1))


class _Layer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = _Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    config_class = Qwen3Config

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.block_size = config.block_size
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    @property
    def device(self):
        return self.fc.weight.device

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs):
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, cos, sin, past_key_values)
        return self.norm(x)
