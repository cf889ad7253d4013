"""One GDN layer's constants (LayerConsts) and buffers (LayerBuffers), and the buffers a cache shares
across its GDN layers so that a commit reads every layer's rows at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddtree.engine.sharded import gathered_linear, sharded_linear, whole_weight
from ddtree.engine.weights import plain, plain_linear

L2NORM_EPS = 1e-6  # upstream's l2norm of q and k


@dataclass
class LayerConsts:
    """One GDN layer's weights as `tree_layer` uses them (float32 unless said), built once per cache.

    conv_taps (K, 1, 1, C) (tap k of channel c, k = 0 the oldest), conv_bias (C) or None; ab_weight (2 Hv, hidden) = [W_a; -W_b] and ab_bias = [dt_bias; 0] in the
    model's dtype, where a and b are plain bias-free Linear layers (None: the module's own projections);
    dt_bias (Hv); decay_rate (Hv) = exp(A_log); zero (1,): softplus(x) = logaddexp(x, zero), in float32 whatever x's
    dtype. The q/k l2norm and the gated norm are each one `F.rms_norm` (one fused kernel on a GPU): qk_weight (dk) =
    dk^-1/2 and qk_eps = eps / dk (x / sqrt(|x|^2 + eps) = x rsqrt(mean(x^2) + eps / dk) dk^-1/2); norm_weight (dv) = the
    gated norm's weight and norm_eps = its eps * dk (it sees core = o sqrt(dk), see `_gated_norm`).
    On a tensor-parallel target (transformers' plan gathers the GDN projections' outputs: the layer runs whole on
    every rank) [W_a; -W_b] is gathered whole once (2 Hv rows) and qkv_op / z_op / out_op are this rank's shard plus
    one all-gather each (ddtree.engine.sharded); None elsewhere (the module's own projections).
    """

    conv_taps: torch.Tensor
    conv_bias: torch.Tensor | None
    ab_weight: torch.Tensor | None
    ab_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    decay_rate: torch.Tensor
    zero: torch.Tensor
    qk_weight: torch.Tensor
    qk_eps: float
    norm_weight: torch.Tensor
    norm_eps: float
    qkv_op: object = None
    z_op: object = None
    out_op: object = None


def _bias_free(layer) -> bool:
    """A plain bias-free Linear whose weight may be concatenated (a quantized one is called: ddtree.engine.weights),
    or a tensor-parallel one whose whole weight is gathered once (small: a and b have a row per value head)."""
    return (plain_linear(layer) or sharded_linear(layer)) and layer.bias is None


def layer_consts(module) -> LayerConsts:
    """The LayerConsts of a GDN module (a handful of small ops: once per cache in the engine)."""
    weight = module.conv1d.weight
    bias = module.conv1d.bias
    for name, tensor in (("conv1d.weight", weight), ("conv1d.bias", bias), ("norm.weight", module.norm.weight)):
        if not plain(tensor):  # no backend quantizes these today; computing on packed values would be silently wrong
            raise NotImplementedError(f"the tree-exact GDN reads {name} directly and it is quantized "
                                      f"({type(tensor).__name__}); keep the GDN conv and norm unquantized")
    ab_weight = ab_bias = None
    if not hasattr(module, "in_proj_qkvz") and _bias_free(module.in_proj_a) and _bias_free(module.in_proj_b):
        wa, wb = (layer.weight if plain_linear(layer) else whole_weight(layer)
                  for layer in (module.in_proj_a, module.in_proj_b))
        ab_weight = torch.cat([wa, -wb])
        ab_bias = torch.cat([module.dt_bias.to(wa.dtype), torch.zeros_like(module.dt_bias, dtype=wa.dtype)])
    dk = module.head_k_dim
    eps = module.norm.variance_epsilon
    return LayerConsts(
        conv_taps=weight.squeeze(1).float().t().contiguous()[:, None, None],
        conv_bias=None if bias is None else bias.float(),
        ab_weight=ab_weight, ab_bias=ab_bias,
        dt_bias=module.dt_bias.float(),
        decay_rate=module.A_log.float().exp(),
        zero=torch.zeros(1, device=weight.device),
        qk_weight=torch.full((dk,), dk ** -0.5, device=weight.device), qk_eps=L2NORM_EPS / dk,
        norm_weight=module.norm.weight.float(),
        # the gated norm sees o / sqrt(dk) (q's scale, not applied): eps * dk, see _gated_norm
        norm_eps=eps * dk,
        qkv_op=gathered_linear(getattr(module, "in_proj_qkv", None)), z_op=gathered_linear(getattr(module, "in_proj_z", None)),
        out_op=gathered_linear(module.out_proj))


@dataclass
class LayerBuffers:
    """Where `tree_layer` writes: what the commit reads (slots of the cache's shared buffers, or fresh tensors) and
    the layer's scratch (used and dropped within the layer: one set shared by every layer of a cache).

    Kept for the commit: extended (B, K + T, C): the conv state's last K columns then the tree's conv inputs,
    token-major; keys (B, Hk, Hv/Hk, 2, T, dk): normalised q then k rows per value head; gates (B, Hv, 2T + 2): the
    decay map's input, its A and 1 entries filled once; xy (B, Hv, 6T + 3): X and Y; deltas (B, Hv, T, dv): d.
    Scratch (float32 unless said): conv (T, B, C): the conv's output; decays (B Hv, T, T + 1): E; gram (B, Hv, 2T, T); from_state (B, Hv, 2T, dv); core (B, Hv, T, dv);
    gate (B, T, Hv dv) in the model's dtype: silu(z); out (B, T, Hv, dv) in the model's dtype: the gated norm's output;
    table (K, K + T, B, C): every tap times every row of `extended`, the conv's gather-and-sum reads it (None in the
    compiled round's buffers: a graph computes it in place of reading it).
    Every view `tree_layer` takes of them is made once (`views`), not per call: on a GPU without graphs a view is a
    dispatch the host pays like a launch.
    """

    extended: torch.Tensor
    keys: torch.Tensor
    gates: torch.Tensor
    xy: torch.Tensor
    deltas: torch.Tensor
    conv: torch.Tensor
    decays: torch.Tensor
    gram: torch.Tensor
    from_state: torch.Tensor
    core: torch.Tensor
    gate: torch.Tensor
    out: torch.Tensor
    views: _Views | None = None
    table: torch.Tensor | None = None


# the buffers a layer's forward uses and drops (one of each for all layers); the rest are kept for the commit
_SCRATCH = ("conv", "decays", "gram", "from_state", "core", "gate", "out", "table")
_MODEL_DTYPE = ("extended", "gate", "out")  # in the model's dtype; the others float32


def _buffer_shapes(module, bsz: int, n: int, channels: int) -> dict[str, tuple[int, ...]]:
    hk, hv, dk, dv, k = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim, module.conv_kernel_size
    return {"extended": (bsz, k + n, channels), "keys": (bsz, hk, hv // hk, 2, n, dk),
            "gates": (bsz, hv, 2 * n + 2), "xy": (bsz, hv, 6 * n + 3), "deltas": (bsz, hv, n, dv),
            "conv": (n, bsz, channels),
            "decays": (bsz * hv, n, n + 1), "gram": (bsz, hv, 2 * n, n), "from_state": (bsz, hv, 2 * n, dv),
            "core": (bsz, hv, n, dv), "gate": (bsz, n, hv * dv),
            "out": (bsz, n, hv, dv)}


def _table_shape(module, bsz: int, n: int, channels: int) -> tuple[int, ...]:
    k = module.conv_kernel_size
    return (k, k + n, bsz, channels)


def tree_buffer_bytes(module, n: int, channels: int, dtype_bytes: int) -> tuple[int, int]:
    """(kept, scratch): the bytes one stream's tree of `n` nodes takes in these buffers, from the shapes above (module:
    anything with a GDN layer's num_k_heads, num_v_heads, head_k_dim, head_v_dim and conv_kernel_size; no tensor is
    made): kept, a slot per GDN layer (what the commit reads); scratch, one set for all layers."""
    shapes = {**_buffer_shapes(module, 1, n, channels), "table": _table_shape(module, 1, n, channels)}
    kept = scratch = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * (dtype_bytes if name in _MODEL_DTYPE else 4)
        if name in _SCRATCH:
            scratch += size
        else:
            kept += size
    return kept, scratch


@dataclass
class _Views:
    """The views of one LayerBuffers that tree_layer reads and writes through (see there), made once."""

    ab: torch.Tensor  # (B, T, 2, Hv) of gates: [softplus(a + dt) | softplus(-b)]
    rows: torch.Tensor  # (K + T, B, C) of extended
    table: torch.Tensor | None  # (K (K + T), B C) of table
    conv: torch.Tensor  # (T, B C) of conv
    qk: torch.Tensor  # (B, T, 2, Hk, 1, dk) of conv: q and k rows
    qk_rows: torch.Tensor  # (B, T, 2, Hk, Hv/Hk, dk) of keys: where each row goes, once per value head of its key head
    keys: torch.Tensor  # (B, Hv, 2T, dk): [q rows; k rows]
    keys3: torch.Tensor  # (B Hv, 2T, dk)
    k_t: torch.Tensor  # (B Hv, dk, T): the k rows transposed
    value: torch.Tensor  # (B, Hv, T, dv) of conv
    gates: torch.Tensor  # (B Hv, 2T + 2)
    xy: torch.Tensor  # (B Hv, 6T + 3)
    start: torch.Tensor  # (B, Hv, T, 1): exp(c_i)
    ancestry: torch.Tensor  # (B, Hv, 1, T, T): exp(c_i - c_j) beta_j on ancestors
    gram: torch.Tensor  # (B, Hv, 2, T, T)
    gram3: torch.Tensor  # (B Hv, 2T, T)
    gram_q: torch.Tensor  # (B Hv, T, T): its q rows
    gram_k: torch.Tensor  # (B, Hv, T, T): its k rows
    from_state: torch.Tensor  # (B Hv, 2T, dv)
    state_q: torch.Tensor  # (B, Hv, T, dv) of from_state
    state_k: torch.Tensor
    deltas: torch.Tensor  # (B Hv, T, dv)
    core: torch.Tensor  # (B Hv, T, dv)
    gate_t: torch.Tensor  # (B, Hv, T, dv) of gate
    out_t: torch.Tensor  # (B, Hv, T, dv) of out
    out: torch.Tensor  # (B, T, Hv dv)
    past: list  # [conv state, its last K columns token-major (B, K, C)]: the last state seen, a view of it
    state: list  # [recurrent state (B, Hv, dk, dv) float32, as (B Hv, dk, dv)]: the same


def _views(module, bufs: LayerBuffers) -> _Views:
    """bufs.views, made on first use (in a compiled graph: made there, views cost nothing in a graph)."""
    if bufs.views is not None:
        return bufs.views
    if torch.compiler.is_compiling():
        return _make_views(module, bufs)
    bufs.views = _make_views(module, bufs)
    return bufs.views


def _make_views(module, bufs: LayerBuffers) -> _Views:
    hk, hv, dk, dv, k = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim, module.conv_kernel_size
    bsz, n = bufs.deltas.shape[0], bufs.deltas.shape[2]
    conv = bufs.conv.transpose(0, 1)  # (B, T, C)
    qk = conv[..., :2 * hk * dk].view(bsz, n, 2, hk, 1, dk)
    keys = bufs.keys.view(bsz, hv, 2 * n, dk)
    xy = bufs.xy.view(bsz * hv, -1)
    decays = bufs.decays.view(bsz, hv, n, n + 1)
    gram = bufs.gram.view(bsz, hv, 2, n, n)
    return _Views(
        ab=bufs.gates.view(bsz, hv, 2, n + 1)[..., :n].permute(0, 3, 2, 1),
        rows=bufs.extended.transpose(0, 1), table=None if bufs.table is None else bufs.table.view(k * (k + n), -1),
        conv=bufs.conv.view(n, -1), qk=qk,
        qk_rows=bufs.keys.permute(0, 4, 3, 1, 2, 5),
        keys=keys, keys3=keys.view(bsz * hv, 2 * n, dk), k_t=keys.view(bsz * hv, 2 * n, dk)[:, n:].transpose(1, 2),
        value=conv[..., 2 * hk * dk:].view(bsz, n, hv, dv).transpose(1, 2),
        gates=bufs.gates.view(bsz * hv, -1), xy=xy,
        start=decays[..., :1], ancestry=decays[..., 1:].unsqueeze(2),
        gram=gram, gram3=bufs.gram.view(bsz * hv, 2 * n, n), gram_q=bufs.gram.view(bsz * hv, 2 * n, n)[:, :n],
        gram_k=gram[:, :, 1], from_state=bufs.from_state.view(bsz * hv, 2 * n, dv),
        state_q=bufs.from_state[:, :, :n], state_k=bufs.from_state[:, :, n:],
        deltas=bufs.deltas.view(bsz * hv, n, dv), core=bufs.core.view(bsz * hv, n, dv),
        gate_t=bufs.gate.view(bsz, n, hv, dv).transpose(1, 2), out_t=bufs.out.transpose(1, 2),
        out=bufs.out.view(bsz, n, -1),
        past=[None, None], state=[None, None])


def _fill_gates(gates: torch.Tensor, consts: LayerConsts) -> None:
    n = (gates.shape[-1] - 2) // 2
    gates[..., n].copy_(consts.decay_rate)
    gates[..., 2 * n + 1].fill_(1)


def new_buffers(module, hidden_states: torch.Tensor, consts: LayerConsts, channels: int) -> LayerBuffers:
    """Fresh LayerBuffers for one forward (outside the engine's inference mode: nothing shared)."""
    bsz, n, _ = hidden_states.shape
    shapes = _buffer_shapes(module, bsz, n, channels)
    dev = hidden_states.device
    bufs = LayerBuffers(**{name: torch.empty(shape, device=dev, dtype=hidden_states.dtype if name in _MODEL_DTYPE
                                             else torch.float32) for name, shape in shapes.items()},
                        table=torch.empty(_table_shape(module, bsz, n, channels), device=dev))
    _fill_gates(bufs.gates, consts)
    return bufs


_SHARED_ATTR = "_ddtree_gdn_shared"


def _slot_of(cache, layer: int) -> tuple[dict[str, torch.Tensor], int]:
    """(the shared buffers as they are now, this layer's slot): what a commit checks to read a group at once."""
    shared = cache.__dict__[_SHARED_ATTR]
    return dict(shared["bufs"]), shared["slots"][layer]


def _shared_layer(cache, module, hidden_states: torch.Tensor, channels: int):
    """(LayerConsts, LayerBuffers) of this layer kept on the cache, the buffers slots of (G, ...) buffers shared by
    the cache's linear-attention layers so that a commit reads every layer's rows with one op; None outside
    inference mode (writing into a buffer with out= does not differentiate) or without a cache.

    The constants are built at the layer's first verification on this cache (a cache lives one generation: its
    weights do not change under it); the buffers are kept across rounds (a commit consumes them before the next
    verification writes them again) and replaced when the tree's size changes. None in a compiled graph too (the
    compiled batched round: each layer's buffers are the graph's own)."""
    if cache is None or torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return None
    shared = cache.__dict__.get(_SHARED_ATTR)
    if shared is None:
        linear = [i for i, entry in enumerate(getattr(cache, "layers", ())) if hasattr(entry, "recurrent_states")]
        shared = cache.__dict__[_SHARED_ATTR] = {"slots": {i: g for g, i in enumerate(linear)}, "consts": {},
                                                 "bufs": {}, "filled": set()}
    layer = module.layer_idx
    slot = shared["slots"].get(layer)
    if slot is None:
        return None
    consts = shared["consts"].get(layer)
    if consts is None:
        consts = shared["consts"][layer] = layer_consts(module)
    bsz, n, _ = hidden_states.shape
    key = (bsz, n, channels, hidden_states.dtype, hidden_states.device, module.num_k_heads, module.num_v_heads,
           module.head_k_dim, module.head_v_dim, module.conv_kernel_size)
    if shared.get("key") != key:  # (re)allocate what no longer fits; the per-slot LayerBuffers are rebuilt
        shapes = {**_buffer_shapes(module, bsz, n, channels), "table": _table_shape(module, bsz, n, channels)}
        for name, shape in shapes.items():
            dtype = hidden_states.dtype if name in _MODEL_DTYPE else torch.float32
            # scratch is used at once: one for all layers; the rest has a slot per layer (the commit reads them)
            full = shape if name in _SCRATCH else (len(shared["slots"]), *shape)
            buf = shared["bufs"].get(name)
            if buf is None or buf.shape != full or buf.dtype != dtype or buf.device != hidden_states.device:
                shared["bufs"][name] = torch.empty(full, dtype=dtype, device=hidden_states.device)
                if name == "gates":
                    shared["filled"] = set()
        shared["key"], shared["layers"] = key, {}
    bufs = shared["layers"].get(slot)
    if bufs is None:
        found = shared["bufs"]
        bufs = shared["layers"][slot] = LayerBuffers(**{
            name: buf if name in _SCRATCH else buf[slot] for name, buf in found.items()})
    if slot not in shared["filled"]:
        _fill_gates(bufs.gates, consts)
        shared["filled"].add(slot)
    return consts, bufs
