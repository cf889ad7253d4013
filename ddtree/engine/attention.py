"""Tree attention for one-pass draft-tree verification, as transformers attention implementations.

Split attention (wrapping eager, sdpa, flash_attention_2/3). Inside `tree_verification(...)` each
attention call of the target is computed in two parts and merged exactly by log-sum-exp:

  (a) the tree's queries over the cached prefix, with no mask, on the fastest kernel that returns
      the log-sum-exp (flash-attn where installed, torch's fused SDPA kernels, else plain math);
  (b) the tree's queries over the tree's own keys under the ancestor mask (plus, on a sliding
      layer, the at most `depth` prefix keys at the window's edge that only shallow nodes see).

      o = sum_p exp(lse_p - lse) o_p,   lse = log sum_p exp(lse_p)      (attention sinks: one more term, o = 0)

Nothing the size of the context is built per round: (a) takes no mask, (b) is [tree x (tree + depth)].
GQA: in part (a) every query head of a key/value group attends the same keys with no mask, so the
group's queries are stacked along the sequence (no key/value copies); part (b) tiles its small mask.

flex_attention: one flex call whose BlockMask lists the prefix blocks as full (no mask_mod) and the
blocks holding tree keys as partial (mask_mod reads the padded ancestor matrix). Queries are padded
to a multiple of the block size and every per-round value the mask_mod reads is a tensor, so a
compiled kernel is reused round after round (a few compiles per 128-query bucket while the key
length turns symbolic, then none; measured on CPU inductor).

The split runs inside `tree_verification(tree, past)` (ddtree.engine.verification: one context, shared with
the tree-exact GDN). Outside verification (prefill, AR steps, DFlash chains) every implementation is exactly its plain
backend, masks included. `use_tree_attention(model)` switches a model to the implementation wrapping
its current backend; it is idempotent and harmless for plain forwards.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddtree.engine.kernels import fused
from ddtree.engine.kernels.attention import gate_output, merge2, merge_attention
from ddtree.engine.verification import TreeVerification, active, tree_verification
from ddtree.errors import ConfigError

log = logging.getLogger(__name__)

# tree-verifying implementation name -> the plain backend it wraps (mirrored in ddtree.pipeline.schema)
SPLIT_IMPLEMENTATIONS = {
    "ddtree_split": "sdpa",
    "ddtree_split_eager": "eager",
    "ddtree_split_fa2": "flash_attention_2",
    "ddtree_split_fa3": "flash_attention_3",
    "ddtree_flex": "flex_attention",
}
TREE_IMPLEMENTATION = {base: name for name, base in SPLIT_IMPLEMENTATIONS.items()}
FLEX_BLOCK = 128  # flex's default sparse block size; tree queries are padded to a multiple of it


# --------------------------------------------------------------------------- verification context
# One context for the tree attention and the tree-exact GDN (ddtree.engine.verification): the attention part is
# active when the verification was given the committed length `past`.


def _active_tree() -> TreeVerification | None:
    ctx = active()
    return ctx if ctx is not None and ctx.attention else None


# --------------------------------------------------------------------------- window geometry


def window_bounds(kp: int, past: int, pos0: int, window: int | None, depth_bound: int) -> tuple[int, int, int]:
    """(lo, hi, lo0) over prefix key indices: [hi, kp) is seen by every node, [lo, hi) by some (the band).

    Key j sits at position pos0 + j; a node at depth d sees it iff pos0 + j > past + d - window,
    i.e. j >= lo0 + d with lo0 = past - window + 1 - pos0 (transformers' sliding-window rule).
    """
    if window is None:
        return 0, 0, -(1 << 62)
    lo0 = past - window + 1 - pos0
    lo = min(max(lo0, 0), kp)
    hi = min(max(lo0 + depth_bound, 0), kp)
    return lo, hi, lo0


def _tree_visibility(ctx: TreeVerification, lo: int, hi: int, lo0: int, window: int | None) -> torch.Tensor:
    """[n, (hi - lo) + n] bool: band keys then tree keys, for part (b)."""
    d = ctx.depths
    tree_ok = ctx.ancestors
    if window is not None:
        tree_ok = tree_ok & ((d[:, None] - d[None, :]) < window)
    if hi <= lo:
        return tree_ok
    j = torch.arange(lo, hi, device=d.device)
    band_ok = j[None, :] >= (lo0 + d)[:, None]
    return torch.cat([band_ok, tree_ok], dim=1)


# --------------------------------------------------------------------------- attention with log-sum-exp


def _math_lse(q, k, v, bias, scale):
    """Reference path: fp32 scores. q [B,h,L,D], k/v [B,h,S,D], bias [L,S] additive or None."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return o, lse


def _cpu_flash_lse(q, k, v, bias, scale):
    mask = bias if bias is None or (bias.ndim == 4 and bias.dtype == q.dtype) else bias.to(q.dtype)[None, None]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                        scale=scale)
    return o, lse


