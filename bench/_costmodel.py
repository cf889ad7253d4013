"""The GPU cost model the benchmarks predict a real model's round with (docs/gpu.md, docs/concurrency.md).

    from _costmodel import H200, predict, real_dims

A round of `streams` streams, each verifying `nodes` tree tokens at `context` tokens of context, on a GPU whose
constants are `gpu` (any object with the attributes of H200: argparse's namespace in bench_launches.py):

  bytes   = the REAL model's weights in bf16 read once a round, whatever the streams (the target without its input
            embeddings; where a drafter drafts, its layers and fc and the lm_head a second time for its block)
            + per stream: the target's KV rows at the context (attention layers), the GDN states (fp32, read and
            written), the drafter's KV (a sliding layer: its window only)
  FLOPs   = per stream: 2 x parameters x tree tokens (+ 2 x the drafter's and lm_head's parameters x its block)
  device  = max(bytes / bandwidth, FLOPs / (peak x fraction reached))
  host    = kernel ops x launch_us + other ops x dispatch_us + compiled-graph calls x graph_us
  round   = max(device, host) + syncs x sync_us (host and device overlap except at a host read)

Attention's own FLOPs over the context (4 x attention layers x heads x head_dim x context a token: 0.4 GFLOP at
1k context on Qwen3.6-27B against 51 GFLOP for its weights) and the activations' bytes are left out.
Nothing imports one benchmark script from another: the scripts that predict import this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]

# every constant is a flag of bench_launches.py (these are its defaults)
H200 = SimpleNamespace(
    name="H200 (HBM3e, bf16)",
    bandwidth=4.8e12,  # bytes/s
    peak_flops=989e12,  # dense bf16 FLOP/s
    mfu=0.7,  # fraction of the peak a GEMM reaches
    launch_us=6.0,  # host cost of one kernel-launching op (eager, from Python)
    dispatch_us=1.0,  # a view or allocation op
    sync_us=20.0,  # one host read (the queue drains)
    graph_us=30.0,  # one compiled-graph call (a CUDA graph replay and its guards)
    drafter_window=2048,  # the DFlash drafter's sliding window
    drafter_sliding=4,  # sliding layers of its 5 (Qwen3.6-27B-DFlash: 4)
)
DRAFTER_LAYERS = 5


def real_config(name: str):
    """bench/configs/<name>.json (a hub config: the real dims and layer types) as a transformers config."""
    raw = json.loads((ROOT / "bench" / "configs" / f"{name}.json").read_text())
    text = raw.get("text_config", raw)
    kw = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "torch_dtype")}
    return AutoConfig.for_model(text["model_type"], **kw)


def _meta_params(config) -> tuple[int, int, int]:
    """(parameters read a round: all but the input embeddings, lm_head's, the input embeddings') of the real model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return total - emb, head, emb


def drafter_params(config, layers: int = DRAFTER_LAYERS) -> int:
    """A DFlash drafter at the real dims (Qwen3 layers of the target's width and MLP, fc over `layers` features)."""
    h, i = config.hidden_size, config.intermediate_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd
    return layers * (attn + 3 * h * i + 2 * h) + layers * h * h + 2 * h


def real_dims(name: str) -> dict:
    """The real model's sizes the cost model reads: parameters, attention and GDN layers, bytes of a KV row (K and V,
    bf16, one attention layer) and of one GDN layer's state (fp32 recurrent state + bf16 conv state)."""
    cfg = real_config(name)
    body, head, emb = _meta_params(cfg)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    attn = sum(t == "full_attention" for t in types)
    gdn = sum(t == "linear_attention" for t in types)
    state = 0
    if gdn:
        state = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                 + (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                    + cfg.linear_num_value_heads * cfg.linear_value_head_dim) * cfg.linear_conv_kernel_dim * 2)
    return dict(params=body, head=head, embed=emb, drafter=drafter_params(cfg), attn_layers=attn, gdn_layers=gdn,
                kv_row=2 * cfg.num_key_value_heads * cfg.head_dim * 2,  # K and V, bf16, per attention layer
                drafter_kv_row=2 * cfg.num_key_value_heads * cfg.head_dim * 2, gdn_state=state)


def stream_bytes(dims: dict, context: int, drafted: bool, gpu) -> int:
    """The bytes one stream adds to a round: its KV rows, GDN states (read and written), the drafter's KV."""
    kv = dims["attn_layers"] * context * dims["kv_row"] + dims["gdn_layers"] * dims["gdn_state"] * 2
    if drafted:
        rows = [min(context, gpu.drafter_window) if i < gpu.drafter_sliding else context
                for i in range(DRAFTER_LAYERS)]
        kv += sum(rows) * dims["drafter_kv_row"]
    return kv


def predict(dims: dict, ops: float, kernel_ops: float, syncs: float, nodes: int, block: int, drafted: bool,
            context: int, gpu, graphs: float = 0.0, streams: int = 1) -> dict:
    """The round (module docstring): bytes, ceiling (bytes / bandwidth), device, host and round ms."""
    weights = 2 * (dims["params"] + (dims["drafter"] + dims["head"] if drafted else 0))
    total = weights + streams * stream_bytes(dims, context, drafted, gpu)
    flops = streams * (2 * dims["params"] * nodes + (2 * (dims["drafter"] + dims["head"]) * block if drafted else 0))
    ceiling = total / gpu.bandwidth
    compute = flops / (gpu.peak_flops * gpu.mfu)
    device = max(ceiling, compute)
    host = (kernel_ops * gpu.launch_us + (ops - kernel_ops) * gpu.dispatch_us + graphs * gpu.graph_us) * 1e-6
    return dict(bytes=total, flops=flops, ceiling_ms=1e3 * ceiling, compute_ms=1e3 * compute, device_ms=1e3 * device,
                host_ms=1e3 * host, round_ms=1e3 * (max(device, host) + syncs * gpu.sync_us * 1e-6),
                bound="host" if host > device else ("compute" if compute > ceiling else "bandwidth"))
