"""One cached token through a GDN layer on the CPU (the host branch gdn_step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.engine.gdn.commit import _count_tokens
from ddtree.engine.gdn.layer import _activation, _l2norm, _project
from ddtree.engine.host import host_branch
from ddtree.engine.options import current


def _step_forward(module, hidden_states: torch.Tensor | None = None, cache=None, attention_mask=None,
                  cache_params=None, **kwargs) -> torch.Tensor | None:
    """One cached token through a GDN layer on the CPU, updating its conv and recurrent state in place.

    The math of the upstream decode step, without its torch fallbacks' costs: the conv of one new column
    is a K-tap dot product per channel (their depthwise conv1d over K + 1 columns costs ~0.4 ms a layer on
    the CPU), the delta rule one fused update. None where the upstream forward must run instead (no cache
    state yet, a cache recording its whole past, a padding mask, packed sequences, more than one token,
    a CUDA device, whose fused kernels it may have, or an accelerate hook on the conv).
    """
    cache = cache if cache is not None else cache_params  # the pre-5.24 name
    if (hidden_states is None or cache is None or attention_mask is not None or hidden_states.shape[1] != 1
            # transformers' layer calls this forward: the options are the session's scope's (ddtree.engine.options)
            or not host_branch("gdn_step", hidden_states.device, current()) or kwargs.get("cu_seq_lens_q") is not None
            or hasattr(module.conv1d, "_hf_hook")):
        return None
    layer = module.layer_idx
    conv_state = cache.get_conv_state(layer, state_idx=0)
    state = cache.get_recurrent_state(layer, state_idx=0)
    kernel = module.conv_kernel_size
    if (conv_state is None or state is None or conv_state.shape[-1] < kernel
            or getattr(cache.layers[layer], "record_past", False)):
        return None  # (a layer keeping its whole conv history: the upstream forward appends to it)
    bsz = hidden_states.shape[0]
    mixed, z, b, a = _project(module, hidden_states)  # mixed (B, 1, C)
    shifted = torch.cat([conv_state[..., 1:], mixed.transpose(1, 2).to(conv_state.dtype)], dim=-1)
    conv_state.copy_(shifted)  # the state keeps its length, the new column last
    window = shifted[..., -kernel:]  # (B, C, K)
    weight = module.conv1d.weight.squeeze(1)  # (C, K)
    conv = (window.float() * weight.float()).sum(-1)
    if module.conv1d.bias is not None:
        conv = conv + module.conv1d.bias.float()
    conv = _activation(module.activation)(conv).to(hidden_states.dtype)  # (B, C)
    query, key, value = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    value = value.reshape(bsz, -1, module.head_v_dim).float()  # (B, Hv, dv)
    heads = value.shape[1]
    query = query.reshape(bsz, -1, module.head_k_dim).float()
    key = key.reshape(bsz, -1, module.head_k_dim).float()
    if query.shape[1] != heads:  # each q/k head serves consecutive value heads
        query = query.repeat_interleave(heads // query.shape[1], dim=1)
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
    query = _l2norm(query) * query.shape[-1] ** -0.5
    key = _l2norm(key)
    beta = b.reshape(bsz, heads).float().sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.reshape(bsz, heads).float() + module.dt_bias)
    s = state.float() * g.exp()[..., None, None]  # (B, Hv, dk, dv)
    delta = (value - (key.unsqueeze(-2) @ s).squeeze(-2)) * beta.unsqueeze(-1)
    s = s.add_(key.unsqueeze(-1) * delta.unsqueeze(-2))
    core = (query.unsqueeze(-2) @ s).squeeze(-2)  # (B, Hv, dv)
    state.copy_(s)
    _count_tokens([cache.layers[layer]], 1)
    core = core.to(hidden_states.dtype)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, 1, -1))
