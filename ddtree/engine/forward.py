"""A lean target forward: the model's own modules driven directly, without the model-level wrappers.

A decode-sized forward of a small target is mostly host work, and about a tenth of it is spent above
the decoder layers: the output-capturing hooks and `ModelOutput` records, the config-default and
deprecation decorators, and a causal-mask build whose result the engine already knows (no mask for
a single token or a split tree verification; its own dense tree mask otherwise). `LeanForward` runs
the same modules in the same order — embeddings, rotary table, each decoder layer's forward, final
norm, head — so its logits and hidden states are bitwise those of `model(...)` (tested per family).

It only runs where that equality is known to hold: a family whose table row names its position
layout (`Family.lean`), the base model class that row was checked against, an eager or sdpa backend
(theirs or our tree wrapper of it), no sliding-window layers, no accelerate device map, and, per call,
a mask the engine knows (`TargetSession` decides). Everything else goes through `model(...)`.

Each decoder layer of a known class runs as a `LeanLayer`: the same operations as its forward, in the same
order, on the same tensors, without a module call per submodule (a decode-sized layer makes about twenty,
each with its hook checks and decorators). Its norms, residual adds, q/k norms with RoPE, attention tail and MLP
activation are fused ops (`ddtree.engine.kernels`, docs/kernels.md): on the CPU the module's arithmetic, bitwise
(tested); on CUDA one Triton kernel each, equal to a tolerance (the last bit of a reduction). A layer, norm,
attention or MLP of any other class runs its own forward.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ddtree.engine.families import MROPE_TEXT, ROPE, family, model_type
from ddtree.engine.gdn.forward import traced_forward
from ddtree.engine.kernels import fused
from ddtree.engine.kernels import norm as kernel_norm
from ddtree.engine.kernels.attention import gate_output, silu_mul
from ddtree.engine.kernels.rope import norm_rope
from ddtree.engine.sharded import linear_op, styles
from ddtree.engine.weights import plain, plain_linear

__all__ = ["LazyTail", "LeanForward", "LeanLayer", "RopeTables", "lean_add_norm", "lean_forward_for", "lean_norm", "lean_text_rotary", "rope_cos_sin"]

# RMSNorms: w * normalize(x.float()).to(dtype)  (Llama style) and (normalize(x.float()) * (1 + w.float())).type_as(x)
_NORMS_SCALED = {"Qwen3RMSNorm", "LlamaRMSNorm"}
_NORMS_CENTERED = {"Qwen3_5RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm"}
# attentions: q/k/v projections (+ per-head q/k norms), RoPE, cache update, the configured attention function,
# o projection; gated ones also split a sigmoid gate off the q projection
_ATTENTIONS = {"Qwen3Attention": False, "LlamaAttention": False, "Qwen3_5Attention": True,
               "Qwen3_5MoeAttention": True, "Qwen3NextAttention": True}
_MLPS = {"Qwen3MLP", "LlamaMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP", "Qwen3NextMLP"}  # down(act(gate(x)) * up(x))
# pre-norm residual layers: x + mixer(norm1(x)), then + mlp(norm2(.)) (a tuple from an MoE block: its first item)
_LAYERS = {"Qwen3DecoderLayer", "LlamaDecoderLayer", "Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer",
           "Qwen3NextDecoderLayer"}
# modeling modules whose apply_rotary_pos_emb(q, k, cos, sin) is, on the first r = cos.shape[-1] dims of each head,
# x * cos + rotate_half(x) * sin (cos and sin unsqueezed at dim 1), the other dims passed through (partial rotary)
_ROPE_MODULES = {f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen3", "qwen3_5", "qwen3_5_moe",
                                                                     "qwen3_next")}


def _inert(hook: Callable) -> bool:
    """transformers' output-capturing hooks: installed by the first `output_hidden_states` call and left in place,
    they act only while that model call collects outputs, never inside a LeanForward."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _inert_pre(hook: Callable) -> bool:
    """A tensor-parallel replicated norm's pre-hook (transformers' `replicated_with_grad_allreduce`): it only hooks
    gradient all-reduces on parameters, when autograd is on; a forward without gradients (the engine's) is untouched."""
    return (getattr(hook, "__module__", "").startswith("transformers.distributed")
            and getattr(hook, "__qualname__", "").startswith("ReplicatedWithGradAllReduce."))


