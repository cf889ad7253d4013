"""The compiled round's KV capacity rule, and the memory one stream holds (`stream_bytes`: KV rows, GDN state and tree
scratch per stream, for `concurrency`'s check before loading; docs/concurrency.md).

The capacity rule: how many rows its fixed key and value buffers hold for a generation.

Attention in a compiled graph reads every row of its buffers under a mask (ddtree.engine.compiled), so the rows past
the context are traffic a round pays; and each capacity is a graph shape of its own, compiled once (dynamo keeps the
graphs of every capacity a process has seen). The rule trades the two:

* up to `QUANTUM` rows, the next power of two, at least `MIN_CAPACITY` (short generations: few shapes, and at most
  QUANTUM / 2 rows past what is needed);
* above, the next multiple of a step: QUANTUM rows, or 1/16 of the octave's top where that is larger (from 65,536
  rows on): fewer rows past what is needed than max(QUANTUM, needed / 8).

A 32k-token context (+ 512 new tokens + a 65-node tree: 33,345 rows) gets 36,864 rows where the power of two was
65,536: at Qwen3.6-27B's dims the target and drafter read 0.35 GB of rows past the context a round instead of 2.8 GB
(docs/gpu.md, bytes per compiled round). Shapes up to 32k: 256 .. 4,096 (5) and 8,192 .. 32,768 by 4,096 (7): 12
where powers of two gave 8; one generation uses one (the capacity is set when it starts and holds for its rounds).
Every capacity is a multiple of 256 (a grouped mask's rows are 16-aligned as the fused SDPA kernels want them).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

__all__ = ["MIN_CAPACITY", "QUANTUM", "StreamBytes", "capacity_bucket", "kv_row_bytes", "stream_bytes"]

MIN_CAPACITY = 256
QUANTUM = 4096  # rows: 0.35 GB a round at Qwen3.6-27B's dims (16 attention layers + 5 drafter layers, bf16)


def capacity_bucket(needed: int) -> int:
    """The KV capacity for `needed` rows (module docstring): the next power of two up to QUANTUM (at least
    MIN_CAPACITY), above it the next multiple of max(QUANTUM, the octave's top / 16)."""
    if needed <= QUANTUM:
        return max(MIN_CAPACITY, 1 << max(0, needed - 1).bit_length())
    step = max(QUANTUM, (1 << (needed - 1).bit_length()) >> 4)
    return -(-needed // step) * step


# ---------------------------------------------------------------- memory per stream

GDN_STATE_BYTES = 4  # the recurrent state is float32 whatever the model's dtype (the conv state: the model's)


@dataclass(frozen=True)
class StreamBytes:
    """The device memory one stream holds while it decodes (docs/concurrency.md, "Memory per stream"):

    kv: every attention layer's key and value rows at the stream's rows (context + new tokens + tree);
    gdn_state: each linear-attention layer's conv state (conv channels x kernel, model dtype) and recurrent state
    (value heads x key dim x value dim, float32);
    tree: one verification round of its tree: the ancestor matrix, mask, one layer's scores, logits rows and the tree's
    key/value rows (ddtree.engine.checks.tree_bytes_per_node), and on a hybrid target the GDN layers' inputs kept for
    the commit (a slot per layer) and one layer's scratch (ddtree.engine.gdn.buffers.tree_buffer_bytes)."""

    kv: int
    gdn_state: int
    tree: int
    drafter_kv: int = 0  # a drafter's own key and value rows at the stream's rows, where its config is given

    @property
    def total(self) -> int:
        return self.kv + self.gdn_state + self.tree + self.drafter_kv


def _gdn_dims(c: dict[str, Any]) -> SimpleNamespace | None:
    """A GDN layer's dims from a text config (qwen3_5, qwen3_next field names), None without them."""
    hv = int(c.get("linear_num_value_heads") or 0)
    if not hv:
        return None
    dk = int(c.get("linear_key_head_dim") or 0)
    return SimpleNamespace(num_v_heads=hv, num_k_heads=int(c.get("linear_num_key_heads") or hv), head_k_dim=dk,
                           head_v_dim=int(c.get("linear_value_head_dim") or dk),
                           conv_kernel_size=int(c.get("linear_conv_kernel_dim") or 4))


def kv_row_bytes(config: dict[str, Any], dtype_bytes: int) -> int:
    """The key and value bytes of one row over a model's attention layers (every layer but linear-attention ones; a
    sliding layer counted whole, as the engine's buffers hold it)."""
    c = config
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or (int(c.get("hidden_size") or 0) // heads) or 1)
    layers = int(c.get("num_hidden_layers") or 1)
    linear = sum("linear" in str(t) for t in c.get("layer_types") or []) if _gdn_dims(c) else 0
    return (layers - linear) * kv_heads * head_dim * 2 * dtype_bytes


def stream_bytes(text_config: dict[str, Any], rows: int, nodes: int, dtype_bytes: int,
                 drafter_config: dict[str, Any] | None = None) -> StreamBytes:
    """The bytes of one stream of `rows` cache rows verifying trees of `nodes` nodes (root included; 1: AR) on a
    target of `text_config` (its config.json's text part as a dict) in a dtype of `dtype_bytes` bytes; with a
    drafter's config.json, its key and value rows too (the same rows and dtype)."""
    from ddtree.engine.checks import tree_bytes_per_node

    c = text_config
    gdn = _gdn_dims(c)
    linear = sum("linear" in str(t) for t in c.get("layer_types") or []) if gdn else 0
    kv = kv_row_bytes(c, dtype_bytes) * rows
    a, b = tree_bytes_per_node(c, dtype_bytes)
    tree = a * nodes * nodes + b * nodes
    state = 0
    if linear:
        channels = 2 * gdn.num_k_heads * gdn.head_k_dim + gdn.num_v_heads * gdn.head_v_dim
        state = linear * (channels * gdn.conv_kernel_size * dtype_bytes
                          + gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim * GDN_STATE_BYTES)
        from ddtree.engine.gdn.buffers import tree_buffer_bytes

        kept, scratch = tree_buffer_bytes(gdn, nodes, channels, dtype_bytes)
        tree += linear * kept + scratch
    drafter = kv_row_bytes(drafter_config, dtype_bytes) * rows if drafter_config else 0
    return StreamBytes(kv, state, tree, drafter)
