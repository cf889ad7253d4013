"""The commit: each GDN layer's conv and recurrent state moved to prefix + accepted path."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree.engine.gdn.buffers import _SCRATCH, LayerBuffers
from ddtree.engine.verification import TreeVerification

_PENDING_ATTR = "_ddtree_gdn_tree_pending"


def _versions(*tensors: torch.Tensor | None) -> tuple[int, ...] | None:
    """In-place version counters, None where untracked (inference tensors, no state, a compiled graph's trace)."""
    if torch.compiler.is_compiling() or any(t is None or t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


@dataclass
class _Pending:
    """What one GDN layer needs to commit any root-to-node path of the tree it verified."""

    tree: TreeVerification
    kernel: int  # conv kernel size
    bufs: LayerBuffers  # what tree_layer wrote: conv inputs, keys, d, X and Y
    conv_ref: torch.Tensor | None  # the cache's state tensors at verification (None: no prefix yet)
    recurrent_ref: torch.Tensor | None
    versions: tuple[int, ...] | None  # their in-place versions, where tracked
    # (the cache's shared buffers at verification, this layer's slot in them), where bufs are slots of them
    slot: tuple[dict[str, torch.Tensor], int] | None = None

    @property
    def extended(self) -> torch.Tensor:  # (B, K + T, C)
        return self.bufs.extended

    @property
    def conv_inputs(self) -> torch.Tensor:  # (B, C, T)
        return self.extended[:, self.kernel:].transpose(1, 2)

    def __deepcopy__(self, memo):
        copied = _Pending(**{name: copy.deepcopy(value, memo) for name, value in vars(self).items()})
        copied.versions = None  # a copied tensor starts a new version count
        copied.slot = None  # copied tensors are no longer slots of the shared buffers
        copied.bufs.views = None  # (views of the originals)
        return copied

    def check_unchanged(self, layer, layer_idx: int) -> None:
        had_state = bool(layer.has_previous_state.get(0, False))
        conv, rec = (layer.conv_states[0], layer.recurrent_states[0]) if had_state else (None, None)
        if (conv is not self.conv_ref or rec is not self.recurrent_ref
                or (self.versions is not None and _versions(conv, rec) != self.versions)):
            raise RuntimeError(f"commit_linear_states: layer {layer_idx}'s linear-attention state changed "
                               "between verification and commit (a forward ran on this cache in between?)")


def _path_states(keys: torch.Tensor, deltas: torch.Tensor, xy: torch.Tensor, index: torch.Tensor,
                 prefix: int | None, host_path: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the state the path adds, the old state's weight exp(c_last) (..., 1, 1)) for one layer or a stack of them.

    keys (..., H, 2T, dk) as tree_layer lays them out, deltas (..., H, T, dv), xy (..., H, 6T + 3); index: the path
    (root first); prefix: its length where it is the first `prefix` nodes (a chain: slices, no gathers); host_path:
    the same path as a list, where the caller has it (a CPU walk): the Y rows' index is then built on the host.
    S_a = exp(c_a) S_0 + sum over the path of exp(c_a - c_j + log beta_j) k_j d_j^T, the exponents X_a . Y_j.
    """
    n = deltas.shape[-2]
    k_rows, x, y = keys[..., n:, :], xy[..., :3 * n].unflatten(-1, (n, 3)), xy[..., 3 * n:].unflatten(-1, (n + 1, 3))
    if prefix:
        k_path, d_path, x_last, y_path = k_rows[..., :prefix, :], deltas[..., :prefix, :], \
            x[..., prefix - 1:prefix, :], y[..., :prefix + 1, :]
    else:
        if host_path is not None and index.device.type == "cpu":
            y_index = torch.tensor([0] + [i + 1 for i in host_path])
        else:
            y_index = torch.cat([index.new_zeros(1), index + 1])
        k_path, d_path = k_rows.index_select(-2, index), deltas.index_select(-2, index)
        x_last, y_path = x.index_select(-2, index[-1:]), y.index_select(-2, y_index)
    weights = path_weights(y_path, x_last)  # (..., L + 1, 1): exp(c_a), then the path's weights
    added = (k_path * weights[..., 1:, :]).transpose(-1, -2) @ d_path
    return added, weights[..., :1, :]


def path_weights(y_path: torch.Tensor, x_last: torch.Tensor) -> torch.Tensor:
    """exp(Y_j . X_a) (..., L + 1, 1) for the path's Y rows (..., L + 1, 3) and its last node's X (..., 1, 3): the
    three products summed elementwise (a matmul under TF32 would round the path sums first: kgdn.exact_sign_mm)."""
    return (y_path * x_last).sum(-1, keepdim=True).exp_()


def commit_linear_states(cache, accepted: torch.Tensor | Sequence[int], host_path: list[int] | None = None, *,
                         host_rows: bool = True) -> None:
    """Set every GDN layer verified under the last tree_verification to prefix + accepted path.

    accepted: flat indices of the accepted path, root first (e.g. [0], or [0, 3, 7]). A tree given as
    parents checks that it is a root-to-node path; the engine's DraftTree trusts its walk and keeps a
    device tensor where it is (no host read). Attention layers are not touched (their K/V is the caller's).
    host_path: the same path as a list, where the caller has it on the host already (a CPU walk): on a CPU cache the
    path's rows are then small host-built tensors instead of a few device ops. host_rows: the new conv state's rows
    too (the engine's `host_tree` branch, ddtree.engine.host: off on the path a CUDA run takes).
    """
    pending = _pending_of(cache, "commit_linear_states")
    if pending is None:
        return
    tree = next(iter(pending.values())).tree
    if tree.streams:
        raise RuntimeError("commit_linear_states: the last verification was of a BatchTree; commit it with "
                           "commit_linear_states_batch(cache, path, lengths)")
    index = _checked_path(tree, accepted)
    for layer_idx, rec in pending.items():
        rec.check_unchanged(cache.layers[layer_idx], layer_idx)
    delattr(cache, _PENDING_ATTR)  # a verification commits once; errors above leave it for a retry

    for group in _cached_groups(cache, pending):
        rec = group[0][1]
        # in-place writes into inference tensors are only allowed in inference mode
        inference = (rec.conv_ref if rec.conv_ref is not None else rec.bufs.deltas).is_inference()
        if inference and torch.is_inference_mode_enabled():  # the engine's commit: already in inference mode
            _commit_group(cache, group, index, host_path, host_rows)
            continue
        with torch.no_grad(), torch.inference_mode(inference):
            _commit_group(cache, group, index, host_path, host_rows)
    # a layer with no state yet was given the path through update_conv_state, which counted its tokens
    _count_tokens([cache.layers[i] for i, rec in pending.items() if rec.conv_ref is not None], index.shape[0])


def _pending_of(cache, caller: str) -> dict[int, _Pending] | None:
    """The layers' records of the last verification on `cache` (None: nothing verified and no state to commit),
    checked to be whole: every linear-attention layer verified, all under one tree."""
    pending: dict[int, _Pending] | None = getattr(cache, _PENDING_ATTR, None)
    linear = [i for i, layer in enumerate(getattr(cache, "layers", ())) if hasattr(layer, "recurrent_states")]
    if not pending:
        if any(cache.layers[i].has_previous_state.get(0, False) for i in linear):
            raise RuntimeError(f"{caller}: this cache has linear-attention state but no GDN tree "
                               "verification was recorded on it (was the patch installed and the forward run "
                               "inside tree_verification?)")
        return None
    if sorted(pending) != linear:
        raise RuntimeError(f"{caller}: linear-attention layers {sorted(set(linear) - set(pending))} "
                           "were not verified by the tree-aware GDN forward")
    trees = {id(p.tree) for p in pending.values()}
    if len(trees) != 1:
        raise RuntimeError(f"{caller}: GDN layers were verified under different trees")
    return pending


def commit_linear_states_batch(cache, path: torch.Tensor, lengths: torch.Tensor) -> None:
    """Set every GDN layer verified under the last `tree_verification(batch_tree)` to, per stream, its prefix + its
    accepted path: row b of each layer's conv and recurrent state as if stream b's path had run alone after its own
    state. Batched tensor ops over every stream (and every like layer) at once: no loop over streams, no host read.

    path: long [N, L] flat node indices of each stream's tree, root first, padded past its length with anything in
    range (BatchWalk.path pads with the last node); lengths: long [N] nodes on each path (root included). A stream
    of length 0 keeps its state as it is (a free slot). Attention layers and the layers' token counts
    (`cumulative_length_linear`, one number for all the streams) are not touched: the batched session keeps each
    stream's length.
    """
    pending = _pending_of(cache, "commit_linear_states_batch")
    if pending is None:
        return
    tree = next(iter(pending.values())).tree
    if not tree.streams:
        raise RuntimeError("commit_linear_states_batch: the last verification was of one tree (a DraftTree); "
                           "commit it with commit_linear_states(cache, accepted)")
    if (path.ndim != 2 or lengths.ndim != 1 or path.shape[0] != tree.streams or lengths.shape[0] != tree.streams
            or path.shape[1] > tree.n):
        raise ValueError(f"commit_linear_states_batch: path [N, L] and lengths [N] for the verified {tree.streams} "
                         f"streams of {tree.n} nodes; got path {tuple(path.shape)}, lengths {tuple(lengths.shape)}")
    for layer_idx, rec in pending.items():
        rec.check_unchanged(cache.layers[layer_idx], layer_idx)
        if rec.conv_ref is not None and (getattr(cache.layers[layer_idx], "record_past", False)
                                         or rec.conv_ref.shape[-1] != rec.kernel):
            raise NotImplementedError(f"commit_linear_states_batch: layer {layer_idx}'s conv state keeps "
                                      f"{rec.conv_ref.shape[-1]} columns (record_past?); the batched commit keeps "
                                      f"exactly the kernel's {rec.kernel}")
    delattr(cache, _PENDING_ATTR)  # a verification commits once; errors above leave it for a retry
    for group in _cached_groups(cache, pending):
        rec = group[0][1]
        if torch.compiler.is_compiling():  # (the compiled batched round: traced under its inference mode)
            _commit_batch_group(cache, group, path, lengths)
            continue
        inference = (rec.conv_ref if rec.conv_ref is not None else rec.bufs.deltas).is_inference()
        if inference and torch.is_inference_mode_enabled():
            _commit_batch_group(cache, group, path, lengths)
            continue
        with torch.no_grad(), torch.inference_mode(inference):
            _commit_batch_group(cache, group, path, lengths)


def _batch_path_states(keys: torch.Tensor, deltas: torch.Tensor, xy: torch.Tensor, path: torch.Tensor,
                       lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_path_states for a batch: each stream's own (ragged) path. keys (G, N, H, 2T, dk), deltas (G, N, H, T, dv),
    xy (G, N, H, 6T + 3); path (N, L) and lengths (N,) on their device. (the state the paths add (G, N, H, dk, dv),
    the old state's weight (G, N, H, 1, 1): exp(c_last), 1 for a path of length 0)."""
    g, bsz, heads, two_n, dk = keys.shape
    n, dv, width = two_n // 2, deltas.shape[-1], path.shape[1]
    k_rows, x, y = keys[..., n:, :], xy[..., :3 * n].unflatten(-1, (n, 3)), xy[..., 3 * n:].unflatten(-1, (n + 1, 3))
    at = path.reshape(1, bsz, 1, width, 1)  # (one reshape, not an op for each new dim)
    k_path = k_rows.gather(-2, at.expand(g, bsz, heads, width, dk))
    d_path = deltas.gather(-2, at.expand(g, bsz, heads, width, dv))
    y_index = torch.cat([path.new_zeros(bsz, 1), path + 1], dim=1).reshape(1, bsz, 1, width + 1, 1)
    y_path = y.gather(-2, y_index.expand(g, bsz, heads, width + 1, 3))
    last = path.gather(1, (lengths - 1).clamp(min=0).reshape(bsz, 1)).reshape(1, bsz, 1, 1, 1)
    x_last = x.gather(-2, last.expand(g, bsz, heads, 1, 3))
    weights = path_weights(y_path, x_last)  # (G, N, H, L + 1, 1): exp(c_a), then the path's weights
    on = torch.arange(width, device=path.device) < lengths[:, None]  # (N, L): the path's own nodes
    w = torch.where(on.reshape(1, bsz, 1, width, 1), weights[..., 1:, :], 0)
    added = (k_path * w).transpose(-1, -2) @ d_path
    decay = torch.where((lengths > 0).reshape(1, bsz, 1, 1, 1), weights[..., :1, :], 1)
    return added, decay


def _commit_batch_group(cache, items: list[tuple[int, _Pending]], path: torch.Tensor, lengths: torch.Tensor) -> None:
    """commit_linear_states_batch for like layers (a `_commit_groups` group): their rows stacked (one view where they
    are slots of the cache's shared buffers), every stream's state update and new conv columns at once."""
    recs = [rec for _, rec in items]
    first = recs[0]
    dev = first.bufs.deltas.device
    # (a `.to` that changes nothing is an op still)
    if path.device != dev or path.dtype != torch.long:
        path = path.to(dev, torch.long)
    if lengths.device != dev or lengths.dtype != torch.long:
        lengths = lengths.to(dev, torch.long)
    shared = _shared_buffers(recs)
    if shared is not None:
        stacked = {name: shared[name] for name in ("keys", "deltas", "xy", "extended")}
    else:
        stacked = {name: torch.stack([getattr(r.bufs, name) for r in recs]) for name in ("keys", "deltas", "xy",
                                                                                         "extended")}
    keys = stacked["keys"].flatten(2, 3).flatten(3, 4)  # (G, N, Hv, 2T, dk)
    new_state, decay = _batch_path_states(keys, stacked["deltas"], stacked["xy"], path, lengths)
    # the new conv columns: the last K of [the K old columns, the path's inputs], rows of `extended`: window column p
    # is row length + p of that sequence, an old column while < K, else the path's (length + p - K)-th node's input
    k = first.kernel
    extended = stacked["extended"]  # (G, N, K + T, C)
    seq = lengths[:, None] + torch.arange(k, device=dev)  # (N, K)
    node = path.gather(1, (seq - k).clamp(min=0))
    rows = torch.where(seq < k, seq, node + k)
    kept = extended.gather(2, rows.reshape(1, *rows.shape, 1).expand(extended.shape[0], -1, -1, extended.shape[-1]))
    kept = kept.transpose(-1, -2)  # (G, N, C, K)
    if first.conv_ref is None:  # no state yet (an empty cache of N rows): zeros before the path, as the forward read
        for (layer_idx, _), conv, state in zip(items, kept, new_state, strict=True):
            layer = cache.layers[layer_idx]
            layer.lazy_initialization(conv_states=conv, recurrent_states=state, conv_kernel_size=k)
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(state)
            layer.has_previous_state[0] = True
        _adopt_states(cache, [i for i, _ in items])
        return
    _store_states(cache, items, recs, kept, new_state, decay)


def _store_states(cache, items: list, recs: list, kept: torch.Tensor, new_state: torch.Tensor,
                  decay: torch.Tensor) -> None:
    """Every committed layer's states: recurrent = old * decay + new, conv = the kept window; in place, one op each
    where the layers' states are stacked (addition commutes exactly: the same float ops either way)."""
    states = _stacked_states(cache, items)
    if states is not None and states[1].dtype == new_state.dtype:
        conv_all, rec_all = states
        rec_all.mul_(decay).add_(new_state)
        conv_all.copy_(kept)
        return
    old = torch.stack([r.recurrent_ref for r in recs])
    new_state = new_state.add_(old.to(new_state) * decay)
    for i, rec in enumerate(recs):
        rec.conv_ref.copy_(kept[i])
        rec.recurrent_ref.copy_(new_state[i])
    _adopt_states(cache, [i for i, _ in items])


def _count_tokens(layers: list, n: int) -> None:
    """Advance the token count of linear-attention cache layers whose states were written directly by `n` tokens.
    transformers >= 5.25 counts a layer's tokens (`cumulative_length_linear`, a 0-d tensor; what a hybrid cache's
    `get_seq_length` returns when its first layer is a linear one) in `update_conv_state` and its decode step; older
    versions have no count. One op for all the layers."""
    counters = [c for c in (getattr(layer, "cumulative_length_linear", None) for layer in layers) if c is not None]
    if counters:
        with torch.inference_mode():  # (a count made on the device under inference mode is an inference tensor)
            torch._foreach_add_(counters, n)


def _commit_group(cache, group: list[tuple[int, _Pending]], index: torch.Tensor, host_path: list[int] | None,
                  host_rows: bool = True) -> None:
    if len(group) == 1:
        _commit_layer(cache, group[0][0], group[0][1], index)
    else:
        _commit_stacked(cache, group, index, host_path, host_rows)


_GROUPS_ATTR = "_ddtree_gdn_commit_groups"


def _cached_groups(cache, pending: dict[int, _Pending]) -> list[list[tuple[int, _Pending]]]:
    """_commit_groups, worked out once per cache and kind of commit: a generation's rounds verify trees of one size
    on the same state tensors (updated in place), so the grouping only changes when a state tensor, the layers or the
    tree size do (the shapes it reads depend on nothing else)."""
    if torch.compiler.is_compiling():  # (a graph: grouped at trace time, nothing kept on the cache)
        return _commit_groups(cache, pending)
    states = [(i, rec.conv_ref, rec.recurrent_ref) for i, rec in sorted(pending.items())]
    size = next(iter(pending.values())).tree.size
    found = cache.__dict__.get(_GROUPS_ATTR)
    if (found is not None and found[0] == size and len(found[1]) == len(states)
            and all(a[0] == b[0] and a[1] is b[1] and a[2] is b[2] for a, b in zip(found[1], states, strict=True))):
        return [[(i, pending[i]) for i in group] for group in found[2]]
    groups = _commit_groups(cache, pending)
    cache.__dict__[_GROUPS_ATTR] = (size, states, [[i for i, _ in group] for group in groups])
    return groups


def _commit_groups(cache, pending: dict[int, _Pending]) -> list[list[tuple[int, _Pending]]]:
    """The layers to commit together (_commit_stacked), alike in shapes, dtypes and device: those with no state yet
    (a first verification, e.g. a chain prefill), and those whose state has exactly K conv columns (the forward's
    `extended` then starts with all of it) in the forward's dtype; every other layer alone (_commit_layer).
    In layer order."""
    groups: dict[tuple, list[tuple[int, _Pending]]] = {}
    for layer_idx, rec in sorted(pending.items(), key=lambda item: item[0]):  # (by layer: a graph sorts ints)
        conv = rec.conv_ref
        if conv is None:
            key: tuple = ("fresh", *((t.shape, t.dtype, t.device) for t in (rec.bufs.keys, rec.extended)))
        elif (getattr(cache.layers[layer_idx], "record_past", False) or conv.shape[-1] != rec.kernel
              or conv.dtype != rec.extended.dtype):
            key = (layer_idx,)
        else:
            key = ("prefix", *((t.shape, t.dtype, t.device) for t in (rec.bufs.keys, rec.extended, conv, rec.recurrent_ref)))
        groups.setdefault(key, []).append((layer_idx, rec))
    return list(groups.values())


def _commit_stacked(cache, items: list[tuple[int, _Pending]], path: torch.Tensor,
                    host_path: list[int] | None = None, host_rows: bool = True) -> None:
    """_commit_layer's arithmetic for several like layers at once: the path's rows of every layer's keys, d, X and Y
    in one gather each where they are slots of the cache's shared buffers (a chain, whose paths are prefixes, takes
    slices), the state update stacked, the new conv state one gather of the forward's `extended` rows (or a slice).
    tests/test_gdn_tree.py compares it with the layer-by-layer commit."""
    recs = [rec for _, rec in items]
    first = recs[0]
    index = path.to(first.bufs.deltas.device)
    # a chain's paths are its prefixes (a prefill, a DFlash block): the first n rows, a view, no gather
    n = index.shape[0] if first.tree.draft.is_chain else None
    shared = _shared_buffers(recs)  # name -> (G, ...) view, or None
    if shared is not None:
        stacked = {name: shared[name] for name in ("keys", "deltas", "xy", "extended")}
    else:
        stacked = {name: torch.stack([getattr(r.bufs, name) for r in recs]) for name in ("keys", "deltas", "xy")}
    keys = stacked["keys"].flatten(2, 3).flatten(3, 4)  # (G, B, Hv, 2T, dk)
    new_state, decay = _path_states(keys, stacked["deltas"], stacked["xy"], index, n, host_path)
    if first.conv_ref is None:  # no prefix: as a plain prefill of the path would (padded to the kernel)
        for (layer_idx, rec), state in zip(items, new_state, strict=True):
            inputs = rec.conv_inputs[..., :n] if n else rec.conv_inputs.index_select(2, index.to(rec.extended.device))
            cache.update_conv_state(inputs, layer_idx, conv_kernel_size=rec.kernel)
            cache.update_recurrent_state(state, layer_idx)
        _adopt_states(cache, [i for i, _ in items])
        return
    # the last K of [the K old columns, the path's inputs]: rows of `extended`
    k = first.kernel
    if n:  # a prefix of n: rows n .. n + K - 1
        kept = (shared["extended"][:, :, n: n + k] if shared is not None
                else torch.stack([r.extended[:, n: n + k] for r in recs]))
    else:
        if host_path is not None and host_rows and first.extended.device.type == "cpu":
            rows = torch.tensor(([*range(k)] + [i + k for i in host_path])[-k:])
        else:
            rows = torch.cat([torch.arange(k, device=index.device), index + k])[-k:].to(first.extended.device)
        kept = (shared["extended"].index_select(2, rows) if shared is not None  # (G, B, K, C)
                else torch.stack([rec.extended.index_select(1, rows) for rec in recs]))
    kept = kept.transpose(-1, -2)
    _store_states(cache, items, recs, kept, new_state, decay)


def _shared_buffers(recs: list[_Pending]) -> dict[str, torch.Tensor] | None:
    """The group's buffers as one (G, ...) view each, where they are consecutive slots of the same shared buffers
    (`_shared_layer`), else None."""
    if recs[0].slot is None:
        return None
    buffers, start = recs[0].slot
    for j, rec in enumerate(recs):
        if rec.slot is None or rec.slot[1] != start + j or any(
                rec.slot[0].get(name) is not buf for name, buf in buffers.items()):
            return None
    return {name: buf[start: start + len(recs)] for name, buf in buffers.items() if name not in _SCRATCH}


_STATES_ATTR = "_ddtree_gdn_stacked_states"


def _adopt_states(cache, layer_ids: list[int]) -> None:
    """Move the conv and recurrent states of like layers (a commit group) into one stacked tensor each, the layers'
    states becoming views of them: the next commits of the group update every layer's states with one op each
    (`_stacked_states`). Only for float32 recurrent states (the commit's dtype: else nothing is saved)."""
    layers = [cache.layers[i] for i in layer_ids]
    if torch.compiler.is_compiling() or any(layer.recurrent_states[0].dtype != torch.float32 for layer in layers):
        return  # (a graph writes the states in place where they are)
    conv_all = torch.stack([layer.conv_states[0] for layer in layers])
    rec_all = torch.stack([layer.recurrent_states[0] for layer in layers])
    for g, layer in enumerate(layers):
        layer.conv_states[0], layer.recurrent_states[0] = conv_all[g], rec_all[g]
    cache.__dict__[_STATES_ATTR] = (tuple(layer_ids), conv_all, rec_all,
                                    [(layer.conv_states[0], layer.recurrent_states[0]) for layer in layers])


def _stacked_states(cache, items: list[tuple[int, _Pending]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(conv (G, B, C, K), recurrent (G, B, H, dk, dv)) when the group's verified states are still the views
    `_adopt_states` made (nothing replaced a layer's state since), else None."""
    found = cache.__dict__.get(_STATES_ATTR)
    if found is None or found[0] != tuple(i for i, _ in items):
        return None
    if not all(rec.conv_ref is conv and rec.recurrent_ref is rec_ for (_, rec), (conv, rec_) in
               zip(items, found[3], strict=True)):
        return None
    return found[1], found[2]


def _checked_path(tree: TreeVerification, accepted: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The accepted path as a long tensor; a path of a parents-built tree is checked on the host."""
    if isinstance(accepted, torch.Tensor) and tree.host_parents is None:
        if accepted.ndim != 1 or not 1 <= accepted.shape[0] <= tree.depth_bound + 1:
            raise ValueError(f"commit_linear_states: accepted of shape {tuple(accepted.shape)} is not a root-to-node "
                             f"path of the verified {tree.size}-token tree")
        return accepted.long()
    path = [int(i) for i in (accepted.reshape(-1).tolist() if isinstance(accepted, torch.Tensor) else accepted)]
    parents = tree.host_parents
    if not path or path[0] != 0 or any(not 0 <= i < tree.size for i in path) or (
            parents is not None and any(parents[path[n]] != path[n - 1] for n in range(1, len(path)))):
        raise ValueError(f"commit_linear_states: accepted={path} is not a root-to-node path of the verified tree")
    return torch.tensor(path, dtype=torch.long)


def _commit_layer(cache, layer_idx: int, rec: _Pending, path: torch.Tensor) -> None:
    index = path.to(rec.bufs.deltas.device)
    keys = rec.bufs.keys.flatten(1, 2).flatten(2, 3)  # (B, Hv, 2T, dk)
    new_state, decay = _path_states(keys, rec.bufs.deltas, rec.bufs.xy, index, None)
    accepted_inputs = rec.conv_inputs.index_select(2, index.to(rec.conv_inputs.device))
    if rec.conv_ref is None:  # no prefix: as a plain prefill of the path would (padded to the kernel)
        cache.update_conv_state(accepted_inputs, layer_idx, conv_kernel_size=rec.kernel)
        cache.update_recurrent_state(new_state, layer_idx)
        return
    layer = cache.layers[layer_idx]
    conv_old, rec_old = rec.conv_ref, rec.recurrent_ref
    new_state = new_state.add_(rec_old.to(new_state) * decay)
    history = torch.cat([conv_old, accepted_inputs.to(conv_old.dtype)], dim=-1)
    if getattr(layer, "record_past", False):  # keeps the full history, as its update_conv_state does
        layer.conv_states[0] = history
    else:
        conv_old.copy_(history[..., -conv_old.shape[-1]:])
    rec_old.copy_(new_state)