def _norm_parts(norm: torch.nn.Module) -> tuple[Callable[[], torch.Tensor], float, bool] | None:
    """(the weight the fused op takes, eps, centered) of a norm class whose arithmetic is known, else None.
    A centred norm's weight is 1 + w in float32, rebuilt when w changes (its identity and version: host attributes,
    no op, no sync)."""
    name = type(norm).__name__
    if name not in _NORMS_SCALED | _NORMS_CENTERED or not plain(norm.weight):
        return None
    weight = norm.weight
    if name in _NORMS_SCALED:
        return (lambda: weight), norm.variance_epsilon, False
    scale: list = [None, None]  # (the weight's identity and version, 1 + weight in float32)

    def centred_scale() -> torch.Tensor:
        if torch.compiler.is_compiling():  # (a graph traces no data pointer: the scale built eagerly, else in it)
            return scale[1] if scale[1] is not None else 1.0 + weight.detach().float()
        key = (weight.data_ptr(), weight._version)
        if scale[0] != key:
            with torch.no_grad():
                scale[:] = key, 1.0 + weight.detach().float()
        return scale[1]

    return centred_scale, norm.eps, True


def lean_norm(norm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm.forward` as one fused op (`kernels.norm.rms_norm`) where its class is known, else itself."""
    return _lean_norms(norm)[0]


def lean_add_norm(norm: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """fn(h, x) = (norm(x + h), x + h): a decoder layer's residual add and the norm after it as one fused op
    (`kernels.norm.add_rms_norm`), or the two steps where the norm's class is not known."""
    return _lean_norms(norm)[1]


def _lean_norms(norm: torch.nn.Module) -> tuple[Callable, Callable]:
    """(lean_norm, lean_add_norm) of one norm, sharing its weight (a centred norm's 1 + w is built once for both).

    The ops' CPU implementation is the module's float32 arithmetic (bitwise, tested): a Llama-style norm
    `w * F.rms_norm(x, None, eps)` (normalised in float32, rounded once to x's dtype, then the weight's product), a
    centred one `F.rms_norm(x.float(), 1 + w, eps).type_as(x)`; the add rounds `x + h` to x's dtype first. On CUDA
    one Triton kernel (2 and 3 launches with torch's own ops, whose fused kernel takes a weight of the input's dtype
    only; 1 more for the add). A graph or autograd runs the composite (`kernels.fused`)."""
    parts = _norm_parts(norm)
    if parts is None:
        def unfused(h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = x + h
            return norm.forward(x), x
        return norm.forward, unfused
    weight_of, eps, centered = parts

    def one(x: torch.Tensor) -> torch.Tensor:
        weight = weight_of()
        op = kernel_norm.rms_norm if fused(weight) else kernel_norm._norm
        return op(x, weight, eps, centered)

    def with_add(h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight_of()
        op = kernel_norm.add_rms_norm if fused(weight) and h.dtype == x.dtype else kernel_norm._add_norm
        return op(h, x, weight, eps, centered)

    return one, with_add


# text-only M-RoPE tables whose forward is, for three equal position rows, the plain table of the positions:
# freqs = pos * inv_freq (float32), cos/sin of [freqs, freqs] times attention_scaling, cast to the input's dtype
# (the recomposition of the three rows copies equal values)
_TEXT_MROPE_ROTARY = {"Qwen3_5TextRotaryEmbedding", "Qwen3_5MoeTextRotaryEmbedding"}


def lean_text_rotary(rotary: torch.nn.Module) -> Callable | None:
    """`rotary.forward(x, position_ids[None].expand(3, ...))` as fn(x, position_ids [B, T]) in 8 ops (the module's
    takes ~30: three rows, then the recomposition's selects and copies), bitwise the same; None where the class or
    its RoPE type (a dynamic one rescales inv_freq) is not the one checked."""
    if type(rotary).__name__ not in _TEXT_MROPE_ROTARY or getattr(rotary, "rope_type", None) != "default":
        return None

    return lambda x, position_ids: rope_cos_sin(x, position_ids, rotary.inv_freq, rotary.attention_scaling)


def rope_cos_sin(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, r] of a default RoPE as transformers' Qwen3/Qwen3-Next rotary forwards compute them
    (freqs = pos * inv_freq in float32, cos and sin of [freqs, freqs] times `scaling`, cast to x's dtype), bitwise,
    without their no-op ops (inv_freq already float32 on x's device, a scaling of 1.0): 8 ops."""
    if inv_freq.dtype != torch.float32 or inv_freq.device != x.device:
        inv_freq = inv_freq.to(device=x.device, dtype=torch.float32)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:  # (x * 1.0 is x)
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _linear(module: torch.nn.Module, tp: dict[int, str] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module.forward` as the engine runs it: F.linear on its plain weights, this rank's shard and the style's
    collective on a tensor-parallel target (`tp`: ddtree.engine.sharded.styles), else the module's own forward."""
    if tp and id(module) in tp:
        sharded = linear_op(module, tp[id(module)])
        if sharded is not None:
            return sharded
    if not plain_linear(module):  # a quantized projection computes with its own kernels (ddtree.engine.weights)
        return module.forward
    weight, bias = module.weight, module.bias
    return lambda x: F.linear(x, weight, bias)


def _rope_perm(rotary: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """The index that swaps the two rotated halves of a head (the rest in place)."""
    return torch.cat([torch.arange(rotary // 2, rotary), torch.arange(rotary // 2),
                      torch.arange(rotary, head_dim)]).to(device)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RopeTables' (cos', sin', perm) of (cos, sin) [B, T, r] for a head size."""
    r = cos.shape[-1]
    half, pad = r // 2, head_dim - r
    sin_parts = [-sin[..., :half], sin[..., half:]]
    if pad:
        sin_parts.append(sin.new_zeros(*sin.shape[:-1], pad))
        cos = torch.cat([cos, cos.new_ones(*cos.shape[:-1], pad)], dim=-1)
    perm = _rope_perm(r, head_dim, cos.device) if perm is None else perm
    return cos.unsqueeze(1), torch.cat(sin_parts, dim=-1).unsqueeze(1), perm


class RopeTables:
    """The rotary embedding in 4 ops a tensor (the module's takes 11, plus 2 unsqueezes a layer): over the whole head,
    x * cos' + x[..., perm] * sin' with cos' = [cos, 1], sin' = [-sin_1, sin_2, 0] and perm swapping the two rotated
    halves. Per element these are the module's own products and sum ((-a) b = a (-b) exactly, and x * 1 + x * 0 = x
    for a finite x), so the result is bitwise the module's (tests/test_forward.py). The tables are built once per
    forward (by the first attention layer) and shared by every layer of the model."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # (cos, head_dim) the tables were built for
        self.cos = self.sin = self.perm = None
        self.perms: dict[tuple, torch.Tensor] = {}
        self._rows: tuple | None = None  # (the tables' cos', their row-layout tables)

    def tables(self, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
        """(cos', sin', perm) for this forward's (cos, sin) [B, T, r] and a head size (in a compiled graph: built
        there, nothing kept on the host side)."""
        if torch.compiler.is_compiling():
            return _rope_tables(cos, sin, head_dim)
        if self.key is None or self.key[0] is not cos or self.key[1] != head_dim:
            self.key = (cos, head_dim)
            perm_key = (cos.shape[-1], head_dim, cos.device)
            if perm_key not in self.perms:
                self.perms[perm_key] = _rope_perm(cos.shape[-1], head_dim, cos.device)
            self.cos, self.sin, self.perm = _rope_tables(cos, sin, head_dim, perm=self.perms[perm_key])
        return self.cos, self.sin, self.perm

    def row_tables(self, tables: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`tables` for x in its projection's layout [B, T, heads, d] (views, made once a forward)."""
        cos, sin, perm = tables
        if torch.compiler.is_compiling():
            return cos.transpose(1, 2), sin.transpose(1, 2), perm
        if self._rows is None or self._rows[0] is not cos:
            self._rows = cos, (cos.transpose(1, 2), sin.transpose(1, 2), perm)
        return self._rows[1]

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [B, heads, T, d] rotated by `tables` (cos', sin', perm) of its positions."""
        cos, sin, perm = tables
        return x * cos + x.index_select(-1, perm) * sin


def _plain_function(fn):
    """`fn`, or the function a `kernels` hub wrapper calls: with the `kernels` package installed, transformers'
    `use_kernelized_func` turns a modeling module's `apply_rotary_pos_emb` into an nn.Module (`Func`) whose forward
    calls the function, or a hub kernel inside the forward of a kernelized model (`use_kernels`: on by default in
    `from_pretrained` from 5.25; the pipeline's loader turns it off). The lean forward computes the function itself."""
    if isinstance(fn, torch.nn.Module):
        for cell in getattr(type(fn).forward, "__closure__", None) or ():
            if inspect.isfunction(cell.cell_contents):
                return cell.cell_contents
    return fn


class LeanLayer:
    """One decoder layer's forward, step for step, without the submodule calls (see the module docstring).
    rope_tables: the model's shared RopeTables (LeanForward passes one), or None for the module's own RoPE.
    tp: a tensor-parallel target's styles (ddtree.engine.sharded.styles): its projections run on this rank's shards."""

    def __init__(self, layer: torch.nn.Module, rope_tables: RopeTables | None = None, tp: dict[int, str] | None = None):
        self.layer = layer
        self.norm1, self.add_norm1 = _lean_norms(layer.input_layernorm)
        self.norm2, self.add_norm2 = _lean_norms(layer.post_attention_layernorm)
        self.linear = getattr(layer, "block_type", None) == "linear_attention"
        if not self.linear:
            attn = layer.self_attn
            self.attn, self.gated = attn, _ATTENTIONS[type(attn).__name__]
            self.q, self.k, self.v, self.o = (_linear(getattr(attn, n), tp) for n in ("q_proj", "k_proj", "v_proj",
                                                                                     "o_proj"))
            norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
            self.q_norm, self.k_norm = (None if m is None else lean_norm(m) for m in norms)
            # known q and k norms: each head's norm and its RoPE as one fused op (kernels.rope) where RoPE runs as
            # RopeTables
            self.norm_parts = (None if None in norms else (_norm_parts(norms[0]), _norm_parts(norms[1])))
            modeling = sys.modules[type(attn).__module__]
            self.rotary, self.eager = _plain_function(modeling.apply_rotary_pos_emb), modeling.eager_attention_forward
            # the module's RoPE in fewer ops (RopeTables) where its formula is the one checked
            known = getattr(self.rotary, "__module__", None) in _ROPE_MODULES
            # (with the `kernels` package installed the name is a hub-kernel wrapper module, no __name__: its own call)
            self.rope_tables = (rope_tables if known and getattr(self.rotary, "__name__", None) == "apply_rotary_pos_emb"
                                else None)
            # what each class passes its attention function besides dropout and scaling
            self.extra = {"sliding_window": attn.sliding_window} if type(attn).__name__ == "Qwen3Attention" else {}
        mlp = layer.mlp
        if type(mlp).__name__ in _MLPS:
            gate, up, down = _linear(mlp.gate_proj, tp), _linear(mlp.up_proj, tp), _linear(mlp.down_proj, tp)
            if type(mlp.act_fn) is SiLUActivation:  # silu and the product: one fused op (a graph: the composite)
                self.mlp = lambda x: down(silu_mul(gate(x), up(x)))
            else:
                act = mlp.act_fn.forward
                self.mlp = lambda x: down(act(gate(x)) * up(x))
        else:
            self.mlp = lambda x: mlp.forward(x)  # looked up per call: a patch may be installed later

    @staticmethod
    def supports(layer: torch.nn.Module) -> bool:
        """A checked layer class whose submodules carry no hooks to honour (a user's, accelerate's offload)."""
        if type(layer).__name__ not in _LAYERS:
            return False
        stack = [layer]  # every submodule, walked by hand: modules() and hasattr cost ~0.4 ms a session here
        while stack:
            m = stack.pop()
            state = m.__dict__
            if ("_hf_hook" in state or not all(map(_inert_pre, m._forward_pre_hooks.values()))
                    or not all(map(_inert, m._forward_hooks.values()))):
                return False
            stack.extend(c for c in state["_modules"].values() if c is not None)
        if getattr(layer, "block_type", None) == "linear_attention":
            return hasattr(layer, "linear_attn")
        return type(getattr(layer, "self_attn", None)).__name__ in _ATTENTIONS

    def _query_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(query [B, T, heads, d] before its norm and RoPE, the gate [B, T, heads, d] of a gated attention or
        None)."""
        attn = self.attn
        shape = x.shape[:-1]
        if self.gated:  # the gate stays [B, T, heads, d] (the module flattens it: a copy; _attend needs no copy)
            query, gate = torch.chunk(self.q(x).view(*shape, -1, attn.head_dim * 2), 2, dim=-1)
            return query, gate
        return self.q(x).view(*shape, -1, attn.head_dim), None

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(query [B, heads, T, d] before RoPE, the gate [B, T, heads, d] of a gated attention or None)."""
        query, gate = self._query_rows(x)
        if self.q_norm is not None:
            query = self.q_norm(query)
        return query.transpose(1, 2), gate

    def _fused_norm_rope(self) -> tuple | None:
        """((q weight, eps, centred), (k ...)) where each head's norm and RoPE run as one `norm_rope` op: known
        norms, eager, no autograd (kernels.rope), else None."""
        parts = self.norm_parts
        if parts is None or parts[0] is None or parts[1] is None:
            return None
        (q_weight, q_eps, q_centered), (k_weight, k_eps, k_centered) = parts
        wq, wk = q_weight(), k_weight()
        if not fused(wq, wk):
            return None
        return (wq, q_eps, q_centered), (wk, k_eps, k_centered)

    def _key_value_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key before RoPE, value) in the projections' layout [B, T, kv heads, d]."""
        heads = (*x.shape[:-1], -1, self.attn.head_dim)
        key = self.k(x).view(heads)
        if self.k_norm is not None:
            key = self.k_norm(key)
        return key, self.v(x).view(heads)

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key before RoPE, value), [B, kv heads, T, d]."""
        key, value = self._key_value_rows(x)
        return key.transpose(1, 2), value.transpose(1, 2)

    def _row_writer(self, cache) -> Callable | None:
        """The cache layer's `update_rows` (ddtree.engine.kv_cache.PreallocatedLayer: keys and values written in their
        projections' layout, no transposes), where this layer's RoPE runs as RopeTables; else None."""
        if cache is None or self.rope_tables is None or getattr(cache, "offloading", False):
            return None
        layers, idx = getattr(cache, "layers", None), self.attn.layer_idx
        return getattr(layers[idx], "update_rows", None) if layers is not None and idx < len(layers) else None

    def _cache_attend(self, cache) -> Callable | None:
        """The cache layer's own attention over the keys it returned (`attend(query, key, value, mask, scale)` ->
        [B, T, heads, d]: the batched round's slots, ddtree.engine.batch), else None (the configured function)."""
        layers = getattr(cache, "layers", None)
        idx = self.attn.layer_idx
        return getattr(layers[idx], "attend", None) if layers is not None and idx < len(layers) else None

    def _attend(self, query, gate, key, value, mask, position_ids, cache=None) -> torch.Tensor:
        """The configured attention function over (key, value) (the cache layer's own where it has one), the gate,
        the o projection: [B, T, hidden]."""
        attn = self.attn
        own = self._cache_attend(cache) if cache is not None else None
        if own is not None:
            out = own(query, key, value, mask, attn.scaling)  # [B, T, heads, d]
            if gate is not None:
                return self.o(gate_output(out, gate))
            return self.o(out.reshape(*query.shape[:1], query.shape[2], -1))
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, self.eager)
        dropout = 0.0 if not attn.training else attn.attention_dropout
        gated = getattr(attend, "gated", None) if gate is not None else None
        if gated is not None:  # a split tree verification: its merge and the gate in one op ([B, T, heads * d])
            out = gated(attn, query, gate, key, value, mask, dropout=dropout, scaling=attn.scaling, **self.extra,
                        position_ids=position_ids)
            if out is not None:
                return self.o(out)
        out, _ = attend(attn, query, key, value, mask, dropout=dropout, scaling=attn.scaling, **self.extra,
                        position_ids=position_ids)  # [B, T, heads, d]
        if gate is not None:  # the module's out * sigmoid(gate) (on the gate's contiguous copy: gate_output)
            return self.o(gate_output(out, gate))
        return self.o(out.reshape(*query.shape[:1], query.shape[2], -1))

    def _attention(self, x: torch.Tensor, rope, mask: torch.Tensor | None, cache, position_ids) -> torch.Tensor:
        write = self._row_writer(cache) if len(rope) == 2 else None
        fused = self._fused_norm_rope() if write is not None else None
        if fused is not None:  # each head's norm and RoPE one op for q and for k (on the tables' row layout)
            (wq, q_eps, q_centered), (wk, k_eps, k_centered) = fused
            query, gate = self._query_rows(x)
            tables = self.rope_tables.tables(rope[0], rope[1], query.shape[-1])
            cos, sin, perm = self.rope_tables.row_tables(tables)
            query = norm_rope(query, wq, q_eps, q_centered, cos, sin, perm).transpose(1, 2)
            heads = (*x.shape[:-1], -1, self.attn.head_dim)
            key = norm_rope(self.k(x).view(heads), wk, k_eps, k_centered, cos, sin, perm)
            key, value = write(key, self.v(x).view(heads))
            return self._attend(query, gate, key, value, mask, position_ids, cache)
        query, gate = self._queries(x)
        if write is not None:  # RoPE on the keys' rows (the tables' transposed views), written as they are
            tables = self.rope_tables.tables(rope[0], rope[1], query.shape[-1])
            query = RopeTables.apply(query, tables)
            key, value = self._key_value_rows(x)
            key, value = write(RopeTables.apply(key, self.rope_tables.row_tables(tables)), value)
            return self._attend(query, gate, key, value, mask, position_ids, cache)
        key, value = self._keys_values(x)
        if self.rope_tables is not None and len(rope) == 2:
            tables = self.rope_tables.tables(rope[0], rope[1], query.shape[-1])
            query, key = RopeTables.apply(query, tables), RopeTables.apply(key, tables)
        else:
            query, key = self.rotary(query, key, *rope)
        if cache is not None:
            key, value = cache.update(key, value, self.attn.layer_idx, kwargs={"position_ids": position_ids})
        return self._attend(query, gate, key, value, mask, position_ids, cache)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.norm2(x))
        if isinstance(h, tuple):
            h = h[0]
        return x + h

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, rope, position_ids, cache,
                 pending: torch.Tensor | None = None, defer: bool = False):
        """The layer's output x + mixer + MLP. pending: the previous layer's MLP output not yet added to x (its add
        runs fused with this layer's first norm); defer=True: returns (x + mixer, the MLP output) unadded, for the
        next layer (or the final norm) to add in its fused norm. Each residual add and the norm after it are one
        op (`lean_add_norm`)."""
        if pending is None:
            h = self.norm1(x)
        else:
            h, x = self.add_norm1(pending, x)
        if self.linear:
            # its forward looked up per call: the GDN patch (ddtree.engine.gdn) may be installed after this was built;
            # a graph calls the patch's wrapper itself (dynamo does not call through its proxy)
            if torch.compiler.is_compiling():
                h = traced_forward(self.layer.linear_attn, h, cache)
            else:
                h = self.layer.linear_attn.forward(hidden_states=h, cache=cache, attention_mask=None)
        else:
            h = self._attention(h, rope, mask, cache, position_ids)
        h, x = self.add_norm2(h, x)
        h = self.mlp(h)
        if isinstance(h, tuple):
            h = h[0]
        return (x, h) if defer else x + h


