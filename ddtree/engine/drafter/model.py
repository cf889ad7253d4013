"""The DFlash drafter: a small block-diffusion transformer conditioned on target hidden states.

Reads and writes the public DFlash checkpoint format (a Qwen3-style config.json with
`block_size`, `num_target_layers`, optional `layer_types`/`sliding_window` and
`dflash_config: {target_layer_ids, mask_token_id}`, plus safetensors weights). The drafter
has no embeddings and no lm_head: it reads the target's.

One forward drafts a block. Queries come from the block `[last token, mask, mask, ...]`;
keys/values from `[context ‖ block]`, where the context is `hidden_norm(fc(features))` of the
target's hidden states. Full-attention layers are non-causal: every block query sees every
context key and every block key. A sliding-window layer shows a key to a query iff
|pos_q - pos_k| < window. Causality follows the public checkpoints: `is_causal` (top level) or
`dflash_config.causal` when declared, applied to every layer; when absent, sliding layers are
causal and full layers are not (as the public DFlash code does for sliding-window drafters).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.activations import SiLUActivation
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
)

from ddtree.engine.drafter.config import DFlashConfig, _normalized_rope, evenly_spaced_layer_ids
from ddtree.engine.fixed_kv import grouped_attention, grouped_bias, kv_buffers
from ddtree.engine.forward import RopeTables, rope_cos_sin
from ddtree.engine.kernels.attention import silu_mul
from ddtree.engine.sharded import embedding_rows
from ddtree.errors import ConfigError

ATTN_IMPLEMENTATIONS: dict[str, Callable[..., tuple[torch.Tensor, Any]]] = {
    "eager": eager_attention_forward,
    "sdpa": sdpa_attention_forward,
}
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"




class _RotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3 RoPE whose frequencies stay fp32 when the drafter is cast, as transformers keeps them at load.
    A default RoPE's forward is the module's formula without its no-op ops (ddtree.engine.forward.rope_cos_sin)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_type != "default":  # (a dynamic RoPE rescales inv_freq in the module's decorator)
            return super().forward(x, position_ids)
        return rope_cos_sin(x, position_ids, self.inv_freq, self.attention_scaling)

    def _apply(self, fn: Callable, recurse: bool = True) -> _RotaryEmbedding:
        kept = dict(self.named_buffers(recurse=False))
        super()._apply(fn, recurse)
        for name, buffer in kept.items():
            setattr(self, name, buffer.to(getattr(self, name).device))
        return self


class _RMSNorm(Qwen3RMSNorm):
    """Qwen3RMSNorm (same weight) in one fused call instead of six small ones (four with the casts): the
    normalisation in float32 and the weight's product in float32 too, rounded once to the input's dtype (the module
    rounds the normalised row, then its product with the weight; in float32 the two are the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # (a mixed-dtype call is not fused: the module's formula, float32 inside)
            return F.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon) * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


