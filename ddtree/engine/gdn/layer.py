"""The per-layer tree forward `tree_layer`: pure tensor code over a layer's inputs, the round's TreeMeta and
the layer's constants and buffers (also what the compiled round runs)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ddtree.engine.gdn.buffers import LayerBuffers, LayerConsts, _Views, _views
from ddtree.engine.gdn.meta import TreeMeta
from ddtree.engine.kernels import gdn as kgdn

DEFAULT_METHOD = "chunk"


@functools.cache
def _activation(name: str):
    """ACT2FN[name], built once: each lookup builds a new module (~20 us a GDN layer a forward here)."""
    return ACT2FN[name]


def _project(module, hidden_states: torch.Tensor):
    """Conv input (B, T, C), gate z (B, T, Hv, dv), b and a (B, T, Hv) of one GDN module."""
    bsz, seq_len, _ = hidden_states.shape
    if hasattr(module, "in_proj_qkvz"):  # qwen3_next: fused, head-interleaved projections
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(bsz, seq_len, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    mixed = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states).reshape(bsz, seq_len, -1, module.head_v_dim)
    return mixed, z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * (x * x).sum(-1, keepdim=True).add(eps).rsqrt()


def tree_layer(module, hidden_states: torch.Tensor, conv_state: torch.Tensor | None,
               recurrent_state: torch.Tensor | None, meta: TreeMeta, consts: LayerConsts, bufs: LayerBuffers,
               method: str = DEFAULT_METHOD) -> torch.Tensor:
    """One GDN layer over the flat tree [root] + nodes: the layer's output (B, T, hidden); fills `bufs`.

    Pure tensor code (no host reads): compiles with fullgraph=True. conv_state (B, C, >= K) and recurrent_state
    (B, Hv, dk, dv) are the cache's (None: an empty cache); neither is written. Every intermediate lands in a buffer
    of `bufs` through views made once (`_views`): the eager layer dispatches its projections, 5 fused ops and almost
    no views.
    """
    bsz, n, _ = hidden_states.shape
    kernel = module.conv_kernel_size
    f32 = torch.float32
    v = _views(module, bufs)

    mixed, z, ab = _projections(module, hidden_states, consts)
    compiling = torch.compiler.is_compiling()
    # eager, each step below is one fused op (ddtree.engine.kernels.gdn: the same torch ops on the CPU, one Triton
    # kernel on CUDA); compiled, the torch ops themselves (a graph fuses them)
    # decays: a + dt and -b land in the decay map's input, softplus of both at once: logaddexp(x, 0), computed in float32
    # from any dtype (the float32 zero promotes); X, Y from one matmul; E = exp(X . Y + mask) =
    # [exp(c_i) | exp(c_i - c_j) beta_j on ancestors]
    if not compiling:
        kgdn.decays(ab, consts.zero, meta.decay_map, meta.decay_mask, bufs.gates, bufs.xy, bufs.decays)
    else:
        v.ab.copy_(torch.logaddexp(ab.view(bsz, n, 2, -1), consts.zero))  # (dynamo refuses a strided out=)
        kgdn.decay_products(v.gates, meta.decay_map, meta.decay_mask, v.xy, bufs.decays)

    # causal conv over each node's own ancestors, reaching into the prefix's conv state: every tap times every row of
    # [conv-state tail, inputs] (the table), then per node the sum of its window's K table rows, one per tap (a
    # gather-and-sum: embedding_bag; token-major rows, whole rows gathered; a strided depthwise conv1d is slower on a
    # CPU)
    past = _past(conv_state, kernel, mixed, v)
    if v.table is not None and meta.conv_offsets is not None and not compiling and module.activation == "silu":
        # (a batch of trees too: its TreeMeta's index gives each stream its own windows)
        kgdn.conv(past, mixed, consts.conv_taps, consts.conv_bias, meta.conv_index, meta.conv_offsets,
                  bufs.extended, bufs.table, v.conv)
    elif meta.streams:  # a batch of trees, compiled (or another activation): each stream's own windows
        _batch_conv(module, past, mixed, consts, meta, bufs, v)
    else:
        torch.cat([past, mixed], dim=1, out=bufs.extended)
        if v.table is not None and meta.conv_offsets is not None and not compiling:
            torch.mul(v.rows, consts.conv_taps, out=bufs.table)
            conv = F.embedding_bag(meta.conv_index, v.table, meta.conv_offsets, mode="sum")  # (T, B C) float32
        else:  # (the compiled round: a graph fuses the table, the gather and the sum)
            table = (v.rows * consts.conv_taps).flatten(0, 1).flatten(1)
            conv = table.index_select(0, meta.conv_index).view(n, kernel, -1).sum(1)
        if consts.conv_bias is not None:
            conv.view(n, bsz, -1).add_(consts.conv_bias)
        if module.activation == "silu":
            torch._C._nn.silu(conv, out=v.conv)
        else:
            v.conv.copy_(_activation(module.activation)(conv))

    # q and k l2-normalised: x / sqrt(|x|^2 + eps) = rms_norm(x, eps / dk) * dk^-1/2, then copied per value head as
    # [q rows; k rows]; q's dk^-1/2 is not applied (see _gated_norm)
    keys3, k_t = v.keys3, v.k_t
    if not compiling:
        kgdn.qk_norm(v.qk, consts.qk_weight, consts.qk_eps, v.qk_rows)
    else:  # the rows per value head made once, contiguous, for both products (a copy into the permuted view was
        # materialized once per reader); bufs.keys a copy of it (the commit reads its k rows)
        keys3, k_t = _compiled_keys(v, consts, bufs)
    qk = v.keys

    state0 = recurrent_state if recurrent_state is None or recurrent_state.dtype == f32 else recurrent_state.to(f32)
    if method == "recurrent":
        core = bufs.core.copy_(_recurrent_rule(qk, v.value, state0, meta, bufs))
    elif not compiling:  # the solve below as one fused op (kernels.gdn.delta_rule)
        kgdn.delta_rule(v.keys3, v.value, None if state0 is None else _state3(state0, v), bufs.decays, bufs.gram,
                        bufs.from_state, bufs.deltas, bufs.core, meta.depth_bound)
        core = bufs.core
    else:
        # (batched matmuls as bmm on 3-d views: matmul's out= computes into a temporary and copies)
        torch.bmm(keys3, k_t, out=v.gram3)
        v.gram.mul_(v.ancestry)
        if state0 is None:
            rhs = v.value
        else:
            torch.bmm(keys3, _state3(state0, v), out=v.from_state)  # (B Hv, 2T, dv)
            # the right side written where d goes: the solve then runs in place (no copy of it into its out=)
            rhs = torch.addcmul(v.value, v.start, v.state_k, value=-1, out=bufs.deltas)
        torch.linalg.solve_triangular(v.gram_k, rhs, upper=False, unitriangular=True, out=bufs.deltas)
        torch.bmm(v.gram_q, v.deltas, out=v.core)
        core = bufs.core
        if state0 is not None:
            core.addcmul_(v.start, v.state_q)
    return (consts.out_op or module.out_proj)(_gated_norm(core, z, consts, bufs, v))


def _batch_conv(module, past: torch.Tensor, mixed: torch.Tensor, consts: LayerConsts, meta: TreeMeta,
                bufs: LayerBuffers, v: _Views) -> None:
    """The conv of a batch of trees into v.conv (T, N C) where the fused op does not run (a compiled graph, an
    activation other than silu): the tap-scaled table of every row of [conv-state tail, inputs] viewed a row per
    (tap, row, stream), then per node and stream the sum of its window's K rows (TreeMeta.conv_index)."""
    torch.cat([past, mixed], dim=1, out=bufs.extended)
    n, channels = mixed.shape[1], mixed.shape[2]
    if v.table is not None and not torch.compiler.is_compiling():
        table = torch.mul(v.rows, consts.conv_taps, out=bufs.table).view(-1, channels)
        conv = F.embedding_bag(meta.conv_index, table, meta.conv_offsets, mode="sum")  # (T N, C)
    else:  # (the compiled round: a graph fuses the table, the gather and the sum)
        table = (v.rows * consts.conv_taps).reshape(-1, channels)
        conv = table.index_select(0, meta.conv_index).view(-1, module.conv_kernel_size, channels).sum(1)
    if consts.conv_bias is not None:
        conv.add_(consts.conv_bias)
    conv = conv.view(n, -1)
    if module.activation == "silu":
        torch._C._nn.silu(conv, out=v.conv)
    else:
        v.conv.copy_(_activation(module.activation)(conv))


