"""The tree's metadata every GDN layer of a verification reads (TreeMeta): built once a round, shared."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.verification import TreeVerification


@dataclass
class TreeMeta:
    """What every GDN layer of one verification reads about the tree: tensors on one device, built once a round.

    conv_index (T * K,): node i's causal window, oldest first, as rows of the tap-scaled table (K, K + T): tap k's row
    k (K + T) + r, r the window row's index in [K conv-state columns ++ T tree inputs]; conv_offsets (T,): where
    node i's K rows start (0, K, 2K, ...; None in the compiled round, whose graph gathers and sums).
    decay_map (2T + 2, 6T + 3): the matmul from a layer's [softplus(a + dt) (T), A, softplus(-b) (T), 1] to its
    [X (T x 3), Y ((T + 1) x 3)] (module docstring). decay_mask (T, T + 1): 0 at the virtual node and at node i's
    ancestors and itself, -inf elsewhere. depths, parents: for the recurrent method.

    A batch of N streams' trees (a BatchTree, `streams` = N): one map and mask per stream, decay_map (N, 2T + 2,
    6T + 3) and decay_mask (N, T, T + 1); depths and parents (N, T); conv_index (T * N * K,) the windows as rows of
    the table (K, K + T, N, C) viewed (K (K + T) N, C): tap k of stream b's row r is row (k (K + T) + r) N + b, node
    i's bag of stream b the (i N + b)-th (conv_offsets (T N,): 0, K, 2K, ...), so one gather-and-sum gives the conv
    (T, N C) as one tree's does.
    """

    conv_index: torch.Tensor
    decay_map: torch.Tensor
    decay_mask: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    depth_bound: int
    conv_offsets: torch.Tensor | None = None
    streams: int = 0


def tree_meta(ctx: TreeVerification, kernel: int, device: torch.device, store: dict | None = None) -> TreeMeta:
    """The verification's TreeMeta for a conv kernel size on a device (built on first use, then shared).
    store: a dict kept across rounds (the cache's): the tensors are then rewritten in place in buffers kept there
    (`_MetaBuffers`: ~12 ops a round instead of ~45), not allocated anew."""
    if ctx.streams:
        return ctx.memo(("gdn", kernel, device), lambda: _batch_meta(ctx, kernel, device, store))
    return ctx.memo(("gdn", kernel, device), lambda: _build_meta(ctx, kernel, device, store))


def _batch_meta(ctx: TreeVerification, kernel: int, device: torch.device, store: dict | None = None) -> TreeMeta:
    """The TreeMeta of a BatchTree (class docstring): every stream's windows, decay map and mask at once, in batched
    tensor ops (their number does not grow with the streams; no host read). store: as tree_meta's (the tensors
    rewritten in place in buffers kept there, `_BatchBuffers`: what does not depend on the trees written once)."""
    tree = ctx.draft
    parents, depth, anc = (t if t.device == device else t.to(device) for t in (tree.parents, tree.depths,
                                                                               ctx.ancestors))
    bsz, n = parents.shape
    key = ("streams", bsz, n, kernel, device)
    kept = store.get(key) if store is not None else None
    if kept is None:
        kept = _batch_buffers(bsz, n, kernel, device)
        if store is not None:
            store[key] = kept
    # node i's hops 0 .. K - 1 back (the root repeats past it), then oldest first
    up = parents.clamp(min=0)
    hops = [kept.nodes]
    for _ in range(kernel - 1):
        hops.append(up.gather(1, hops[-1]))
    ancestor = torch.stack(hops[::-1], dim=-1)  # (N, T, K)
    # the window's rows of [K conv-state columns ++ T tree inputs], as _write_meta's; then the table's rows
    back = kept.hops - depth[..., None]  # > 0: that many before the root
    rows = torch.where(back <= 0, kernel + ancestor, kernel - back)
    index = (kept.taps + rows) * bsz  # (N, T, K); + the stream: its row of the table
    if store is None:  # fresh: in a graph (dynamo takes no out= into a strided view)
        conv_index = (index + kept.stream).transpose(0, 1).reshape(-1)  # bags in (node, stream) order
    else:
        torch.add(index, kept.stream, out=kept.window.transpose(0, 1))
        conv_index = kept.conv_index
    anc_t = anc.transpose(1, 2)
    kept.x_ancestors.copy_(anc_t)
    kept.y_ancestors.copy_(anc_t)
    if store is None:
        kept.mask_tree.copy_(torch.where(anc, kept.zero, kept.hidden))
    else:
        torch.where(anc, kept.zero, kept.hidden, out=kept.mask_tree)
    return TreeMeta(conv_index, kept.decay_map, kept.decay_mask, depth, up, ctx.depth_bound, kept.offsets,
                    streams=bsz)


@dataclass
class _BatchBuffers:
    """_batch_meta's tensors for N streams' trees of one size, a kernel and a device (as _MetaBuffers for one tree):
    the constants, and the buffers each round rewrites through views made once."""

    nodes: torch.Tensor  # (N, T): arange(T) a stream
    hops: torch.Tensor  # (K,): K - 1 .. 0
    taps: torch.Tensor  # (K,): k (K + T)
    stream: torch.Tensor  # (N, 1, 1): arange(N)
    offsets: torch.Tensor  # (T N,): 0, K, 2K, ...
    window: torch.Tensor  # (T, N, K): conv_index's rows
    conv_index: torch.Tensor  # (T N K,): its flat view
    decay_map: torch.Tensor  # (N, 2T + 2, 6T + 3)
    decay_mask: torch.Tensor  # (N, T, T + 1)
    x_ancestors: torch.Tensor  # views of decay_map's ancestor entries (X's s_i, Y's s_j) and of decay_mask's tree part
    y_ancestors: torch.Tensor
    mask_tree: torch.Tensor
    zero: torch.Tensor
    hidden: torch.Tensor  # -inf


def _batch_buffers(bsz: int, n: int, kernel: int, device: torch.device) -> _BatchBuffers:
    base, _ = _decay_map_consts(n, device)
    decay_map = base.repeat(bsz, 1, 1)
    decay_mask = torch.zeros(bsz, n, n + 1, device=device)
    window = torch.empty(n, bsz, kernel, dtype=torch.long, device=device)
    return _BatchBuffers(torch.arange(n, device=device).expand(bsz, n), torch.arange(kernel - 1, -1, -1, device=device),
                         torch.arange(kernel, device=device) * (kernel + n),
                         torch.arange(bsz, device=device)[:, None, None],
                         torch.arange(0, n * bsz * kernel, kernel, device=device), window, window.view(-1), decay_map,
                         decay_mask, decay_map[:, :n, 0:3 * n:3], decay_map[:, :n, 3 * n + 4::3], decay_mask[:, :, 1:],
                         torch.zeros((), device=device), torch.full((), float("-inf"), device=device))


@dataclass
class _MetaBuffers:
    """TreeMeta's tensors for one tree size, kernel and device, kept across rounds: what does not depend on the tree
    (the decay map's A, 1 and -I entries, the mask's virtual column) is written once; each round rewrites the rest
    through views made once."""

    decay_map: torch.Tensor
    decay_mask: torch.Tensor
    conv_index: torch.Tensor  # (T * K,), flat view of window
    window: torch.Tensor  # (T, K): node i's window rows, oldest first
    x_ancestors: torch.Tensor  # (T, T) views of decay_map's ancestor entries (X's s_i, Y's s_j; both anc^T), and
    # decay_mask's tree part (T, T)
    y_ancestors: torch.Tensor
    mask_tree: torch.Tensor
    hops: torch.Tensor  # (K,): K - 1 .. 0
    taps: torch.Tensor  # (K,): K + k (K + T), the table's row of window row 0 for tap k (k = 0 oldest)
    offsets: torch.Tensor  # (T,): 0, K, 2K, ...
    zero: torch.Tensor
    hidden: torch.Tensor  # -inf
    clamped: dict  # the ancestor-index width -> hops clamped to it


def _decay_map_consts(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decay_map, decay_mask) with their tree-independent entries (module docstring: X_i = (s_i, A, 1),
    Y_j = (-A, s_j, log beta_j), Y_0 = (-A, 0, 0)); the ancestor entries are 0 here, and -inf nowhere."""
    decay_map = torch.zeros(2 * n + 2, 6 * n + 3, device=device)
    decay_map[n, 1:3 * n:3] = 1
    decay_map[2 * n + 1, 2:3 * n:3] = 1
    decay_map[n, 3 * n::3] = -1
    decay_map[n + 1:2 * n + 1, 3 * n + 5::3] = -torch.eye(n, device=device)
    return decay_map, torch.zeros(n, n + 1, device=device)