class LazyTail:
    """The last decoder layer and the final norm of a verification, for the rows a greedy walk reads only.

    Every node's keys and values go to the cache at once (the committed path needs them, and the asked rows
    attend over them), but the queries, the attention itself, the o projection, the MLP and the final norm run
    only for the rows asked, one batch per ask, each row once. A greedy walk reads its own path (and a few rows
    beside it), so on a 257-node tree the last layer's query-side work shrinks to a tenth or less.

    `final(nodes)`: the final-norm rows of `nodes` [k, hidden]; the same arithmetic as the full layer, row by
    row (the batch is smaller, so a row can differ from the full forward's in the last bits, as a decode step's
    does).
    """

    def __init__(self, lean: LeanLayer, x: torch.Tensor, rope, mask: torch.Tensor, position_ids, cache,
                 final_norm: Callable[[torch.Tensor], torch.Tensor]):
        self.lean, self.x, self.mask, self.position_ids, self.final_norm = lean, x, mask, position_ids, final_norm
        self.h = lean.norm1(x)
        key, value = lean._keys_values(self.h)
        _, key = lean.rotary(key, key, *rope)
        if cache is not None:
            key, value = cache.update(key, value, lean.attn.layer_idx, kwargs={"position_ids": position_ids})
        self.key, self.value, self.rope = key, value, rope
        self._rows: dict[int, torch.Tensor] = {}

    def final(self, nodes: list[int]) -> torch.Tensor:
        todo = list(dict.fromkeys(i for i in nodes if i not in self._rows))
        if todo:
            idx = torch.tensor(todo, device=self.x.device)
            lean = self.lean
            query, gate = lean._queries(self.h[:, idx])
            cos, sin, *more = self.rope
            query, _ = lean.rotary(query, query, cos[:, idx], sin[:, idx], *more)
            out = lean._attend(query, gate, self.key, self.value, self.mask[:, :, idx],
                               self.position_ids[:, idx])
            rows = self.final_norm(lean._feed_forward(self.x[:, idx] + out))[0]
            self._rows.update(zip(todo, rows.unbind(0), strict=True))
        return torch.stack([self._rows[i] for i in nodes])