def _compiled_keys(v: _Views, consts: LayerConsts, bufs: LayerBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled round's q/k rows: (keys3 (B Hv, 2T, dk) contiguous, its k rows transposed (B Hv, dk, T)), the
    normalised rows repeated per value head as `_Views.qk_rows` lays them into bufs.keys (also written: the commit
    and the recurrent method read it). The same values as the eager `kgdn.qk_norm`'s."""
    rows = F.rms_norm(v.qk, (v.qk.shape[-1],), consts.qk_weight, consts.qk_eps).expand(v.qk_rows.shape)
    keys3 = rows.permute(0, 3, 4, 2, 1, 5).reshape(v.keys3.shape)  # (B, Hk, Hv/Hk, 2, T, dk) flat
    bufs.keys.copy_(keys3.view(bufs.keys.shape))
    n = keys3.shape[1] // 2
    return keys3, keys3[:, n:].transpose(1, 2)


def _past(conv_state: torch.Tensor | None, kernel: int, mixed: torch.Tensor, v: _Views) -> torch.Tensor:
    """The conv state's last K columns token-major (B, K, C), in the inputs' dtype, zeros before the first token; a
    view of the state where it needs no copy, kept while the state tensor is the same (it is updated in place)."""
    if conv_state is None:
        return mixed.new_zeros(mixed.shape[0], kernel, mixed.shape[-1])
    if v.past[0] is conv_state:
        return v.past[1]
    past = conv_state[..., -kernel:].transpose(1, 2)
    if past.dtype == mixed.dtype and past.shape[1] == kernel and not torch.compiler.is_compiling():
        v.past[:] = conv_state, past
        return past
    if past.dtype != mixed.dtype:
        past = past.to(mixed.dtype)
    if past.shape[1] < kernel:
        past = F.pad(past, (0, 0, kernel - past.shape[1], 0))
    return past


def _state3(state: torch.Tensor, v: _Views) -> torch.Tensor:
    """The recurrent state (B, Hv, dk, dv) as (B Hv, dk, dv); the view kept while the state tensor is the same."""
    if v.state[0] is state:
        return v.state[1]
    if torch.compiler.is_compiling() or not state.is_contiguous():  # (flattening a strided state copies it)
        return state.flatten(0, 1)
    v.state[:] = state, state.flatten(0, 1)
    return v.state[1]


def _projections(module, hidden_states: torch.Tensor, consts: LayerConsts):
    """The input projections: conv input (B, T, C), gate z (B, T, Hv dv) and [a + dt_bias, -b], the last one matmul
    (B, T, 2 Hv) where a and b are plain Linear layers, else stacked (B, T, 2, Hv)."""
    bsz, n, _ = hidden_states.shape
    hv = module.num_v_heads
    if consts.ab_weight is not None:
        mixed = (consts.qkv_op or module.in_proj_qkv)(hidden_states)
        z = (consts.z_op or module.in_proj_z)(hidden_states)
        return mixed, z, F.linear(hidden_states, consts.ab_weight, consts.ab_bias)
    mixed, z, b, a = _project(module, hidden_states)
    ab = torch.stack([a.reshape(bsz, n, hv) + consts.dt_bias, -b.reshape(bsz, n, hv).float()], dim=2)
    return mixed, z.reshape(bsz, n, -1), ab


def _gated_norm(core: torch.Tensor, z: torch.Tensor, consts: LayerConsts, bufs: LayerBuffers, v: _Views) -> torch.Tensor:
    """The module's RMSNormGated of o = core / sqrt(dk), times silu(z), into bufs.out: (B, T, Hv dv); one fused op
    (kernels.gdn.gated_norm: F.rms_norm, silu, and the product written in the model's dtype). core (B, Hv, T, dv).

    weight * x / sqrt(mean(x^2) + eps) with x = core / sqrt(dk) is weight * core / sqrt(mean(core^2) + eps dk):
    rms_norm(core, weight, eps * dk) (norm_weight, norm_eps).
    """
    if torch.compiler.is_compiling() or z.dtype != bufs.gate.dtype:  # (dynamo refuses a strided out=; a graph fuses it)
        normed = F.rms_norm(core, (core.shape[-1],), consts.norm_weight, consts.norm_eps)  # (B, Hv, T, dv) float32
        gate = F.silu(z).unflatten(-1, (normed.shape[1], normed.shape[-1]))  # (B, T, Hv, dv)
        return (normed.transpose(1, 2) * gate).to(bufs.out.dtype).flatten(2)
    kgdn.gated_norm(core, z, consts.norm_weight, consts.norm_eps, bufs.gate, bufs.out)
    return v.out


def _recurrent_rule(qk: torch.Tensor, value: torch.Tensor, state0: torch.Tensor | None, meta: TreeMeta,
                    bufs: LayerBuffers) -> torch.Tensor:
    """The "recurrent" method: every node's d and output, one batched step per depth level (a cross-check of the
    chunk's solve; not the launch-lean path). Writes d into bufs.deltas; returns the output (B, Hv, T, dv)."""
    bsz, hv, two_n, dk = qk.shape
    n = two_n // 2
    gates = bufs.gates
    g = -(gates[..., :n] * gates[..., n:n + 1])  # (B, Hv, T)
    beta = torch.exp(-gates[..., n + 1:2 * n + 1])
    query, key = qk[:, :, :n], qk[:, :, n:]
    dv = value.shape[-1]
    if state0 is None:
        state0 = qk.new_zeros(bsz, hv, dk, dv)
    core = torch.zeros_like(value, dtype=torch.float32)
    deltas = bufs.deltas.zero_()
    states = state0.unsqueeze(2).expand(bsz, hv, n, dk, dv).contiguous()  # S after each node, so far
    depths, parents = meta.depths, meta.parents
    if meta.streams:  # a batch: each stream's own parents and levels, (N, 1, T, ...) against (N, Hv, T, ...)
        gather = parents[:, None, :, None, None].expand(bsz, hv, n, dk, dv)
        level = depths[:, None, :, None]
    for depth in range(meta.depth_bound + 1):
        here = depths == depth if not meta.streams else level == depth  # (T, 1) or (N, 1, T, 1) against core
        if depth == 0:
            parent_states = state0.unsqueeze(2)
        else:
            parent_states = states[:, :, parents] if not meta.streams else states.gather(2, gather)
        decayed = parent_states * g.exp()[..., None, None]
        delta = value - (decayed * key.unsqueeze(-1)).sum(-2)
        new = decayed + key.unsqueeze(-1) * (beta[..., None] * delta).unsqueeze(-2)
        at = here[:, None] if not meta.streams else here  # where the level's nodes are, against core and d
        states = torch.where(at[..., None], new, states)
        core = torch.where(at, (new * query.unsqueeze(-1)).sum(-2), core)
        deltas.copy_(torch.where(at, delta, deltas))
    return core
