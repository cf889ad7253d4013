"""The patched GDN forward: inside a tree verification, the tree-exact layer (`tree_layer`) with what the
commit needs recorded on the cache; the single-token CPU step inside `single_step()`."""

from __future__ import annotations

import torch

from ddtree.engine import verification
from ddtree.engine.gdn.buffers import _shared_layer, _slot_of, layer_consts, new_buffers
from ddtree.engine.gdn.commit import _PENDING_ATTR, _Pending, _versions
from ddtree.engine.gdn.layer import tree_layer
from ddtree.engine.gdn.meta import _meta_store, _token_meta, tree_meta
from ddtree.engine.gdn.step import _step_forward
from ddtree.engine.verification import TreeVerification, tree_verification


def single_step():
    """While active, a patched GDN forward of one cached token on the CPU takes `_step_forward` (see there)."""
    return tree_verification(None, step=True)


def _active_tree() -> TreeVerification | None:
    """The verification the GDN forward serves, if any (a seam: fault-injection tests switch it off)."""
    return verification.active()


def traced_forward(module, hidden_states: torch.Tensor, cache) -> torch.Tensor:
    """The patched forward of GDN `module` as a compiled graph calls it inside a tree verification (the compiled
    batched round, ddtree.engine.batch.CompiledRound): dynamo does not call through the patch's wrapt proxy, so the
    graph calls the tree forward itself."""
    ctx = _active_tree()
    if ctx is None or not ctx.gdn:
        raise RuntimeError(f"{type(module).__name__} (layer {module.layer_idx}): a compiled graph runs a GDN layer "
                           "inside a tree verification only")
    return _tree_forward(module, hidden_states, cache, None, ctx)


def _forward_wrapper(wrapped, instance, args, kwargs):
    ctx = _active_tree()
    if ctx is None or not ctx.gdn:
        if ctx is not None and ctx.step:
            out = _step_forward(instance, *args, **kwargs)
            if out is not None:
                return out
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    names = ("hidden_states", "cache", "attention_mask")
    if len(args) > len(names):
        raise TypeError(f"{type(instance).__name__}.forward: unexpected positional arguments under tree verification")
    bound = dict(zip(names[:len(args)], args, strict=True))
    hidden_states = bound.get("hidden_states", kwargs.pop("hidden_states", None))
    cache = bound["cache"] if "cache" in bound else kwargs.pop("cache", kwargs.pop("cache_params", None))
    attention_mask = bound.get("attention_mask", kwargs.pop("attention_mask", None))
    if kwargs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError("tree verification of packed (varlen) sequences is not supported")
    hook = getattr(instance.conv1d, "_hf_hook", None)  # accelerate offload: the conv weight is read directly
    if hook is not None:
        hook.pre_forward(instance.conv1d)
    try:
        return _tree_forward(instance, hidden_states, cache, attention_mask, ctx)
    finally:
        if hook is not None:
            hook.post_forward(instance.conv1d, ())


def _tree_forward(module, hidden_states: torch.Tensor, cache, attention_mask, ctx: TreeVerification) -> torch.Tensor:
    """The wrapper's side of a tree forward: shapes checked, the cache's states and shared buffers looked up,
    `tree_layer` run, what the commit needs recorded on the cache."""
    bsz, seq_len, _ = hidden_states.shape
    if seq_len != ctx.n:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}) got {seq_len} tokens under "
                         f"tree_verification of a {ctx.n}-token tree ([root] + nodes)")
    if ctx.streams and bsz != ctx.streams:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}) got a batch of {bsz} under "
                         f"tree_verification of a BatchTree of {ctx.streams} streams (a row per stream)")
    if attention_mask is not None and attention_mask.ndim == 2:  # padding mask, as upstream
        hidden_states = (hidden_states * attention_mask[:, -seq_len:, None]).to(hidden_states.dtype)
    kernel, layer = module.conv_kernel_size, module.layer_idx
    conv_state = recurrent_state = None
    if cache is not None:
        conv_state = cache.get_conv_state(layer, state_idx=0)
        recurrent_state = cache.get_recurrent_state(layer, state_idx=0)
    meta = (_token_meta(cache, ctx, kernel, hidden_states.device) if seq_len == 1
            else tree_meta(ctx, kernel, hidden_states.device, _meta_store(cache)))
    channels = module.conv1d.weight.shape[0]
    shared = _shared_layer(cache, module, hidden_states, channels)
    consts, bufs = shared if shared is not None else (layer_consts(module), None)
    if bufs is None:
        bufs = new_buffers(module, hidden_states, consts, channels)
    out = tree_layer(module, hidden_states, conv_state, recurrent_state, meta, consts, bufs, ctx.gdn_method)
    if cache is not None:
        pending = getattr(cache, _PENDING_ATTR, None)  # (attributes, not __dict__: a compiled round traces them)
        if pending is None:
            pending = {}
            setattr(cache, _PENDING_ATTR, pending)
        pending[layer] = _Pending(tree=ctx, kernel=kernel, bufs=bufs, conv_ref=conv_state,
                                  recurrent_ref=recurrent_state, versions=_versions(conv_state, recurrent_state),
                                  slot=None if shared is None else _slot_of(cache, layer))
    return out