class DrafterCache:
    """Context keys/values of every drafter layer (after k_norm and RoPE) in preallocated buffers.

    Layout per layer: [B, kv heads, capacity, d]; rows [:len) hold the context, and a forward writes
    its new context and then its block right behind it, so attention reads one view, with no
    concatenation. The block rows are overwritten by the next call (only context is kept). Buffers
    grow by doubling when `capacity` was short (a copy of the context, amortised O(1) per token).
    The context is the committed sequence in order: row r holds position r, and each block's positions follow the
    context's (as `DrafterBlock` writes them); a sliding layer reads only the rows its window can reach.
    """

    def __init__(self, num_layers: int, capacity: int = 0):
        self.capacity_hint = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # full buffers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [B, capacity] long: position of each row
        self.length = 0  # context rows held
        self._new_rows: tuple | None = None  # ((length, n, device, inference), arange(length, length + n))
        self._row_views: list[tuple | None] = [None] * num_layers  # (keys, values, both transposed): write_rows

    def __len__(self) -> int:
        return self.length

    def _reserve(self, buffer: torch.Tensor | None, like: torch.Tensor, rows: int) -> torch.Tensor:
        """`buffer` with room for `rows` rows along dim -2, shaped like `like` elsewhere."""
        if buffer is not None and buffer.shape[-2] >= rows:
            return buffer
        size = max(rows, self.capacity_hint, 64, 2 * (0 if buffer is None else buffer.shape[-2]))
        grown = like.new_empty(*like.shape[:-2], size, like.shape[-1])
        if buffer is not None:
            grown[..., : self.length, :].copy_(buffer[..., : self.length, :])
        return grown

    def _rows(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(len, len + n): the rows a forward writes, made once for its positions and every layer."""
        key = (self.length, n, device, torch.is_inference_mode_enabled())
        if self._new_rows is None or self._new_rows[0] != key:
            self._new_rows = key, torch.arange(self.length, self.length + n, device=device)
        return self._new_rows[1]

    def write_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Positions of [context ‖ new rows]: the new rows are written at [len, len + n)."""
        n = position_ids.shape[1]
        buffer = self.positions
        if buffer is None or buffer.shape[-1] < self.length + n:
            buffer = self._reserve(None if buffer is None else buffer.unsqueeze(-1), position_ids.unsqueeze(-1),
                                   self.length + n).squeeze(-1)
        buffer.index_copy_(1, self._rows(n, buffer.device), position_ids)
        self.positions = buffer
        return buffer[:, : self.length + n]

    def write_rows(self, layer_idx: int, keys: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """write() of keys and values in their projections' layout [B, n, kv heads, d]: into the buffers' transposed
        views (made once per buffer) where no autograd records, else transposed into write()."""
        end = self.length + keys.shape[1]
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if (k is None or k.shape[-2] < end or v.shape[-2] < end
                or (torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad))):
            return self.write(layer_idx, keys.transpose(1, 2), values.transpose(1, 2))
        views = self._row_views[layer_idx]
        if views is None or views[0] is not k or views[1] is not v:
            views = self._row_views[layer_idx] = k, v, k.transpose(1, 2), v.transpose(1, 2)
        rows = self._rows(keys.shape[1], k.device)
        views[2].index_copy_(1, rows, keys)
        views[3].index_copy_(1, rows, values)
        return k[..., :end, :], v[..., :end, :]

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new rows (context then block) at [len, len + n); return views of [:len + n)."""
        end = self.length + keys.shape[-2]
        k = self.keys[layer_idx] = self._reserve(self.keys[layer_idx], keys, end)
        v = self.values[layer_idx] = self._reserve(self.values[layer_idx], values, end)
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            # a forward that records autograd: in place on fresh views of the buffers
            k[..., self.length: end, :].copy_(keys)
            v[..., self.length: end, :].copy_(values)
        else:  # one op each, at the rows shared by every layer
            rows = self._rows(keys.shape[-2], k.device)
            k.index_copy_(-2, rows, keys)
            v.index_copy_(-2, rows, values)
        return k[..., :end, :], v[..., :end, :]

    def mask(self, block_position_ids: torch.Tensor, key_positions: torch.Tensor, window: int | None, causal: bool,
             dtype: torch.dtype, groups: int) -> tuple[torch.Tensor | None, int]:
        """(mask, first) of a layer's attention over this forward's keys (`key_positions`, from `write_positions`):
        the additive mask of `_visibility_mask` over the key rows from `first` on. Context row r holds position r and
        the block follows the context: a key row below `context rows - window + 1` is outside every query's window,
        so a sliding layer never reads it. (groups: unused here, see FixedDrafterCache.mask)"""
        rows = key_positions.shape[1] - block_position_ids.shape[1]  # the context rows, the new ones included
        first = max(0, rows - window + 1) if window is not None else 0
        return _layer_mask(block_position_ids, key_positions, window, causal, dtype, first), first

    attend = None  # the drafter's own attention function (its attn_implementation) reads this cache

    def advance(self, context_rows: int) -> None:
        """Keep the `context_rows` context rows the last forward wrote; its block rows become free."""
        self.length += context_rows


class FixedDrafterCache:
    """DrafterCache in buffers of a fixed capacity, its length on the device: the cache of the compiled round's
    drafter forward (ddtree.engine.drafter.model_static.StaticDraft), which runs `DFlashDrafter.forward` over it.

    keys, values: one [1, kv heads, Cd, d] buffer per layer (row r holds position r, as in DrafterCache); length
    [1]: the context rows held; count [1]: the real rows among a forward's context rows (the rest is padding: a
    forward's positions are its rows, its `block` last rows follow the real ones and overwrite the padding). Attention reads
    every row under a mask that hides those not yet written (`mask`: `grouped_bias`'s layout for `attend`)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: torch.Tensor,
                 count: torch.Tensor | None = None, block: int = 0):
        self.keys, self.values, self.length, self.count, self.block = keys, values, length, count, block
        self.rows: tuple[torch.Tensor, ...] = ()  # the rows a forward writes (its positions): context, then block

    @classmethod
    def like(cls, cache: DrafterCache, capacity: int) -> FixedDrafterCache:
        """Zeroed buffers of `capacity` rows shaped and typed as `cache`'s (static addresses)."""
        keys, values = kv_buffers(len(cache.keys), cache.keys[0], capacity)
        length = torch.zeros(1, dtype=torch.long, device=keys[0].device)
        torch._dynamo.mark_static_address(length)
        return cls(keys, values, length)

    def fits(self, cache: DrafterCache, capacity: int) -> bool:
        return self.keys[0].shape[-2] == capacity and self.keys[0].dtype == cache.keys[0].dtype

    def load(self, cache: DrafterCache) -> None:
        """`cache`'s context rows into the buffers (an eager forward's, the first round's)."""
        rows = cache.length
        for mine, theirs in ((self.keys, cache.keys), (self.values, cache.values)):
            for buf, src in zip(mine, theirs, strict=True):
                buf[..., :rows, :].copy_(src[..., :rows, :])
        self.length.fill_(rows)

    def write_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The forward's positions [1, n] are the rows it writes; the keys are every row of the buffers."""
        rows = position_ids[0]
        self.rows = (rows[:-self.block], rows[-self.block:]) if rows.shape[0] > self.block else (rows,)
        return torch.arange(self.keys[0].shape[-2], device=position_ids.device)[None]

    def write_rows(self, layer_idx: int, keys: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, n, kv heads, d] into their rows (in the buffers' layout: a write into a view of a
        compiled graph's input buffer is a copy of all of it), the context's, then the block's (over the context's
        padding); returns the whole buffers."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        for buf, new in ((k, keys), (v, values)):
            new = new.transpose(1, 2).to(buf.dtype)
            start = 0
            for rows in self.rows:
                buf.index_copy_(-2, rows, new[..., start: start + rows.shape[0], :])
                start += rows.shape[0]
        return k, v

    def mask(self, block_position_ids: torch.Tensor, key_positions: torch.Tensor, window: int | None, causal: bool,
             dtype: torch.dtype, groups: int) -> tuple[torch.Tensor, int]:
        """(grouped_bias of the visible rows, 0): `_visible`'s rule over rows written (up to the block's end)."""
        written = key_positions[:, None, :] <= block_position_ids[:, -1:, None]
        visible = _visible(block_position_ids, key_positions, window, causal) & written
        return grouped_bias(visible[0], groups, dtype), 0

    @staticmethod
    def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
               scaling: float, **_: Any) -> tuple[torch.Tensor, None]:
        """`grouped_attention` over the buffers (the model's sdpa path expands K/V per query head: a copy of every
        row, each layer, where the grouped call reads them once), in the attention functions' output layout."""
        return grouped_attention(query, key, value, bias, scaling).transpose(1, 2), None

    def advance(self, context_rows: int) -> None:
        """Keep the forward's real context rows (`count`; its padding and block rows become free)."""
        self.length.add_(self.count)


