"""Tree-exact Gated DeltaNet: verify a whole draft tree in one forward, then commit the accepted path exactly.

Upstream GDN layers (qwen3_5, qwen3_5_moe, qwen3_next) ignore the 4-D tree mask and run the flat
token order as one chain, so every node whose flat predecessors are not all its ancestors gets a
wrong conv window and a wrong recurrent state. Inside ``tree_verification(tree)`` (the one
verification context, ddtree.engine.verification) the patched forward computes, for every node, what
its root-to-node path would compute as a plain sequence after the cached prefix, and leaves the cache's
conv/recurrent state untouched; ``commit_linear_states(cache, accepted)`` then moves each GDN layer to
the state after prefix + accepted path. `TargetSession` installs the forward wrapper itself (engine
correctness, not a compat row); it is inert outside a verification.

The per-layer work is `tree_layer`: pure tensor code over the layer's inputs, the round's `TreeMeta`
(conv-window index, decay map and mask: tensors built once per round on the device, shared by every
layer) and the layer's `LayerConsts` (its weights in the layouts the math wants, built once per cache).
It compiles with torch.compile(fullgraph=True); eager, it dispatches 4 fused ops after the input projections
(decays, conv, q/k norm, solve: ddtree.engine.kernels.gdn, one Triton kernel each on CUDA, on the CPU the torch ops
it ran before them) and 1 for the gated output norm (docs/gdn-tree.md counts them).

The math (per value head, q and k l2-normalised, q scaled by dk^-1/2):

    S_i   = exp(g_i) * S_parent(i) + beta_i k_i d_i^T
    d_i   = v_i - k_i^T exp(g_i) S_parent(i)            (delta_i = beta_i d_i)
    o_i   = q_i^T S_i

Unrolled along a path with path-cumulative log decay c_i = sum of g over root..i:

    S_a = exp(c_a) S_0 + sum_{j on path(a)} exp(c_a - c_j + log beta_j) k_j d_j^T

so a node's output and the committed state need only (k_j, d_j) of its ancestors, the log weights
c_a - c_j + log beta_j and c_a, plus S_0 (the cache's state, never overwritten during verification).
Both come out of one small matmul: with s = the path sums of softplus(a + dt) and A = exp(A_log) (g = -A *
softplus), X_i = (s_i, A, 1) and Y_j = (-A, s_j, log beta_j) give X_i . Y_j = c_i - c_j + log beta_j, and the
virtual node j = 0 (Y_0 = (-A, 0, 0)) gives c_i. X . Y (three products, elementwise) plus the ancestor mask
(0 / -inf) and one exp give E = [exp(c_i) | exp(c_i - c_j) beta_j masked]. No float32 matmul rounds the path sums
(hundreds) before that difference: the map's matmul is exact under TF32 and bf16 precision too
(`kernels.gdn.exact_sign_mm`), X . Y and the commit's weights are elementwise. Two ways to get d for every node:

* ``"chunk"``: one chunk holding the whole tree, whose causal masks are ancestor masks:
  (I + (K K^T * E)) d = v - exp(c) (K S_0), strictly lower triangular in flat order (parents first), so a
  node's row touches only its ancestors: each row solves its own path.
* ``"recurrent"``: the recurrence above, one batched step per depth level (every node computed,
  the level's nodes kept: no host-side level lists).
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ddtree.engine import verification
from ddtree.engine.families import gdn_classes
from ddtree.engine.host import host_branch
from ddtree.engine.kernels import gdn as kgdn
from ddtree.engine.verification import GDN_METHODS as METHODS  # noqa: F401 (re-exported: callers name gdn.METHODS)
from ddtree.engine.verification import TreeVerification, tree_verification
from ddtree.engine.weights import plain, plain_linear

# Verified (tests/test_gdn_tree.py passes) on 5.21.0, 5.21.1, 5.22.0, 5.23.0 and 5.24.0. 5.20 has no
# Cache.get_conv_state; 5.21-5.23 call the cache argument `cache_params`, 5.24 renames it `cache` and
# keeps the old name as an alias until 5.40, where the signature changes again.
VERSIONS = ">=5.21,<5.40"

DEFAULT_METHOD = "chunk"
L2NORM_EPS = 1e-6  # upstream's l2norm of q and k

# (module, qualname) of every GDN forward wrapped; all share one structure. From the family table.
TARGETS: tuple[tuple[str, str], ...] = tuple((path.split(":")[0], path.split(":")[1] + ".forward")
                                             for path in gdn_classes())

@functools.cache
def _activation(name: str):
    """ACT2FN[name], built once: each lookup builds a new module (~20 us a GDN layer a forward here)."""
    return ACT2FN[name]


_PENDING_ATTR = "_ddtree_gdn_tree_pending"


def target_classes() -> list[type]:
    """The GDN classes of TARGETS that this transformers install provides."""
    classes = []
    for module_name, qualname in TARGETS:
        class_name = qualname.split(".")[0]
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            classes.append(cls)
    return classes


def install() -> list[str]:
    """Wrap each GDN class's forward through the compat row `gdn-tree-forward` (idempotent; listed by
    `python -m compat`, undone by `uninstall()` or `compat.revert()`). Returns the names of the classes patched."""
    from compat import registry
    from compat.patches import gdn_tree_forward

    entry = registry.apply(patches=(gdn_tree_forward.PATCH,), provided=provided())[0]
    if entry["status"] == "skipped-version":
        from ddtree.errors import ConfigError

        raise ConfigError("method", f"the tree-exact GDN is verified on transformers {VERSIONS} ({entry['detail']})",
                          f"install transformers{VERSIONS}, or use method=ar on this hybrid")
    if entry["status"] not in ("applied", "skipped-absent"):
        raise RuntimeError(f"compat row {gdn_tree_forward.ID}: {entry['status']}: {entry['detail']}")
    return [cls.__name__ for cls in target_classes()] if entry["status"] == "applied" else []


def provided() -> dict[str, object]:
    """What the compat row gdn-tree-forward needs from the engine (for compat.apply(provided=...))."""
    return {"gdn_forward": _forward_wrapper}


def uninstall() -> None:
    """Put back every original forward (idempotent)."""
    from compat import registry
    from compat.patches import gdn_tree_forward

    registry.revert([gdn_tree_forward.ID])


def is_installed() -> bool:
    from compat import registry
    from compat.patches import gdn_tree_forward

    return any(e["id"] == gdn_tree_forward.ID and e["status"] == "applied" for e in registry.report())




# --------------------------------------------------------------------------- the verification context


def single_step():
    """While active, a patched GDN forward of one cached token on the CPU takes `_step_forward` (see there)."""
    return tree_verification(None, step=True)


def _active_tree() -> TreeVerification | None:
    """The verification the GDN forward serves, if any (a seam: fault-injection tests switch it off)."""
    return verification.active()


@dataclass
class TreeMeta:
    """What every GDN layer of one verification reads about the tree: tensors on one device, built once a round.

    conv_index (T * K,): node i's causal window, oldest first, as rows of the tap-scaled table (K, K + T): tap k's row
    k (K + T) + r, r the window row's index in [K conv-state columns ++ T tree inputs]; conv_offsets (T,): where
    node i's K rows start (0, K, 2K, ...; None in the compiled round, whose graph gathers and sums).
    decay_map (2T + 2, 6T + 3): the matmul from a layer's [softplus(a + dt) (T), A, softplus(-b) (T), 1] to its
    [X (T x 3), Y ((T + 1) x 3)] (module docstring). decay_mask (T, T + 1): 0 at the virtual node and at node i's
    ancestors and itself, -inf elsewhere. depths, parents: for the recurrent method.
    """

    conv_index: torch.Tensor
    decay_map: torch.Tensor
    decay_mask: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    depth_bound: int
    conv_offsets: torch.Tensor | None = None


def tree_meta(ctx: TreeVerification, kernel: int, device: torch.device, store: dict | None = None) -> TreeMeta:
    """The verification's TreeMeta for a conv kernel size on a device (built on first use, then shared).
    store: a dict kept across rounds (the cache's): the tensors are then rewritten in place in buffers kept there
    (`_MetaBuffers`: ~12 ops a round instead of ~45), not allocated anew."""
    return ctx.memo(("gdn", kernel, device), lambda: _build_meta(ctx, kernel, device, store))


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
    # the conv window, oldest first: hop h back from node i is its h-th ancestor's input while it is in the tree
    # (K + ancestor: rows K.. of [K conv-state columns ++ T tree inputs]), else conv-state column K - (h - depth);
    # k (K + T) more for the table's slice of tap k (kept.taps: K + k (K + T))
    width = aidx.shape[1]
    hops = kept.hops
    clamped = kept.clamped.get(width)
    if clamped is None:
        clamped = kept.clamped[width] = hops.clamp(max=width - 1)
    ancestor = aidx[:, clamped]  # (T, K)
    past = hops - depth[:, None]  # > 0: that many tokens before the root
    torch.where(past <= 0, kept.taps + ancestor, kept.taps - past, out=kept.window)
    # the tree's entries of the decay map (X_i's s_i: node i's path sums; Y_j's s_j) and of the ancestor mask
    anc_t = anc.t()
    kept.x_ancestors.copy_(anc_t)
    kept.y_ancestors.copy_(anc_t)
    torch.where(anc, kept.zero, kept.hidden, out=kept.mask_tree)
    if ctx.gdn_method == "recurrent":  # (what only the recurrent method reads)
        depths, parents = depth, draft.parents.clamp(min=0).to(device)
    else:
        depths, parents = depth, draft.parents
    return TreeMeta(kept.conv_index, kept.decay_map, kept.decay_mask, depths, parents, ctx.depth_bound, kept.offsets)


def meta_tensors(ancestor: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """TreeMeta's (conv_index, decay_map, decay_mask) from the tree's tensors alone, freshly allocated (fixed shapes,
    no host read: the compiled round builds them inside its graph; the eager round rewrites kept buffers,
    `_build_meta`). ancestor (T, K): node i's h-th ancestor (the root repeats past it); depth (T,); anc (T, T) bool:
    j is i or an ancestor of i."""
    n, kernel = ancestor.shape
    device = anc.device
    hops = torch.arange(kernel, device=device)
    past = hops[None, :] - depth[:, None]  # > 0: that many tokens before the root
    window = torch.where(past <= 0, kernel + ancestor, kernel - past).flip(1) + torch.arange(
        kernel, device=device) * (kernel + n)  # (the table's slice of tap k: see TreeMeta)
    decay_map, decay_mask = _decay_map_consts(n, device)
    anc_t = anc.float().t()
    decay_map[:n, 0:3 * n:3] = anc_t  # X_i's s_i
    decay_map[:n, 3 * n + 4::3] = anc_t  # Y_j's s_j
    decay_mask[:, 1:].masked_fill_(~anc, float("-inf"))
    return window.reshape(-1), decay_map, decay_mask


def _token_meta(cache, ctx: TreeVerification, kernel: int, device: torch.device) -> TreeMeta:
    """The TreeMeta of a one-node tree (an AR step), the same every round: kept on the cache, not rebuilt."""
    if cache is None:
        return tree_meta(ctx, kernel, device)
    kept = cache.__dict__.setdefault(_TOKEN_META_ATTR, {})
    key = (kernel, device)
    if key not in kept:
        kept[key] = _build_meta(ctx, kernel, device)
    return kept[key]


_TOKEN_META_ATTR = "_ddtree_gdn_token_meta"
_META_ATTR = "_ddtree_gdn_meta_buffers"


def _meta_store(cache) -> dict | None:
    """Where a cache keeps its rounds' TreeMeta buffers (None without a cache, or outside inference mode)."""
    if cache is None or not torch.is_inference_mode_enabled():
        return None
    return cache.__dict__.setdefault(_META_ATTR, {})


@dataclass
class LayerConsts:
    """One GDN layer's weights as `tree_layer` uses them (float32 unless said), built once per cache.

    conv_taps (K, 1, 1, C) (tap k of channel c, k = 0 the oldest), conv_bias (C) or None; ab_weight (2 Hv, hidden) = [W_a; -W_b] and ab_bias = [dt_bias; 0] in the
    model's dtype, where a and b are plain bias-free Linear layers (None: the module's own projections);
    dt_bias (Hv); decay_rate (Hv) = exp(A_log); zero (1,): softplus(x) = logaddexp(x, zero), in float32 whatever x's
    dtype. The q/k l2norm and the gated norm are each one `F.rms_norm` (one fused kernel on a GPU): qk_weight (dk) =
    dk^-1/2 and qk_eps = eps / dk (x / sqrt(|x|^2 + eps) = x rsqrt(mean(x^2) + eps / dk) dk^-1/2); norm_weight (dv) = the
    gated norm's weight and norm_eps = its eps * dk (it sees core = o sqrt(dk), see `_gated_norm`).
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


def _bias_free(layer) -> bool:
    """A plain bias-free Linear whose weight may be concatenated (a quantized one is called: ddtree.engine.weights)."""
    return plain_linear(layer) and layer.bias is None


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
        wa, wb = module.in_proj_a.weight, module.in_proj_b.weight
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
        norm_eps=eps * dk)


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


# --------------------------------------------------------------------------- patched forward


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


def _tree_forward(module, hidden_states: torch.Tensor, cache, attention_mask, ctx: TreeVerification) -> torch.Tensor:
    """The wrapper's side of a tree forward: shapes checked, the cache's states and shared buffers looked up,
    `tree_layer` run, what the commit needs recorded on the cache."""
    bsz, seq_len, _ = hidden_states.shape
    if seq_len != ctx.n:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}) got {seq_len} tokens under "
                         f"tree_verification of a {ctx.n}-token tree ([root] + nodes)")
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
        pending = cache.__dict__.setdefault(_PENDING_ATTR, {})
        pending[layer] = _Pending(tree=ctx, kernel=kernel, bufs=bufs, conv_ref=conv_state,
                                  recurrent_ref=recurrent_state, versions=_versions(conv_state, recurrent_state),
                                  slot=None if shared is None else _slot_of(cache, layer))
    return out


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
        kgdn.conv(past, mixed, consts.conv_taps, consts.conv_bias, meta.conv_index, meta.conv_offsets,
                  bufs.extended, bufs.table, v.conv)
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
    return module.out_proj(_gated_norm(core, z, consts, bufs, v))


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
        mixed = module.in_proj_qkv(hidden_states)
        z = module.in_proj_z(hidden_states)
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
    for depth in range(meta.depth_bound + 1):
        here = depths == depth
        parent_states = state0.unsqueeze(2) if depth == 0 else states[:, :, parents]
        decayed = parent_states * g.exp()[..., None, None]
        delta = value - (decayed * key.unsqueeze(-1)).sum(-2)
        new = decayed + key.unsqueeze(-1) * (beta[..., None] * delta).unsqueeze(-2)
        states = torch.where(here[:, None, None], new, states)
        core = torch.where(here[:, None], (new * query.unsqueeze(-1)).sum(-2), core)
        deltas.copy_(torch.where(here[:, None], delta, deltas))
    return core


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
    verification writes them again) and replaced when the tree's size changes."""
    if cache is None or not torch.is_inference_mode_enabled():
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
            or not host_branch("gdn_step", hidden_states.device) or kwargs.get("cu_seq_lens_q") is not None
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



# --------------------------------------------------------------------------- commit


def _versions(*tensors: torch.Tensor | None) -> tuple[int, ...] | None:
    """In-place version counters, None where untracked (inference tensors, no state)."""
    if any(t is None or t.is_inference() for t in tensors):
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


def commit_linear_states(cache, accepted: torch.Tensor | Sequence[int], host_path: list[int] | None = None) -> None:
    """Set every GDN layer verified under the last tree_verification to prefix + accepted path.

    accepted: flat indices of the accepted path, root first (e.g. [0], or [0, 3, 7]). A tree given as
    parents checks that it is a root-to-node path; the engine's DraftTree trusts its walk and keeps a
    device tensor where it is (no host read). Attention layers are not touched (their K/V is the caller's).
    host_path: the same path as a list, where the caller has it on the host already (a CPU walk): the new conv
    state's rows are then one small host-built tensor instead of a few device ops.
    """
    pending: dict[int, _Pending] | None = cache.__dict__.get(_PENDING_ATTR)
    linear = [i for i, layer in enumerate(getattr(cache, "layers", ())) if hasattr(layer, "recurrent_states")]
    if not pending:
        if any(cache.layers[i].has_previous_state.get(0, False) for i in linear):
            raise RuntimeError("commit_linear_states: this cache has linear-attention state but no GDN tree "
                               "verification was recorded on it (was the patch installed and the forward run "
                               "inside tree_verification?)")
        return
    if sorted(pending) != linear:
        raise RuntimeError(f"commit_linear_states: linear-attention layers {sorted(set(linear) - set(pending))} "
                           "were not verified by the tree-aware GDN forward")
    trees = {id(p.tree) for p in pending.values()}
    if len(trees) != 1:
        raise RuntimeError("commit_linear_states: GDN layers were verified under different trees")
    tree = next(iter(pending.values())).tree
    index = _checked_path(tree, accepted)
    for layer_idx, rec in pending.items():
        rec.check_unchanged(cache.layers[layer_idx], layer_idx)
    del cache.__dict__[_PENDING_ATTR]  # a verification commits once; errors above leave it for a retry

    for group in _cached_groups(cache, pending):
        rec = group[0][1]
        # in-place writes into inference tensors are only allowed in inference mode
        inference = (rec.conv_ref if rec.conv_ref is not None else rec.bufs.deltas).is_inference()
        if inference and torch.is_inference_mode_enabled():  # the engine's commit: already in inference mode
            _commit_group(cache, group, index, host_path)
            continue
        with torch.no_grad(), torch.inference_mode(inference):
            _commit_group(cache, group, index, host_path)
    # a layer with no state yet was given the path through update_conv_state, which counted its tokens
    _count_tokens([cache.layers[i] for i, rec in pending.items() if rec.conv_ref is not None], index.shape[0])


def _count_tokens(layers: list, n: int) -> None:
    """Advance the token count of linear-attention cache layers whose states were written directly by `n` tokens.
    transformers >= 5.25 counts a layer's tokens (`cumulative_length_linear`, a 0-d tensor; what a hybrid cache's
    `get_seq_length` returns when its first layer is a linear one) in `update_conv_state` and its decode step; older
    versions have no count. One op for all the layers."""
    counters = [c for c in (getattr(layer, "cumulative_length_linear", None) for layer in layers) if c is not None]
    if counters:
        with torch.inference_mode():  # (a count made on the device under inference mode is an inference tensor)
            torch._foreach_add_(counters, n)


def _commit_group(cache, group: list[tuple[int, _Pending]], index: torch.Tensor, host_path: list[int] | None) -> None:
    if len(group) == 1:
        _commit_layer(cache, group[0][0], group[0][1], index)
    else:
        _commit_stacked(cache, group, index, host_path)


_GROUPS_ATTR = "_ddtree_gdn_commit_groups"


def _cached_groups(cache, pending: dict[int, _Pending]) -> list[list[tuple[int, _Pending]]]:
    """_commit_groups, worked out once per cache and kind of commit: a generation's rounds verify trees of one size
    on the same state tensors (updated in place), so the grouping only changes when a state tensor, the layers or the
    tree size do (the shapes it reads depend on nothing else)."""
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
    for layer_idx, rec in sorted(pending.items()):
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
                    host_path: list[int] | None = None) -> None:
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
        if host_path is not None and host_branch("host_tree", first.extended.device):
            rows = torch.tensor(([*range(k)] + [i + k for i in host_path])[-k:])
        else:
            rows = torch.cat([torch.arange(k, device=index.device), index + k])[-k:].to(first.extended.device)
        kept = (shared["extended"].index_select(2, rows) if shared is not None  # (G, B, K, C)
                else torch.stack([rec.extended.index_select(1, rows) for rec in recs]))
    kept = kept.transpose(-1, -2)
    states = _stacked_states(cache, items)
    if states is not None and states[1].dtype == new_state.dtype:  # one update of all the layers' states in place
        conv_all, rec_all = states  # (old * decay) + new: the same float ops as below (addition commutes exactly)
        rec_all.mul_(decay).add_(new_state)
        conv_all.copy_(kept)
        return
    old = torch.stack([r.recurrent_ref for r in recs])
    new_state = new_state.add_(old.to(new_state) * decay)
    for i, rec in enumerate(recs):
        rec.conv_ref.copy_(kept[i])
        rec.recurrent_ref.copy_(new_state[i])
    _adopt_states(cache, [i for i, _ in items])


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
    if any(layer.recurrent_states[0].dtype != torch.float32 for layer in layers):
        return
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
