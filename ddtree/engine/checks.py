"""Argument checks every entry shares (ddtree.generate, the proposers, config validation, the
authors'-code engine); cheap to import: torch is only needed by the tensor check's caller."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from ddtree.errors import ConfigError

if TYPE_CHECKING:
    import torch


COMPILE_SETTINGS = ("auto", "true", "false")  # the compiled round (ddtree.engine.compiled)
MTP_STEPS, MTP_TOPK = 3, 1  # method=mtp's defaults: SGLang's --speculative-num-steps 3 --speculative-eagle-topk 1


def compile_setting(value: Any) -> str:
    """'auto', 'true' or 'false' from the compile setting (a bool or one of those words); else one ConfigError."""
    if isinstance(value, bool):
        return "true" if value else "false"
    word = str(value).strip().lower()
    if word not in COMPILE_SETTINGS:
        raise ConfigError("compile", f"unknown value '{value}'", "use compile=auto, compile=true or compile=false")
    return word


def check_budget(budget: int | None) -> None:
    if budget is not None and budget < 1:
        raise ConfigError("budget", f"must be >= 1, got {budget}", "use e.g. budget=32")


def check_block_size(block_size: int | None) -> None:
    if block_size is not None and block_size < 2:
        raise ConfigError("drafter.block_size", f"must be >= 2, got {block_size}", "use 2..16, or null")


def check_mtp_args(steps: int | None, topk: int | None, group: str = "mtp") -> None:
    """method=mtp (and the others drafting a chain or an EAGLE-style tree, settings `group`): steps >= 1 draft tokens
    per round (depth), topk >= 1 children per expanded node."""
    for name, value, example in (("steps", steps, MTP_STEPS), ("topk", topk, MTP_TOPK)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{group}.{name}", f"must be an integer >= 1, got {value!r}",
                              f"e.g. {group}.{name}={example}")


def check_generate_args(temperature: float, max_new_tokens: int, input_ids: torch.Tensor) -> None:
    """The argument checks every engine's generate shares."""
    if temperature < 0:
        raise ConfigError("temperature", f"must be >= 0, got {temperature}", "use 0 for greedy")
    if max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError("input_ids", f"must have shape [1, prompt_len], got {list(input_ids.shape)}",
                          "pass one prompt: input_ids[None] or tokenizer(..., return_tensors='pt').input_ids")
    if input_ids.shape[1] < 1:
        raise ConfigError("input_ids", "is empty: the prompt tokenized to no tokens",
                          "pass a prompt of at least one token")


# ---------------------------------------------------------------- the tree's memory

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
GDN_LIVE_MATRICES = 3  # [value heads, n, n] float32 matrices a tree-exact GDN layer holds at once
TREE_SHARE = 2  # a tree may take at most 1/TREE_SHARE of the device's memory (weights, cache and the rest: the other)


