"""The DFlash drafter's configuration: the public checkpoint's config.json (a Qwen3-style config with `block_size`,
`num_target_layers`, optional `layer_types`/`sliding_window` and `dflash_config: {target_layer_ids,
mask_token_id}`, optionally `input_embedding_scale` there or at the top level) as a validated dataclass. The model is in `ddtree.engine.drafter.model`."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import Qwen3Config
from transformers.activations import ACT2FN

from ddtree.engine.checks import check_input_embedding_scale
from ddtree.errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")


def evenly_spaced_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """Target layers to read, spread over the target's depth as the public DFlash recipe does."""
    if not 1 <= count <= num_target_layers:
        raise ConfigError("drafter.dflash_config.target_layer_ids",
                          f"cannot pick {count} distinct layers from a target with {num_target_layers}",
                          "pass target_layer_ids explicitly")
    if count == 1:
        return [num_target_layers // 2]
    # The public recipe spreads over [1, L-3]; a shallow target has too few layers there.
    start, end = (1, num_target_layers - 3) if num_target_layers - 3 >= count else (0, num_target_layers - 1)
    return [round(start + i * (end - start) / (count - 1)) for i in range(count)]


def _normalized_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters in transformers 5 form, accepting the legacy rope_theta/rope_scaling keys."""
    rope_kwargs = {k: raw[k] for k in _ROPE_KEYS if raw.get(k) is not None}
    try:
        return dict(Qwen3Config(**rope_kwargs).rope_parameters)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError("drafter.rope_parameters", f"invalid RoPE settings {rope_kwargs}: {e}",
                          "fix rope_parameters in the drafter's config.json") from e


@dataclass
class DFlashConfig:
    """The drafter's architecture, in the public DFlash config.json vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_key_value_heads: int | None = None  # None: as attention heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    block_size: int = 16
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: _normalized_rope({}))
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # None: every layer full attention
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal, full layers not (public default)
    input_embedding_scale: float | None = None  # the block's embedding rows times this (None: 1)
    dtype: str | None = None  # the checkpoint's dtype, used by dtype="auto"
    # Keys we do not interpret (architectures, auto_map, ...), kept so a save round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._require_positive("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "block_size", "max_position_embeddings")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        # What the public loaders key on (z-lab's auto_map, vLLM/SGLang's architecture name).
        self.extra.setdefault("architectures", ["DFlashDraftModel"])
        self.extra.setdefault("model_type", "qwen3")
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = list(self.layer_types)
        self._validate()

    def _require_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"drafter.{name}", f"must be a positive integer, got {value!r}")

    def _validate(self) -> None:
        self._require_positive("num_key_value_heads", "head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("drafter.num_key_value_heads",
                              f"{self.num_attention_heads} attention heads are not a multiple of "
                              f"{self.num_key_value_heads} key/value heads", "fix the drafter's config.json")
        if self.head_dim % 2:
            raise ConfigError("drafter.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        if not self.target_layer_ids or not all(isinstance(i, int) and i >= 0 for i in self.target_layer_ids):
            raise ConfigError("drafter.dflash_config.target_layer_ids",
                              f"must be a non-empty list of layer indices, got {self.target_layer_ids!r}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError("drafter.dflash_config.target_layer_ids",
                              f"{self.target_layer_ids} reach past num_target_layers={self.num_target_layers}",
                              "fix the drafter's config.json")
        if not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ConfigError("drafter.dflash_config.mask_token_id",
                              f"must be a token id >= 0, got {self.mask_token_id!r}")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ConfigError("drafter.layer_types",
                              f"need {self.num_hidden_layers} entries from {LAYER_TYPES}, got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and (
                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError("drafter.sliding_window",
                              f"sliding_attention layers need a positive sliding_window, got {self.sliding_window!r}",
                              "set sliding_window or make every layer full_attention")
        if self.is_causal not in (None, True, False):
            raise ConfigError("drafter.is_causal", f"must be true, false or absent, got {self.is_causal!r}")
        check_input_embedding_scale(self.input_embedding_scale)
        if self.hidden_act not in ACT2FN:
            raise ConfigError("drafter.hidden_act", f"unknown activation {self.hidden_act!r}")
        if "rope_type" not in self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise ConfigError("drafter.rope_parameters",
                              f"need rope_type and rope_theta, got {self.rope_parameters!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Build from a public DFlash config.json dict (either transformers 4 or 5 RoPE keys)."""
        rest = copy.deepcopy(raw)
        dflash = rest.pop("dflash_config", None) or {}

        def draft_value(name: str) -> Any:
            # The DFlash keys live in dflash_config; some checkpoints also put them at top level.
            top, inner = rest.pop(name, None), dflash.pop(name, None)
            return inner if inner is not None else top

        target_layer_ids = draft_value("target_layer_ids")
        mask_token_id = draft_value("mask_token_id")
        block_size = draft_value("block_size")
        scale = draft_value("input_embedding_scale")
        causal = dflash.pop("causal", None)
        is_causal = rest.pop("is_causal", None)
        is_causal = is_causal if is_causal is not None else causal
        rope_parameters = _normalized_rope(rest)
        for key in _ROPE_KEYS:
            rest.pop(key, None)
        dtype, torch_dtype = rest.pop("dtype", None), rest.pop("torch_dtype", None)
        rest.pop("use_sliding_window", None)  # written back from layer_types

        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: rest.pop(k) for k in list(rest) if k in known}
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if name not in kwargs:
                raise ConfigError(f"drafter.{name}", "missing from the drafter's config.json",
                                  "is this a DFlash drafter checkpoint?")
        if mask_token_id is None:
            raise ConfigError("drafter.dflash_config.mask_token_id", "missing from the drafter's config.json",
                              "add dflash_config.mask_token_id (the target's mask token id)")
        if target_layer_ids is None:
            if kwargs.get("num_target_layers") is None:
                raise ConfigError("drafter.dflash_config.target_layer_ids", "missing from the drafter's config.json",
                                  "add dflash_config.target_layer_ids or num_target_layers")
            # The public loader's fallback: one target layer per drafter layer.
            target_layer_ids = evenly_spaced_layer_ids(kwargs["num_target_layers"], kwargs["num_hidden_layers"])
        if dflash:
            rest["dflash_config"] = dflash
        return cls(**kwargs, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                   block_size=16 if block_size is None else block_size, is_causal=is_causal,
                   input_embedding_scale=scale,
                   rope_parameters=rope_parameters, dtype=dtype or torch_dtype, extra=rest)

    def to_dict(self) -> dict[str, Any]:
        """The public DFlash config.json dict."""
        out = copy.deepcopy(self.extra)
        data = asdict(self)
        for key in ("extra", "target_layer_ids", "mask_token_id", "is_causal", "dtype", "input_embedding_scale"):
            data.pop(key)
        out.update(data)
        out["rope_theta"] = self.rope_parameters["rope_theta"]  # transformers 4 readers
        out["dflash_config"] = {**out.get("dflash_config", {}),
                                "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if self.input_embedding_scale is not None:  # where vLLM reads it (z-lab: dflash_config, then the top level)
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        if "sliding_attention" in self.layer_types:
            # Qwen3Config-based readers drop sliding_window unless use_sliding_window is set.
            out["use_sliding_window"] = True
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> DFlashConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("drafter", f"cannot read {path}: {e}", "point to a DFlash drafter directory") from e
        return cls.from_dict(raw)

    def to_json_file(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def qwen3_config(self) -> Qwen3Config:
        """The transformers Qwen3 config our building blocks (MLP, RoPE) read."""
        return Qwen3Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters))