class LeanForward:
    """`model(input_ids, position_ids, attention_mask, cache)` for one supported model, minus the wrappers.

    Returns (logits [T', V], hidden states by index): hidden[0] is the embeddings, hidden[i] the output of
    decoder layer i - 1, the last one after the final norm, as `output_hidden_states` numbers them.
    head=False: the rows the head would read (after the final norm) instead of their logits. head="lazy": where
    the last layer allows it (`lazy_tail`) and `mask` is a tensor, a `LazyTail` that computes the last layer
    and the final norm for asked rows only (hidden states up to the last layer's input are kept as usual); else
    as head=False.
    """

    def __init__(self, model: PreTrainedModel, base: torch.nn.Module, positions: str):
        self.base = base
        self.head = model.lm_head
        self.layers = list(base.layers)[: base.config.num_hidden_layers]  # (slicing the ModuleList builds a new one)
        types = getattr(base.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.linear = [t == "linear_attention" for t in types[: len(self.layers)]]
        self.positions = positions
        rope = RopeTables()  # one per model: built by its first attention layer of a forward, read by the others
        tp = styles(model)  # a tensor-parallel target: each projection on this rank's shard (ddtree.engine.sharded)
        self.lean_layers = [LeanLayer(layer, rope, tp) if LeanLayer.supports(layer) else None for layer in self.layers]
        self.head_op = _linear(self.head, tp) if tp else None  # (None: the head's forward, looked up per call)
        self.final_norm, self.final_add_norm = _lean_norms(base.norm)
        self.text_rotary = lean_text_rotary(base.rotary_emb) if positions == MROPE_TEXT else None
        # head="lazy" can stop before the last layer: an attention layer run as a LeanLayer (see LazyTail)
        self.lazy_tail = bool(self.layers) and self.lean_layers[-1] is not None and not self.linear[-1]

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
                 keep: list[int] | None = None, logits_to_keep: int = 0,
                 head: bool | str = True) -> tuple[torch.Tensor | LazyTail, dict]:
        base = self.base
        hidden = base.embed_tokens.forward(ids)
        if self.text_rotary is not None:
            rope = self.text_rotary(hidden, position_ids)
        else:
            rope_ids = position_ids if self.positions == ROPE else position_ids[None].expand(3, *position_ids.shape)
            rope = base.rotary_emb.forward(hidden, rope_ids)
        wanted = set(keep or ())
        kept = {0: hidden} if 0 in wanted else {}
        last = len(self.layers)
        tail = head == "lazy" and self.lazy_tail and mask is not None and logits_to_keep == 0
        pending = None  # the last lean layer's MLP output, added by the next fused norm (LeanLayer.__call__)
        for i, layer in enumerate(self.layers):
            lean = self.lean_layers[i]
            if lean is None or (tail and i + 1 == last):
                if pending is not None:
                    hidden, pending = hidden + pending, None
                if lean is not None:
                    return LazyTail(lean, hidden, rope, mask, position_ids, cache, self.final_norm), kept
                hidden = layer.forward(hidden, attention_mask=None if self.linear[i] else mask,
                                       position_embeddings=rope, position_ids=position_ids, cache=cache)
            else:
                hidden, pending = lean(hidden, None if self.linear[i] else mask, rope, position_ids, cache,
                                       pending=pending, defer=True)
            if i + 1 in wanted and i + 1 != last:
                if pending is not None:
                    hidden, pending = hidden + pending, None
                kept[i + 1] = hidden
        if pending is None:
            hidden = self.final_norm(hidden)
        else:
            hidden, _ = self.final_add_norm(pending, hidden)
        if last in wanted:
            kept[last] = hidden
        rows = hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
        return ((self.head_op or self.head.forward)(rows) if head is True else rows), kept


# base model classes whose forward LeanForward reproduces (checked against transformers 5.24; tests/test_forward.py)
_BASES = {"Qwen3Model", "LlamaModel", "Qwen3NextModel", "Qwen3_5TextModel", "Qwen3_5MoeTextModel"}


def lean_forward_for(model: PreTrainedModel) -> LeanForward | None:
    """The lean forward of `model`, or None where the plain model call must run (see the module docstring)."""
    positions = family(model_type(model)).lean
    base = getattr(model, "model", None)
    if positions not in (ROPE, MROPE_TEXT) or type(base).__name__ not in _BASES or not hasattr(model, "lm_head"):
        return None
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        return None  # accelerate's hooks move activations between devices at the model level too
    if any("_hf_hook" in m.__dict__ for m in (model, base, base.embed_tokens, model.lm_head)):  # (hasattr: slow)
        return None
    return LeanForward(model, base, positions)