def _meta_buffers(n: int, kernel: int, device: torch.device) -> _MetaBuffers:
    decay_map, decay_mask = _decay_map_consts(n, device)
    window = torch.empty(n, kernel, dtype=torch.long, device=device)
    return _MetaBuffers(decay_map, decay_mask, window.view(-1), window, decay_map[:n, 0:3 * n:3],
                        decay_map[:n, 3 * n + 4::3], decay_mask[:, 1:],
                        torch.arange(kernel - 1, -1, -1, device=device),
                        kernel + torch.arange(kernel, device=device) * (kernel + n),
                        torch.arange(0, n * kernel, kernel, device=device), torch.zeros((), device=device),
                        torch.full((), float("-inf"), device=device), {})  # (a fill: no copy from the host)


def _build_meta(ctx: TreeVerification, kernel: int, device: torch.device, store: dict | None = None) -> TreeMeta:
    draft = ctx.draft
    aidx, depth = draft.ancestor_index(), draft.depths  # aidx[:, h]: h-th ancestor (root repeats)
    n = ctx.n
    if depth.device != device:
        aidx, depth = aidx.to(device), depth.to(device)
    anc = ctx.ancestors
    if anc.device != device:
        anc = anc.to(device)
    key = (n, kernel, device)
    kept = store.get(key) if store is not None else None
    if kept is None:
        kept = _meta_buffers(n, kernel, device)
        if store is not None:
            store[key] = kept
    width = aidx.shape[1]
    hops = kept.hops
    clamped = kept.clamped.get(width)
    if clamped is None:
        clamped = kept.clamped[width] = hops.clamp(max=width - 1)
    _write_meta(kept, aidx[:, clamped], depth, anc)
    if ctx.gdn_method == "recurrent":  # (what only the recurrent method reads)
        depths, parents = depth, draft.parents.clamp(min=0).to(device)
    else:
        depths, parents = depth, draft.parents
    return TreeMeta(kept.conv_index, kept.decay_map, kept.decay_mask, depths, parents, ctx.depth_bound, kept.offsets)