# RoPE as the tables of ddtree.engine.forward.RopeTables (built once a forward): (cos', sin', perm) of the new
# context and the block's positions, the same for the block's (the queries') rows, and the first for keys in their
# projection's layout [B, n, heads, d] (RopeTables.row_tables; None without a cache: the keys are transposed first)
Rope = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None]


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """[B, q, k] bool: which keys each query sees (causal: not after it; a window: |pos_q - pos_k| < window)."""
    delta = query_pos[:, :, None] - key_pos[:, None, :]
    visible = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        visible &= delta >= 0
    if window is not None:
        visible &= delta.abs() < window
    return visible


def _layer_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, causal: bool,
                dtype: torch.dtype, first: int = 0) -> torch.Tensor | None:
    """A layer's additive mask (`_visibility_mask`) over the keys from row `first` on; None where every key is
    visible to every query."""
    if window is None and not causal:
        return None
    return _visibility_mask(query_pos, key_pos[:, first:], window, causal, dtype)


def _visibility_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, causal: bool,
                     dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, q, k]: 0 where visible, finfo.min where hidden (bool masks break eager)."""
    visible = _visible(query_pos, key_pos, window, causal)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.head_dim**-0.5
        # The transformers attention functions read this; visibility comes only from our explicit mask.
        self.is_causal = False
        self.sliding_window = (config.sliding_window if config.layer_types[layer_idx] == "sliding_attention"
                               else None)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, config.num_attention_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, h, bias=bias)
        self.q_norm = _RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = _RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, rope: Rope,
                cache: DrafterCache | None, mask: torch.Tensor | None, attend: Callable,
                first: int = 0) -> torch.Tensor:
        """rope: the RoPE tables of [new context ‖ block] positions and of the block's (see `Rope`).
        first: attend over the key rows from this one on (a sliding layer's window; `mask` covers those only)."""
        b, q, _ = x.shape
        queries = self.q_norm(self.q_proj(x).view(b, q, -1, self.head_dim)).transpose(1, 2)
        queries = RopeTables.apply(queries, rope[1])
        fresh = x if context is None else torch.cat([context, x], dim=1)  # one projection for both
        n = fresh.shape[1]
        keys = self.k_norm(self.k_proj(fresh).view(b, n, -1, self.head_dim))  # [B, n, kv heads, d]
        values = self.v_proj(fresh).view(b, n, -1, self.head_dim)
        if cache is not None:  # written as they are (rows layout): no transposes
            keys, values = cache.write_rows(self.layer_idx, RopeTables.apply(keys, rope[2]), values)
        else:
            keys, values = RopeTables.apply(keys.transpose(1, 2), rope[0]), values.transpose(1, 2)
        if first:
            keys, values = keys[..., first:, :], values[..., first:, :]
        # is_causal=False: with fewer queries than keys, sdpa's causal path would keep only the first q keys.
        out, _ = attend(self, queries, keys, values, mask, dropout=0.0, scaling=self.scaling, is_causal=False)
        return self.o_proj(out.reshape(b, q, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, qwen3_config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(qwen3_config)
        self.silu = type(self.mlp.act_fn) is SiLUActivation  # its silu and product: one fused op
        self.input_layernorm = _RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, rope: Rope,
                cache: DrafterCache | None, mask: torch.Tensor | None, attend: Callable, first: int = 0) -> torch.Tensor:
        return self.around(x, lambda h: self.self_attn(h, context, rope, cache, mask, attend, first))

    def around(self, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer around its attention, given as a function of the attention's input (the block's rows, normed)
        to its output projection's: `self_attn` (a DFlash2 layer adds its convolutions around both sublayers)."""
        x = x + attention(self.input_layernorm(x))
        return x + self._mlp(self.post_attention_layernorm(x))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        if self.silu:  # Qwen3MLP's down(silu(gate(h)) * up(h))
            return mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return mlp(h)


def _resolve_dtype(dtype: torch.dtype | str | None, config: DFlashConfig,
                   state: dict[str, torch.Tensor]) -> torch.dtype:
    if dtype is None or dtype == "auto":
        if config.dtype is not None:
            dtype = config.dtype
        else:
            return next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError("drafter.dtype", f"not a floating-point dtype: {dtype!r}",
                          "use 'auto', 'bfloat16', 'float16' or 'float32'")
    return dtype


def _checkpoint_dir(name_or_path: str | os.PathLike, hub_kwargs: dict[str, Any]) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(str(name_or_path),
                                      allow_patterns=[CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME],
                                      **hub_kwargs))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as e:
        raise ConfigError("drafter", f"{name_or_path!s} is neither a local directory nor a reachable hub "
                          f"repository ({type(e).__name__})", "pass a DFlash drafter directory or hub id") from e


def _architectures(config_path: Path) -> list[str]:
    """The architectures a drafter's config.json names (none for an unreadable one: DFlashConfig says why)."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    found = raw.get("architectures") if isinstance(raw, dict) else None
    return list(found) if isinstance(found, list) else []


def _load_weights(directory: Path, device: str) -> dict[str, torch.Tensor]:
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_NAME).is_file():
        shards = [WEIGHTS_NAME]
    else:
        raise ConfigError("drafter", f"no {WEIGHTS_NAME} in {directory}", "save the drafter in safetensors format")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(directory / shard, device=device))
    # Some exports nest everything under `model.`; the weights are the same.
    return {k.removeprefix("model."): v for k, v in state.items()}


class DFlashDrafter(nn.Module):
    """A DFlash drafter. `forward` returns the block's final hidden states; logits = target lm_head(hidden)."""

    config_class = DFlashConfig
    layer_class = DFlashDecoderLayer
    ARCHITECTURE = "DFlashDraftModel"

    def __init__(self, config: DFlashConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        qwen3_config = config.qwen3_config()
        self.layers = nn.ModuleList(self.layer_class(config, qwen3_config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = _RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = _RotaryEmbedding(qwen3_config)
        self._rope = RopeTables()  # the forward's RoPE tables, built once for all layers
        self.set_attn_implementation(attn_implementation)

    # ----- properties the engine reads -----
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def set_attn_implementation(self, name: str) -> None:
        if name not in ATTN_IMPLEMENTATIONS:
            raise ConfigError("drafter.attn_implementation", f"{name!r} is not supported by the DFlash drafter",
                              f"use one of {sorted(ATTN_IMPLEMENTATIONS)}")
        self.attn_implementation = name
        self._attend = ATTN_IMPLEMENTATIONS[name]

    def new_cache(self, capacity: int = 0) -> DrafterCache:
        """An empty context cache; `capacity`: expected context + block rows (sizes the buffers once)."""
        return DrafterCache(self.config.num_hidden_layers, capacity)

    def check_compatible(self, target: nn.Module) -> None:
        """Raise ConfigError unless this drafter can read `target`'s hidden states and embeddings."""
        text = target.config.get_text_config()
        fix = "use a drafter trained for this target"
        if self.config.hidden_size != text.hidden_size:
            raise ConfigError("drafter.hidden_size",
                              f"drafter hidden size {self.config.hidden_size} != target hidden size "
                              f"{text.hidden_size}", fix)
        n_layers = text.num_hidden_layers
        bad = [i for i in self.config.target_layer_ids if not 0 <= i < n_layers]
        if bad:
            raise ConfigError("drafter.dflash_config.target_layer_ids",
                              f"{bad} out of range for a target with {n_layers} layers (valid 0..{n_layers - 1})",
                              fix)
        vocab = target.get_input_embeddings().weight.shape[0]
        if self.config.mask_token_id >= vocab:
            raise ConfigError("drafter.dflash_config.mask_token_id",
                              f"{self.config.mask_token_id} is outside the target's vocabulary of {vocab} tokens",
                              fix)

    def embed_block(self, embedding: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings as the public code makes them (z-lab, vLLM, llama.cpp): the rows of the
        target's input embedding matrix `embedding` [V, H] (not its module, which may do more than a lookup:
        Muse-Glimmer's adds a norm), times `input_embedding_scale` where the config sets one."""
        if ids.device != embedding.device:  # (a device map: the target's embeddings elsewhere)
            ids = ids.to(embedding.device)
        rows = embedding_rows(embedding, ids)  # (a tensor-parallel target's sharded rows: ddtree.engine.sharded)
        scale = self.config.input_embedding_scale
        return rows if scale is None or scale == 1 else rows * scale

    def forward(self, noise_embedding: torch.Tensor, context_features: torch.Tensor | None,
                context_position_ids: torch.Tensor | None, block_position_ids: torch.Tensor,
                cache: DrafterCache | FixedDrafterCache | None = None) -> torch.Tensor:
        """Hidden states [B, q, H] of the block after the final norm (the compiled round's too: its cache is a
        FixedDrafterCache).

        noise_embedding [B, q, H]: target input embeddings of [last token, mask, ...].
        context_features [B, c, n_ids*H] (or None / c == 0): target hidden states of the context
        tokens new since the last call with this cache; their K/V are appended to `cache`.
        """
        x = noise_embedding
        context = None
        positions = block_position_ids
        if context_features is not None and context_features.shape[1] > 0:
            context = self.hidden_norm(self.fc(context_features))
            positions = torch.cat([context_position_ids, block_position_ids], dim=1)
        cos, sin = self.rotary_emb(x, positions)  # one RoPE call for the new context and the block
        tables = self._rope.tables(cos, sin, self.config.head_dim)
        q = x.shape[1]
        # the keys', the block's queries', and the keys' in their projection's layout [B, n, heads, d] (a cache's write)
        rope = (tables, (tables[0][:, :, -q:], tables[1][:, :, -q:], tables[2]),
                self._rope.row_tables(tables) if cache is not None else None)
        key_positions = positions if cache is None else cache.write_positions(positions)
        attend = self._attend if cache is None or cache.attend is None else cache.attend

        # the cache lays out each window's mask over its key rows (DrafterCache.mask, FixedDrafterCache.mask)
        masks: dict[int | None, tuple[torch.Tensor | None, int]] = {}
        declared = self.config.is_causal
        for layer in self.layers:
            window = layer.self_attn.sliding_window
            causal = declared if declared is not None else window is not None
            if window not in masks:
                masks[window] = ((_layer_mask(block_position_ids, key_positions, window, causal, x.dtype), 0)
                                 if cache is None else cache.mask(block_position_ids, key_positions, window, causal,
                                                                  x.dtype, layer.self_attn.num_key_value_groups))
            mask, first = masks[window]
            x = layer(x, context, rope, cache, mask, attend, first)
        if cache is not None:
            cache.advance(0 if context is None else context.shape[1])
        return self.norm(x)

    # ----- construction, loading, saving -----
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, attn_implementation: str = "sdpa",
                        **hub_kwargs: Any) -> DFlashDrafter:
        """Load a public-format DFlash drafter from a local directory or a hub id.

        dtype None or "auto" keeps the checkpoint's dtype; `torch_dtype=` is accepted as an alias.
        """
        if "torch_dtype" in hub_kwargs:
            torch_dtype = hub_kwargs.pop("torch_dtype")
            if dtype is not None and torch_dtype is not None and torch_dtype != dtype:
                raise ConfigError("drafter.dtype", f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree",
                                  "pass only dtype")
            dtype = dtype if dtype is not None else torch_dtype
        directory = _checkpoint_dir(name_or_path, hub_kwargs)
        # a checkpoint declaring a subclass's architecture (DFlash2DraftModel: ddtree.engine.drafter.dflash2) loads as one
        cls = next((sub for sub in cls.__subclasses__() if sub.ARCHITECTURE in _architectures(directory / CONFIG_NAME)),
                   cls)
        config = cls.config_class.from_json_file(directory / CONFIG_NAME)
        state = _load_weights(directory, str(device) if device is not None else "cpu")
        dtype = _resolve_dtype(dtype, config, state)

        with torch.device("meta"):  # skip a random init that the checkpoint overwrites
            model = cls(config, attn_implementation=attn_implementation)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        missing = sorted(expected.keys() - state.keys())
        unexpected = sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise ConfigError("drafter weights", f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
                              f" in {directory}", "the checkpoint does not match its config.json")
        wrong = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if state[k].shape != s]
        if wrong:
            raise ConfigError("drafter weights", f"shape mismatch: {wrong[:4]}",
                              "the checkpoint does not match its config.json")
        model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                              assign=True)
        # RoPE frequencies are not in the checkpoint: rebuild them (fp32) off the meta device.
        model.rotary_emb = _RotaryEmbedding(config.qwen3_config())
        return (model.to(device) if device is not None else model).eval()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json + model.safetensors in the public DFlash format (no key prefix)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.config)
        config.dtype = str(self.dtype).removeprefix("torch.")
        config.to_json_file(directory / CONFIG_NAME)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})

    @classmethod
    def random_for_target(cls, target_config: Any, *, num_layers: int = 1, block_size: int = 16,
                          target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                          seed: int = 0, layer_types: list[str] | None = None, sliding_window: int | None = None,
                          attn_implementation: str = "sdpa", **config_extra: Any) -> DFlashDrafter:
        """A randomly initialised drafter sized for a transformers target config (tests, smoke runs).
        config_extra: further fields of `config_class` (DFlash2's convolution and selector)."""
        text = target_config.get_text_config()
        n_target = text.num_hidden_layers
        config = cls.config_class(
            hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=_global_attr(text, "head_dim") or text.hidden_size // text.num_attention_heads,
            target_layer_ids=(list(target_layer_ids) if target_layer_ids is not None
                              else evenly_spaced_layer_ids(n_target, num_layers)),
            mask_token_id=text.vocab_size - 1 if mask_token_id is None else mask_token_id,
            block_size=block_size, num_target_layers=n_target, vocab_size=text.vocab_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=_normalized_rope({"rope_theta": (text.rope_parameters or {}).get("rope_theta")}),
            max_position_embeddings=text.max_position_embeddings,
            attention_bias=bool(getattr(text, "attention_bias", False)),
            hidden_act=getattr(text, "hidden_act", "silu"), layer_types=layer_types, sliding_window=sliding_window,
            **config_extra,
        )
        model = cls(config, attn_implementation=attn_implementation)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02, generator=generator)  # HF's initializer_range
                    if module.bias is not None:
                        module.bias.zero_()
        return model.eval()


def _global_attr(config: Any, name: str) -> Any:
    """`config.<name>`, or its global value where it is per layer (Gemma 4's head_dim: reading it raises there)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return config.to_dict().get(name)
    return getattr(config, name, None)