def tree_bytes_per_node(text_config: dict[str, Any], dtype_bytes: int) -> tuple[int, int]:
    """(a, b): one verification round of n tree nodes needs about a * n**2 + b * n bytes on the target's device.

    a: the ancestor matrix (bool, and its float copy), the additive mask (model dtype), one layer's attention scores
    under that mask (heads x n x n, float32) and, on a hybrid, a GDN layer's [value heads, n, n] float32 matrices;
    b: the logits row (float32) and every attention layer's key and value row."""
    c = text_config
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or (int(c.get("hidden_size") or 0) // heads) or 1)
    layers = int(c.get("num_hidden_layers") or 1)
    types = c.get("layer_types") or []
    gdn_layers = sum("linear" in str(t) for t in types)
    v_heads = int(c.get("linear_num_value_heads") or 0) if gdn_layers else 0
    a = 1 + 4 + dtype_bytes + 4 * heads + 4 * GDN_LIVE_MATRICES * v_heads
    b = 4 * int(c.get("vocab_size") or 0) + 2 * kv_heads * head_dim * dtype_bytes * (layers - gdn_layers)
    return a, b


def largest_fitting_budget(a: int, b: int, allowance: int) -> int:
    """The largest budget (nodes - 1) whose a * n**2 + b * n fits in `allowance` bytes."""
    n = int((-b + math.sqrt(b * b + 4 * a * allowance)) / (2 * a))
    while n > 0 and a * n * n + b * n > allowance:
        n -= 1
    return max(n - 1, 0)


def device_memory_bytes(device: str) -> int | None:
    """The device's total memory: a CUDA device's, else the host's physical memory (None where unknown)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        return None


def check_tree_memory(text_config: dict[str, Any], budget: int, dtype_bytes: int, device: str,
                      setting: str = "budget") -> None:
    """Refuse a budget whose verification round would not fit in 1/TREE_SHARE of the device's memory."""
    total = device_memory_bytes(device)
    if total is None:
        return
    a, b = tree_bytes_per_node(text_config, dtype_bytes)
    n = budget + 1
    need, allowance = a * n * n + b * n, total // TREE_SHARE
    if need > allowance:
        fits = largest_fitting_budget(a, b, allowance)
        raise ConfigError(setting, f"a tree of {budget} nodes needs about {_gib(need)} to verify on {device} "
                          f"(ancestor matrix, masks, attention scores, key/value rows), more than half of its "
                          f"{_gib(total)}", f"use {setting}<={fits}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # a DFlash2 checkpoint's config.json `architectures` entry


def is_dflash2_config(config: dict) -> bool:
    """Whether a drafter's config.json (as a dict) is a DFlash2 drafter's (read before any weight loads)."""
    return DFLASH2_ARCHITECTURE in (config.get("architectures") or ())


# DFlash2 drafters (ddtree.engine.drafter.dflash2): the config.json keys beyond DFlash's, in dflash_config (z-lab's
# configs) or at the top level (some exports); checked here too so config validation reads them without torch
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                "final_logit_softcapping")


def check_input_embedding_scale(value: Any) -> None:
    """A drafter's `input_embedding_scale` (z-lab and vLLM multiply the block's embedding rows by it): finite, > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ConfigError("drafter.dflash_config.input_embedding_scale",
                          f"must be a finite number > 0 or absent, got {value!r}", "fix the drafter's config.json")


def dflash2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The DFlash2 keys of a config.json dict (dflash_config's first, then the top level; None where absent)."""
    inner = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    return {k: inner[k] if inner.get(k) is not None else raw.get(k) for k in DFLASH2_KEYS}


def check_dflash2_fields(fields: dict[str, Any], *, hidden_size: Any, block_size: Any, vocab_size: Any) -> None:
    """The convolution and selector settings of a DFlash2 drafter; one ConfigError naming the first wrong one."""
    fix = "fix dflash_config in the drafter's config.json"
    for name in DFLASH2_KEYS[:4]:
        value = fields.get(name)
        if value is None:
            raise ConfigError(f"drafter.dflash_config.{name}", "missing from a DFlash2 drafter's config.json", fix)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"drafter.dflash_config.{name}", f"must be a positive integer, got {value!r}", fix)
    if isinstance(hidden_size, int) and hidden_size % fields["conv_group_size"]:
        raise ConfigError("drafter.dflash_config.conv_group_size",
                          f"{fields['conv_group_size']} does not divide hidden_size {hidden_size}", fix)
    if isinstance(block_size, int) and fields["conv_kernel_size"] > block_size:
        raise ConfigError("drafter.dflash_config.conv_kernel_size",
                          f"{fields['conv_kernel_size']} taps exceed the block of {block_size}", fix)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError("drafter.vocab_size", f"a DFlash2 drafter needs its vocab_size (the selector's codebooks' "
                          f"rows), got {vocab_size!r}", "fix the drafter's config.json")
    if fields["selector_top_k"] > vocab_size:
        raise ConfigError("drafter.dflash_config.selector_top_k",
                          f"{fields['selector_top_k']} candidates exceed the vocabulary of {vocab_size}", fix)
    for name in DFLASH2_KEYS[4:]:
        value = fields.get(name)
        cap = name == "final_logit_softcapping"  # 0 (or absent) is no cap, as the public code reads it
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or (cap and value < 0)):
            raise ConfigError(f"drafter.dflash_config.{name}",
                              f"must be a finite number{' >= 0 (0: no cap)' if cap else ''} or absent, got {value!r}",
                              fix)