def _write_meta(kept: _MetaBuffers, ancestor: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> None:
    """The tree's entries of TreeMeta, written into `kept`: ancestor (T, K) node i's ancestors hop K - 1 .. 0 back
    (oldest first; the root repeats past it); depth (T,); anc (T, T) bool: j is i or an ancestor of i."""
    # the conv window, oldest first: hop h back from node i is its h-th ancestor's input while it is in the tree
    # (K + ancestor: rows K.. of [K conv-state columns ++ T tree inputs]), else conv-state column K - (h - depth);
    # k (K + T) more for the table's slice of tap k (kept.taps: K + k (K + T))
    past = kept.hops - depth[:, None]  # > 0: that many tokens before the root
    torch.where(past <= 0, kept.taps + ancestor, kept.taps - past, out=kept.window)
    # the tree's entries of the decay map (X_i's s_i: node i's path sums; Y_j's s_j) and of the ancestor mask
    anc_t = anc.t()
    kept.x_ancestors.copy_(anc_t)
    kept.y_ancestors.copy_(anc_t)
    if torch.compiler.is_compiling():  # (dynamo takes no out= into a strided view: the same values, one copy more)
        kept.mask_tree.copy_(torch.where(anc, kept.zero, kept.hidden))
    else:
        torch.where(anc, kept.zero, kept.hidden, out=kept.mask_tree)


def meta_tensors(ancestor: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """TreeMeta's (conv_index, decay_map, decay_mask) from the tree's tensors alone, in fresh buffers (fixed shapes,
    no host read: the compiled round builds them inside its graph; the eager round rewrites kept ones,
    `_build_meta`; both through `_write_meta`). ancestor (T, K): node i's h-th ancestor (the root repeats past it);
    depth (T,); anc (T, T) bool: j is i or an ancestor of i."""
    n, kernel = ancestor.shape
    kept = _meta_buffers(n, kernel, anc.device)
    _write_meta(kept, ancestor.flip(1), depth, anc)
    return kept.conv_index, kept.decay_map, kept.decay_mask


def _token_meta(cache, ctx: TreeVerification, kernel: int, device: torch.device) -> TreeMeta:
    """The TreeMeta of a one-node tree (an AR step), the same every round: kept on the cache, not rebuilt."""
    if cache is None or torch.compiler.is_compiling():  # (a graph: built inside it, nothing kept on the cache)
        return tree_meta(ctx, kernel, device)
    kept = cache.__dict__.setdefault(_TOKEN_META_ATTR, {})
    key = (kernel, device, ctx.streams)
    if key not in kept:
        kept[key] = _batch_meta(ctx, kernel, device) if ctx.streams else _build_meta(ctx, kernel, device)
    return kept[key]


_TOKEN_META_ATTR = "_ddtree_gdn_token_meta"
_META_ATTR = "_ddtree_gdn_meta_buffers"


def _meta_store(cache) -> dict | None:
    """Where a cache keeps its rounds' TreeMeta buffers (None without a cache, outside inference mode, or in a
    compiled graph: its buffers are the graph's own)."""
    if cache is None or torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return None
    return cache.__dict__.setdefault(_META_ATTR, {})
