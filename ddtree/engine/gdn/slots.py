"""A batched cache's GDN slots: seat one stream's prefilled conv and recurrent states in row `slot` of a cache of
N rows (the batched round, ddtree.engine.batch), or zero a row (a free slot: zero state is an empty prefix)."""

from __future__ import annotations

import torch

__all__ = ["copy_linear_states", "ensure_linear_states", "seat_linear_states", "zero_linear_states"]


def _linear_layers(cache) -> list[int]:
    return [i for i, layer in enumerate(getattr(cache, "layers", ())) if hasattr(layer, "recurrent_states")]


def copy_linear_states(src_cache, dst_cache, slot: int, streams: int | None = None, src_slot: int = 0) -> None:
    """Row `src_slot` of every linear-attention layer's conv and recurrent state of `src_cache` (e.g. a prefilled
    TargetSession's cache, batch 1) into row `slot` of `dst_cache`'s (batch N), in place: the layers' tensors keep
    their identity (a compiled round's static addresses, the GDN commit's stacked views). Every layer of `dst_cache`
    holds states of N rows already, or is given them first where `streams` = N is given (`ensure_linear_states`:
    zeros, a free slot's state). Both caches hold the same layers, their states the
    same shapes past the batch (the conv state the kernel's K columns)."""
    src_ids, dst_ids = _linear_layers(src_cache), _linear_layers(dst_cache)
    if src_ids != dst_ids:
        raise ValueError(f"copy_linear_states: the caches' linear-attention layers differ ({src_ids} vs {dst_ids})")
    if streams is not None:
        ensure_linear_states(dst_cache, streams, like=src_cache)
    with torch.no_grad():
        for i in src_ids:
            src, dst = src_cache.layers[i], dst_cache.layers[i]
            if not src.has_previous_state.get(0, False):
                raise ValueError(f"copy_linear_states: layer {i} of the source cache has no state (prefill it first)")
            conv, rec = src.conv_states[0], src.recurrent_states[0]
            if dst.conv_states[0] is None:
                raise ValueError(f"copy_linear_states: layer {i} of the batched cache has no state rows yet: "
                                 "pass streams=N (or call ensure_linear_states first)")
            dconv, drec = dst.conv_states[0], dst.recurrent_states[0]
            if dconv.shape[1:] != conv.shape[1:] or drec.shape[1:] != rec.shape[1:]:
                raise ValueError(f"copy_linear_states: layer {i}'s states differ in shape: conv {tuple(conv.shape)} "
                                 f"into {tuple(dconv.shape)}, recurrent {tuple(rec.shape)} into {tuple(drec.shape)}")
            _write(dconv, slot, conv[src_slot])
            _write(drec, slot, rec[src_slot])


def seat_linear_states(cache, prefilled, slot: int, streams: int | None = None) -> None:
    """The batched session's seat: `copy_linear_states(prefilled, cache, slot, streams)` (the batched cache first,
    argument order as `SlotKV.seat`). `streams` = N is needed the first time, while `cache` holds no states yet."""
    copy_linear_states(prefilled, cache, slot, streams)


def _write(dst: torch.Tensor, slot, value: torch.Tensor | float) -> None:
    """dst[slot] = value in place (slot: an int, or the rows of a long tensor), also where dst is an inference tensor
    (written in inference mode only)."""
    with torch.inference_mode(dst.is_inference() or torch.is_inference_mode_enabled()), torch.no_grad():
        dst[slot] = value


def ensure_linear_states(cache, streams: int, like) -> None:
    """Give every linear-attention layer of `cache` (batch `streams`) zero conv and recurrent states of `streams`
    rows, shaped, typed and placed as those of `like` (a prefilled cache of the same model), where it has none
    yet; marks them as holding a prefix (a zero state is an empty one: the GDN forward reads them)."""
    for i in _linear_layers(cache):
        dst, src = cache.layers[i], like.layers[i]
        if dst.conv_states[0] is not None:
            if dst.conv_states[0].shape[0] != streams:
                raise ValueError(f"ensure_linear_states: layer {i} holds {dst.conv_states[0].shape[0]} rows, "
                                 f"not {streams}")
            continue
        conv, rec = src.conv_states[0], src.recurrent_states[0]
        if conv is None or rec is None:
            raise ValueError(f"ensure_linear_states: layer {i} of `like` has no state (prefill it first)")
        with torch.no_grad():
            dst.lazy_initialization(conv_states=conv.new_zeros(streams, *conv.shape[1:]),
                                    recurrent_states=rec.new_zeros(streams, *rec.shape[1:]),
                                    conv_kernel_size=conv.shape[-1])
        dst.has_previous_state[0] = True


def zero_linear_states(cache, slot: int | torch.Tensor) -> None:
    """Zero row `slot` (or the rows of a long tensor) of every linear-attention layer's conv and recurrent state (a free slot, or a stream to be
    started from an empty prefix), in place."""
    for i in _linear_layers(cache):
        layer = cache.layers[i]
        if layer.conv_states[0] is not None:
            _write(layer.conv_states[0], slot, 0)
        if layer.recurrent_states[0] is not None:
            _write(layer.recurrent_states[0], slot, 0)
