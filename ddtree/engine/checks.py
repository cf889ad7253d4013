"""Argument checks every entry shares (ddtree.generate, the proposers, config validation, the
authors'-code engine); cheap to import: torch is only needed by the tensor check's caller."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtree.errors import ConfigError

if TYPE_CHECKING:
    import torch


def check_budget(budget: int | None) -> None:
    if budget is not None and budget < 1:
        raise ConfigError("budget", f"must be >= 1, got {budget}", "use e.g. budget=32")


def check_block_size(block_size: int | None) -> None:
    if block_size is not None and block_size < 2:
        raise ConfigError("drafter.block_size", f"must be >= 2, got {block_size}", "use 2..16, or null")


def check_generate_args(temperature: float, max_new_tokens: int, input_ids: torch.Tensor) -> None:
    """The argument checks every engine's generate shares."""
    if temperature < 0:
        raise ConfigError("temperature", f"must be >= 0, got {temperature}", "use 0 for greedy")
    if max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError("input_ids", f"must have shape [1, prompt_len], got {list(input_ids.shape)}",
                          "pass one prompt: input_ids[None] or tokenizer(..., return_tensors='pt').input_ids")