def _aten_flash_lse(q, k, v, bias, scale):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return out[0], out[1]


def _aten_efficient_lse(q, k, v, bias, scale):
    b = None
    if bias is not None:
        L, S = bias.shape[-2:]
        bias = bias.reshape(L, S)
        pad = (-S) % 16  # the kernel wants the bias rows 16-aligned in memory
        full = torch.zeros(L, S + pad, dtype=q.dtype, device=q.device)
        full[:, :S] = bias
        b = full[:, :S][None, None].expand(q.shape[0], q.shape[1], L, S)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, False, scale=scale)
    return out[0], out[1][..., : q.shape[2]]


def _flash_attn_lse(module_name: str):
    def run(q, k, v, bias, scale):
        mod = __import__(module_name, fromlist=["flash_attn_func"])
        out = mod.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                  causal=False, return_attn_probs=True)
        return out[0].transpose(1, 2), out[1]

    return run


_KERNELS: dict[str, Callable] = {
    "math": _math_lse,
    "cpu_flash": _cpu_flash_lse,
    "aten_flash": _aten_flash_lse,
    "aten_efficient": _aten_efficient_lse,
    "flash_attn": _flash_attn_lse("flash_attn"),
    "flash_attn_3": _flash_attn_lse("flash_attn_interface"),
}
_CHOSEN: dict[tuple, str] = {}


def _candidates(base: str, device: torch.device, dtype: torch.dtype, masked: bool) -> list[str]:
    if base == "eager":
        return ["math"]
    if device.type == "cpu":
        return ["cpu_flash", "math"]
    if device.type != "cuda":
        return ["math"]
    half = dtype in (torch.float16, torch.bfloat16)
    out = []
    if not masked and half:
        if base == "flash_attention_3":
            out.append("flash_attn_3")
        if base in ("flash_attention_2", "flash_attention_3"):
            out.append("flash_attn")
        out.append("aten_flash")
    out += ["aten_efficient", "math"]
    return out


def _probe(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Run a kernel once on small inputs against the math path; any failure or mismatch rules it out."""
    if name == "math":
        return True
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, 2, L, head_dim, generator=g).to(device, dtype) for L in (24, 40, 40))
        bias = None
        if masked:
            bias = torch.zeros(24, 40, device=device, dtype=dtype)
            bias[:, 30:] = torch.finfo(dtype).min
        o, lse = _KERNELS[name](q, k, v, bias, head_dim ** -0.5)
        ro, rlse = _math_lse(q, k, v, bias, head_dim ** -0.5)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = (o.shape == ro.shape and lse.shape == rlse.shape and torch.allclose(o.float(), ro, atol=tol, rtol=tol)
              and torch.allclose(lse.float(), rlse, atol=tol, rtol=tol))
    except Exception as e:  # a kernel this build / device / dtype lacks
        log.debug("tree attention: %s unavailable (%s)", name, e)
        return False
    if not ok:
        log.warning("tree attention: kernel %s disagrees with the math path on %s/%s; not used", name, device, dtype)
    return ok


def attention_lse(q, k, v, bias, scale, base: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp on the fastest working kernel. q [B,h,L,D], k/v [B,h,S,D] (same h).

    bias: None or an additive [L, S] (or [1, 1, L, S]) mask. Returns (o [B,h,L,D], lse [B,h,L] float32).
    """
    key = (base, q.device.type, q.dtype, q.shape[-1], bias is not None)
    name = _CHOSEN.get(key)
    if name is None:
        name = next(c for c in _candidates(base, q.device, q.dtype, bias is not None)
                    if _probe(c, q.device, q.dtype, q.shape[-1], bias is not None))
        _CHOSEN[key] = name
        log.info("tree attention: %s part on %s for %s/%s", "masked" if bias is not None else "prefix", name,
                 q.device.type, q.dtype)
    return _KERNELS[name](q, k, v, bias, scale)


def chosen_kernels() -> dict[str, str]:
    """Which kernel each (base, device, dtype, head_dim, masked) ran on so far (for benchmarks)."""
    return {"/".join(str(x) for x in k): v for k, v in _CHOSEN.items()}


def merge_lse(parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax over the union of the parts' keys: parts of (o [...,L,D], lse [...,L]); sink: lse of an o=0 part.
    Returns float32 (float64 where an o is).

    Two parts (a tree verification's prefix and tree, no sink): part 1's weight exp(lse_1) / (exp(lse_1) + exp(lse_2))
    is w = sigmoid(lse_1 - lse_2), and o = o_2 + w (o_1 - o_2) is one lerp of the float32 outputs: 4 ops (6 with the
    two casts of half outputs; `merge2`, which a split verification runs fused with its layout, cast and gate:
    `merge_attention`). Otherwise weights relative to the largest lse."""
    if sink is None and len(parts) == 2:
        return merge2(*parts[0], *parts[1])
    lses = [lse if lse.dtype == torch.float32 else lse.float() for _, lse in parts]
    outs = [o if o.dtype in (torch.float32, torch.float64) else o.float() for o, _ in parts]
    if sink is not None:
        lses.append(sink.float())
    top = torch.stack(lses).amax(dim=0)
    exps = [torch.exp(lse - top) for lse in lses]
    total = sum(exps[1:], exps[0])
    out = None
    for o, e in zip(outs, exps, strict=False):  # (the sink's term is zero)
        term = o * (e / total).unsqueeze(-1)
        out = term if out is None else out + term
    return out


# --------------------------------------------------------------------------- split implementation


def _split_verify(ctx: TreeVerification, base: str, module, query, key, value, kwargs,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """[B, n, H, D] in the query's dtype; with a gated attention's gate [B, n, H, D]: out * sigmoid(gate),
    [B, n, H * D]. Two parts without a sink (a verification's prefix and tree), eager: one fused op from the parts'
    outputs to the (gated) output (ddtree.engine.kernels.attention.merge_attention)."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise NotImplementedError("tree verification does not support attention logit soft-capping or position bias")
    B, H, n, D = query.shape
    hkv, S = key.shape[1], key.shape[2]
    g = H // hkv
    kp = S - n  # prefix keys held by this layer (fewer than past on a cropped sliding cache)
    scale = kwargs.get("scaling")
    scale = D ** -0.5 if scale is None else scale
    window = kwargs.get("sliding_window")
    pos0 = ctx.past - kp
    lo, hi, lo0 = window_bounds(kp, ctx.past, pos0, window, ctx.depth_bound)
    sinks = kwargs.get("s_aux")
    if base == "eager" and sinks is not None and getattr(module, "sinks", None) is sinks:  # its eager reads them
        out = _eager_whole(ctx, module, query, key, value, scale, (lo, hi, lo0, window, kp))
        return out if gate is None else gate_output(out, gate)
    # a key/value group's queries share keys and (in part a) have no mask: stack them along the sequence
    qp = query.reshape(B, hkv, g * n, D)
    parts = []
    # [below the window, the band, seen by all, the tree]: one split (views) each, not a slice per part
    sizes = [lo, hi - lo, kp - hi, n]
    _, k_band, k_all, k_tree = key.split(sizes, dim=2)
    _, v_band, v_all, v_tree = value.split(sizes, dim=2)
    if hi < kp:
        parts.append(attention_lse(qp, k_all, v_all, None, scale, base))
    if hi > lo:
        k_small, v_small = torch.cat([k_band, k_tree], dim=2), torch.cat([v_band, v_tree], dim=2)
    else:
        k_small, v_small = k_tree, v_tree

    def build_bias():
        ok = _tree_visibility(ctx, lo, hi, lo0, window).to(query.device)
        if g > 1:  # rows follow the stacked queries: group member j, then node i
            ok = ok.repeat(g, 1)
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return zero.where(ok, torch.finfo(query.dtype).min)[None, None]  # [1, 1, L, S]: as the kernels take it

    # per device too: under a device map the layers of one forward sit on different devices
    bias = ctx.memo(("bias", lo, hi, lo0, window, g, query.dtype, query.device), build_bias)
    parts.append(attention_lse(qp, k_small, v_small, bias, scale, base))
    sink = kwargs.get("s_aux")
    if sink is not None:  # one learned logit per head, with a zero value
        sink = sink.float().reshape(hkv, g, 1).expand(hkv, g, n).reshape(1, hkv, g * n).expand(B, -1, -1)
    if sink is None and len(parts) == 2 and fused(*parts[0], *parts[1], *([] if gate is None else [gate])):
        return merge_attention(*parts[0], *parts[1], gate, H, query.dtype)
    out = merge_lse(parts, sink)
    # [B, n, H, D] contiguous: the model's reshape of it to [B, n, H * D] is then a view, not a second copy (reshape:
    # a view of a merge in the parts' [B, kv, g * n, D] layout, a copy of one in CUDA flash's [B, g * n, kv, D])
    out = out.reshape(B, H, n, D).transpose(1, 2).to(query.dtype, memory_format=torch.contiguous_format)
    return out if gate is None else gate_output(out, gate)


def _eager_whole(ctx: TreeVerification, module, query, key, value, scale: float, bounds: tuple) -> torch.Tensor:
    """Eager with attention sinks (gpt-oss): the module's own eager function over the keys any node sees, under one
    additive mask. Its softmax over [logits, sink] runs in the model's dtype, which a float32 merge of parts does not
    reproduce in bf16 (a tiny MoE turned the difference into a suspect output); eager builds the [n, keys] scores
    anyway, so the one mask costs that much again, not more."""
    lo, hi, lo0, window, kp = bounds
    n = query.shape[2]

    def build_mask():
        vis = _tree_visibility(ctx, lo, hi, lo0, window).to(query.device)  # [band, tree] columns
        band = max(hi - lo, 0)
        ok = torch.cat([vis[:, :band], vis.new_ones(n, kp - max(hi, lo)), vis[:, band:]], dim=1)
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return zero.where(ok, torch.finfo(query.dtype).min)[None, None]

    mask = ctx.memo(("whole", lo, hi, lo0, window, kp, query.dtype, query.device), build_mask)
    out, _ = _model_eager(module)(module, query, key[:, :, lo:], value[:, :, lo:], mask, scaling=scale, dropout=0.0)
    return out


def _model_eager(module) -> Callable:
    """The eager function of the module's own modeling file (models differ: sinks, softcap)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


class _ConfigView:
    """A config as the plain flash backend must see it: its own name, not the wrapper's."""

    def __init__(self, config, base: str):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_attn_implementation", base)

    def __getattr__(self, name):
        return getattr(self._config, name)


class _ModuleView:
    def __init__(self, module, base: str):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", _ConfigView(module.config, base))

    def __getattr__(self, name):
        return getattr(self._module, name)


def _plain_forward(base: str) -> Callable:
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    if base == "eager":
        return lambda module, *a, **kw: _model_eager(module)(module, *a, **kw)
    if base.startswith("flash_attention"):
        from transformers.integrations.flash_attention import flash_attention_forward

        # transformers picks the flash kernel by the module's configured name, which is now ours
        return lambda module, *a, **kw: flash_attention_forward(_ModuleView(module, base), *a, **kw)
    if base == "flex_attention":
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward
    raise ValueError(f"no plain backend {base!r}")


def split_attention(base: str) -> Callable:
    """The attention function registered for `base`: split tree attention inside verification, else plain."""
    plain = _plain_forward(base)
    verify = _flex_verify if base == "flex_attention" else _split_verify

    def attention(module, query, key, value, attention_mask, **kwargs):
        ctx = _active_tree()
        if ctx is None or query.shape[2] != ctx.n or key.shape[2] < ctx.n:
            return plain(module, query, key, value, attention_mask, **kwargs)
        return verify(ctx, base, module, query, key, value, kwargs), None

    def gated(module, query, gate, key, value, attention_mask, **kwargs):
        """A gated attention's out * sigmoid(gate) [B, T, H * D] inside a verification (the merge and the gate in
        one op), or None: the caller runs `attention` and gates its output."""
        ctx = _active_tree()
        if ctx is None or query.shape[2] != ctx.n or key.shape[2] < ctx.n:
            return None
        return _split_verify(ctx, base, module, query, key, value, kwargs, gate)

    attention.__name__ = f"ddtree_tree_attention_{base}"
    if verify is _split_verify:
        attention.gated = gated
    return attention


def _split_mask(base: str) -> Callable:
    """Mask builder: none during verification (the attention builds its own), the base's otherwise."""

    def mask(*args, **kwargs):
        if _active_tree() is not None:
            return None
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)

    return mask


# --------------------------------------------------------------------------- flex implementation


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flex_block_mask(ctx: TreeVerification, kp: int, kv_len: int, window: int | None, pos0: int,
                    device: torch.device):
    """BlockMask over [tree (padded) x (prefix ++ tree)] built from block lists, never from the full grid.

    Prefix blocks every node sees are full (no mask_mod); the window's edge and the tree's blocks are partial.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, B = ctx.n, FLEX_BLOCK
    qpad = _round_up(n, B)
    lo, hi, lo0 = window_bounds(kp, ctx.past, pos0, window, ctx.depth_bound)
    nkv = -(-kv_len // B)
    full_lo, full_hi = -(-hi // B), kp // B
    first = lo // B
    if full_hi <= full_lo:
        full_lo = full_hi = nkv
        partial = torch.arange(first, nkv, device=device)
    else:
        partial = torch.cat([torch.arange(first, full_lo, device=device), torch.arange(full_hi, nkv, device=device)])
    full = torch.arange(full_lo, full_hi, device=device)
    qb = qpad // B

    def rows(idx: torch.Tensor):
        table = torch.zeros(1, 1, qb, nkv, dtype=torch.int32, device=device)
        table[..., : idx.shape[0]] = idx.to(torch.int32)
        return torch.full((1, 1, qb), idx.shape[0], dtype=torch.int32, device=device), table

    num, idx = rows(partial)
    fnum, fidx = rows(full)

    anc = torch.zeros(qpad, qpad, dtype=torch.bool, device=device)
    anc[:n, :n] = ctx.ancestors
    depth = torch.zeros(qpad, dtype=torch.long, device=device)
    depth[:n] = ctx.depths
    kp_t = torch.full((), kp, dtype=torch.long, device=device)  # tensors, not ints: no recompiles
    last_t = torch.full((), qpad - 1, dtype=torch.long, device=device)
    past_t = torch.full((), ctx.past, dtype=torch.long, device=device)
    pos0_t = torch.full((), pos0, dtype=torch.long, device=device)

    def mask_mod(b, h, q, kv):
        in_prefix = kv < kp_t
        t = torch.minimum((kv - kp_t).clamp_min(0), last_t)
        ok = in_prefix | anc[q, t]
        if window is not None:
            kpos = torch.where(in_prefix, kv + pos0_t, past_t + depth[t])
            ok = ok & (kpos > past_t + depth[q] - window)
        return ok

    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(qpad, kv_len))


_COMPILED_FLEX: list[Callable] = []  # one compiled flex for every verification (a cache, not state)


def _flex_kernel(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if not _COMPILED_FLEX:
        # automatic dynamic shapes: static first, then symbolic lengths (dynamic=True trips a CPU inductor
        # codegen bug with captured index tensors in torch 2.13; the default path compiles fine)
        _COMPILED_FLEX.append(torch.compile(flex_attention))
    return _COMPILED_FLEX[0]


def _flex_verify(ctx: TreeVerification, base: str, module, query, key, value, kwargs) -> torch.Tensor:
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("flex tree verification does not support soft-capping or attention sinks; "
                                  "use attention=sdpa (split tree attention)")
    B, H, n, D = query.shape
    kv_len = key.shape[2]
    kp = kv_len - n
    window = kwargs.get("sliding_window")
    pos0 = ctx.past - kp
    scale = kwargs.get("scaling")
    block_mask = ctx.memo(("flex", kp, kv_len, window, pos0, query.device),
                          lambda: flex_block_mask(ctx, kp, kv_len, window, pos0, query.device))
    qpad = _round_up(n, FLEX_BLOCK)
    q = F.pad(query, (0, 0, 0, qpad - n))
    out = _flex_kernel(ctx.flex_compile)(q, key, value, block_mask=block_mask, scale=scale,
                                         enable_gqa=H != key.shape[1])
    return out[:, :, :n].transpose(1, 2)


# --------------------------------------------------------------------------- registration


def register() -> None:
    """Register every tree implementation with transformers (idempotent). Not done at import: `use_tree_attention`
    and a load by name (ddtree.pipeline.models.load_target) call it when a model needs one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, base in SPLIT_IMPLEMENTATIONS.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, split_attention(base))
            AttentionMaskInterface.register(name, _split_mask(base))


def base_backend(name: str) -> str:
    return SPLIT_IMPLEMENTATIONS.get(name, name)


def use_tree_attention(model) -> str:
    """Switch `model` to the tree implementation wrapping its backend; returns the name. Idempotent."""
    current = model.config._attn_implementation
    if current in SPLIT_IMPLEMENTATIONS:
        return current
    name = TREE_IMPLEMENTATION.get(current)
    if name is None:
        raise ConfigError("attention.target", f"draft trees cannot be verified on the '{current}' backend",
                          f"use one of: {', '.join(TREE_IMPLEMENTATION)}")
    register()
    model.set_attn_implementation(name)
    return name


__all__ = ["SPLIT_IMPLEMENTATIONS", "TreeVerification", "tree_verification", "active", "attention_lse", "merge_lse",
           "window_bounds", "flex_block_mask", "split_attention", "register", "use_tree_attention", "base_backend",
           "chosen_kernels"]
