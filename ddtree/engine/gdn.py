"""Tree-exact Gated DeltaNet: verify a whole draft tree in one forward, then commit the accepted path exactly.

Upstream GDN layers (qwen3_5, qwen3_5_moe, qwen3_next) ignore the 4-D tree mask and run the flat
token order as one chain, so every node whose flat predecessors are not all its ancestors gets a
wrong conv window and a wrong recurrent state. Inside ``tree_verification(tree)`` the patched
forward computes, for every node, what its root-to-node path would compute as a plain sequence after
the cached prefix, and leaves the cache's conv/recurrent state untouched;
``commit_linear_states(cache, accepted)`` then moves each GDN layer to the state after prefix +
accepted path. `TargetSession` installs the forward wrapper itself (engine correctness, not a compat
row); it is inert outside a ``tree_verification`` context.

The tree is the engine's `DraftTree`, whose parents, depths and ancestry already sit on the logits'
device: nothing of it is read back to the host. A parents list (tests, the authors' loops through
the upstream-gdn-tree compat patch) is validated on the host and turned into one.

The math (per value head, q and k l2-normalised, q scaled by dk^-1/2):

    S_i   = exp(g_i) * S_parent(i) + k_i delta_i^T
    delta_i = beta_i * (v_i - k_i^T exp(g_i) S_parent(i))
    o_i   = q_i^T S_i

Unrolled along a path with path-cumulative log decay c_i = sum of g over root..i:

    S_a = exp(c_a) S_0 + sum_{j on path(a)} exp(c_a - c_j) k_j delta_j^T

so a node's output and the committed state need only (k_j, delta_j, c_j) of its
ancestors plus S_0 (the cache's state, never overwritten during verification).
Two interchangeable ways to get delta for every node:

* ``"chunk"``: one chunk holding the whole tree, whose causal masks are ancestor masks:
  (I + A) delta = beta*v - W S_0 with A_ij = beta_i k_i.k_j exp(c_i - c_j) for j a
  strict ancestor of i. Flat order puts parents first, so A is strictly lower
  triangular and a node's rows touch only its ancestors: each row solves its own path.
* ``"recurrent"``: the recurrence above, one batched step per depth level (every node computed,
  the level's nodes kept: no host-side level lists).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ddtree.engine.families import gdn_classes
from ddtree.engine.tree import DraftTree

# Verified (tests/test_gdn_tree.py passes) on 5.21.0, 5.21.1, 5.22.0, 5.23.0 and 5.24.0. 5.20 has no
# Cache.get_conv_state; 5.21-5.23 call the cache argument `cache_params`, 5.24 renames it `cache` and
# keeps the old name as an alias until 5.40, where the signature changes again.
VERSIONS = ">=5.21,<5.40"

METHODS = ("chunk", "recurrent")
DEFAULT_METHOD = "chunk"

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


# --------------------------------------------------------------------------- tree context


@dataclass
class _Tree:
    """One tree under verification: the DraftTree's device tensors, copied once per other device (device map)."""

    draft: DraftTree
    method: str
    host_parents: list[int] | None = None  # known when built from a parents list: commit checks paths against it
    _on: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.draft)

    @property
    def depth_bound(self) -> int:
        bound = self.draft.depth_bound
        return bound if bound is not None else int(self.draft.depths.max())

    def _cached(self, name: str, device: torch.device, build) -> torch.Tensor:
        found = self._on.get((name, device))
        if found is None:
            found = self._on[(name, device)] = build().to(device)
        return found

    def ancestry(self, device: torch.device) -> torch.Tensor:
        """(T, T) float32, [i, j] = 1 where j is i or an ancestor of i, else 0."""
        return self._cached("ancestry", device, lambda: self.draft.ancestor_matrix().float())

    def hops(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ancestor index (T, D + 1), float32 1 where hop h <= depth(i) else 0): the ancestor pairs."""
        aidx = self._cached("aidx", device, self.draft.ancestor_index)

        def valid() -> torch.Tensor:
            hop = torch.arange(aidx.shape[1], device=aidx.device)
            return (hop[None, :] <= self.depths(aidx.device)[:, None]).float()

        return aidx, self._cached("valid", device, valid)

    def depths(self, device: torch.device) -> torch.Tensor:
        return self._cached("depths", device, lambda: self.draft.depths)

    def parents(self, device: torch.device) -> torch.Tensor:
        return self._cached("parents", device, lambda: self.draft.parents.clamp(min=0))

    def conv_index(self, kernel: int, device: torch.device) -> torch.Tensor:
        """(T, K) index into [conv state (K columns) ++ tree inputs]: node i's causal window, oldest first.

        Hop h of node i is its h-th ancestor while h <= depth(i), then the prefix tail held in the conv state.
        """
        def build() -> torch.Tensor:
            aidx, depth = self.draft.ancestor_index(), self.draft.depths  # aidx[:, h]: h-th ancestor (root repeats)
            hops = torch.arange(kernel, device=depth.device)
            ancestor = aidx[:, hops.clamp(max=aidx.shape[1] - 1)]  # (T, K)
            past = hops[None, :] - depth[:, None]  # > 0: that many tokens before the root
            window = torch.where(past <= 0, kernel + ancestor, kernel - past)
            return window.flip(1)

        return self._cached(f"conv{kernel}", device, build)


def _tree_of(tree: DraftTree | torch.Tensor | Sequence[int], method: str) -> _Tree:
    if method not in METHODS:
        raise ValueError(f"tree_verification(method={method!r}): expected one of {METHODS}")
    if isinstance(tree, DraftTree):
        return _Tree(tree, method)
    if isinstance(tree, torch.Tensor) and tree.ndim != 1:
        raise ValueError("tree_verification(parents): a non-empty 1-D LongTensor of parent indices is required")
    plist = [int(p) for p in (tree.tolist() if isinstance(tree, torch.Tensor) else tree)]
    if not plist or plist[0] != -1 or any(not 0 <= p < i for i, p in enumerate(plist) if i > 0):
        raise ValueError("tree_verification(parents): parents[0] must be -1 (the root) and "
                         "0 <= parents[i] < i for every other node (parents precede children)")
    depth = [0] * len(plist)
    for i in range(1, len(plist)):
        depth[i] = depth[plist[i]] + 1
    n = len(plist)
    draft = DraftTree(tokens=torch.zeros(n, dtype=torch.long), parents=torch.tensor(plist, dtype=torch.long),
                      depths=torch.tensor(depth, dtype=torch.long), is_chain=plist == list(range(-1, n - 1)),
                      depth_bound=max(depth))
    return _Tree(draft, method, host_parents=plist)


_ACTIVE: contextvars.ContextVar[_Tree | None] = contextvars.ContextVar("ddtree_gdn_tree", default=None)


@contextlib.contextmanager
def tree_verification(tree: DraftTree | torch.Tensor | Sequence[int], method: str = DEFAULT_METHOD) -> Iterator[None]:
    """While active, patched GDN forwards treat their input as the flat tree [root] + nodes.

    tree: the engine's DraftTree (its tensors are used where they are, no host read), or the parents
    (parents[i] the flat index of node i's parent, -1 for the root at index 0), validated on the host.
    method: "chunk" (ancestor-masked single chunk) or "recurrent" (one step per depth).
    """
    token = _ACTIVE.set(_tree_of(tree, method))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# --------------------------------------------------------------------------- patched forward


@contextlib.contextmanager
def single_step() -> Iterator[None]:
    """While active, a patched GDN forward of one cached token on the CPU takes `_step_forward` (see there)."""
    token = _STEP.set(True)
    try:
        yield
    finally:
        _STEP.reset(token)


_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("ddtree_gdn_step", default=False)


def _forward_wrapper(wrapped, instance, args, kwargs):
    tree = _ACTIVE.get()
    if tree is None:
        if _STEP.get():
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
        return _tree_forward(instance, hidden_states, cache, attention_mask, tree)
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


def _tree_forward(module, hidden_states: torch.Tensor, cache, attention_mask, tree: _Tree) -> torch.Tensor:
    bsz, seq_len, _ = hidden_states.shape
    if seq_len != tree.size:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}) got {seq_len} tokens under "
                         f"tree_verification of a {tree.size}-token tree ([root] + nodes)")
    if attention_mask is not None and attention_mask.ndim == 2:  # padding mask, as upstream
        hidden_states = (hidden_states * attention_mask[:, -seq_len:, None]).to(hidden_states.dtype)
    device, kernel, layer = hidden_states.device, module.conv_kernel_size, module.layer_idx

    conv_state = recurrent_state = None
    if cache is not None:
        conv_state = cache.get_conv_state(layer, state_idx=0)
        recurrent_state = cache.get_recurrent_state(layer, state_idx=0)

    mixed, z, b, a = _project(module, hidden_states)  # mixed (B, T, C)

    # Causal conv over each node's own ancestors, reaching into the prefix's conv state. Token-major
    # (B, K + T, C): the gather copies whole rows, ~8x cheaper than gathering along the last dim.
    if conv_state is None:
        past = mixed.new_zeros(bsz, kernel, mixed.shape[-1])
    else:
        past = conv_state[..., -kernel:].to(mixed.dtype).transpose(1, 2)
        if past.shape[1] < kernel:
            past = F.pad(past, (0, 0, kernel - past.shape[1], 0))
    shared_ext = _shared_slot(cache, layer, "extended", (bsz, kernel + seq_len, mixed.shape[-1]), mixed)
    extended = torch.cat([past, mixed], dim=1, out=shared_ext[1]) if shared_ext else torch.cat([past, mixed], dim=1)
    index = tree.conv_index(kernel, device)  # (T, K)
    windows = extended.index_select(1, index.reshape(-1)).view(bsz, *index.shape, extended.shape[-1])  # (B, T, K, C)
    # the taps as a contiguous (K, C): broadcasting the transposed (C, K) view took a strided path ~5x slower
    weight = module.conv1d.weight.squeeze(1).float().t().contiguous()
    conv = (windows.float() * weight).sum(-2)  # (B, T, C)
    if module.conv1d.bias is not None:
        conv = conv + module.conv1d.bias.float()
    conv = _activation(module.activation)(conv).to(hidden_states.dtype)

    query, key, value = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(bsz, seq_len, -1, module.head_k_dim)
    key = key.reshape(bsz, seq_len, -1, module.head_k_dim)
    value = value.reshape(bsz, seq_len, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    core, keys, deltas, cum = _tree_delta_rule(query, key, value, g, beta, recurrent_state, tree)

    if cache is not None:
        pending = cache.__dict__.setdefault(_PENDING_ATTR, {})
        # one tensor, so that a commit gathers a path's keys, deltas and decays in one op per layer (and in one op for
        # all layers, when they are slots of the cache's shared buffer)
        parts = [keys, deltas, cum.unsqueeze(-1)]
        shared = _shared_slot(cache, layer, "packed", (*keys.shape[:-1], keys.shape[-1] + deltas.shape[-1] + 1), keys)
        packed = torch.cat(parts, dim=-1, out=shared[1]) if shared else torch.cat(parts, dim=-1)
        slot = (shared[0], shared_ext[0], shared[2]) if shared and shared_ext else None
        pending[layer] = _Pending(tree=tree, kernel=kernel, extended=extended, packed=packed, dk=keys.shape[-1],
                                  conv_ref=conv_state, recurrent_ref=recurrent_state,
                                  versions=_versions(conv_state, recurrent_state), slot=slot)

    core = core.transpose(1, 2).to(hidden_states.dtype)  # (B, T, Hv, dv)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, seq_len, -1))


_SHARED_ATTR = "_ddtree_gdn_shared"


def _shared_slot(cache, layer: int, name: str, shape: tuple[int, ...],
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(buffer, buffer[slot], slot): the cache's buffer `name` [G, *shape] (G: its linear-attention layers, each with
    a slot) where this layer's verification writes its `name` tensor, so that a commit reads every layer's rows with
    one op. Kept across rounds: a commit consumes it before the next verification writes it again. None outside
    inference mode (writing into a buffer with out= does not differentiate) or without a cache."""
    if cache is None or not torch.is_inference_mode_enabled():
        return None
    shared = cache.__dict__.get(_SHARED_ATTR)
    if shared is None:
        linear = [i for i, entry in enumerate(getattr(cache, "layers", ())) if hasattr(entry, "recurrent_states")]
        shared = cache.__dict__[_SHARED_ATTR] = {"slots": {i: g for g, i in enumerate(linear)}}
    slot = shared["slots"].get(layer)
    if slot is None:
        return None
    buf = shared.get(name)
    if buf is None or buf.shape[1:] != shape or buf.dtype != like.dtype or buf.device != like.device:
        buf = shared[name] = like.new_empty(len(shared["slots"]), *shape)  # (a tree of another size: a new buffer)
    return buf, buf[slot], slot


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
            or hidden_states.device.type != "cpu" or kwargs.get("cu_seq_lens_q") is not None
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
    core = core.to(hidden_states.dtype)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, 1, -1))


def _path_decay(cum: torch.Tensor, tree: _Tree) -> torch.Tensor:
    """(B, H, T, T): exp(cum_i - cum_j) where j is i or an ancestor of i, else 0.

    Computed at the T * (depth + 1) ancestor pairs only and scattered into zeros: the dense form (a difference,
    a mask and an exp over all T^2 pairs) cost ~5x more at T = 257, and the values at the pairs are the same.
    """
    aidx, valid = tree.hops(cum.device)  # (T, D + 1): the h-th ancestor (the root repeats past it), h <= depth
    bsz, heads, n = cum.shape
    index = aidx.expand(bsz, heads, *aidx.shape)
    decay = (cum.unsqueeze(-1) - cum[..., aidx]).exp_().mul_(valid)  # (B, H, T, D + 1); 0 at repeated hops
    return cum.new_zeros(bsz, heads, n, n).scatter_add_(-1, index, decay)


def _tree_delta_rule(query, key, value, g, beta, initial_state, tree: _Tree):
    """Gated delta rule over a tree. Inputs (B, T, H*, d), g and beta (B, T, Hv).

    Returns output (B, Hv, T, dv) fp32 and, for commit, keys (B, Hv, T, dk), deltas (B, Hv, T, dv)
    and path-cumulative log decay (B, Hv, T), all fp32.
    """
    num_v_heads, num_k_heads = value.shape[2], key.shape[2]
    if num_v_heads != num_k_heads:  # each q/k head serves consecutive value heads
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, g = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g))
    query = _l2norm(query) * query.shape[-1] ** -0.5
    key = _l2norm(key)
    bsz, heads, seq_len, dk = key.shape
    dv = value.shape[-1]
    if initial_state is None:
        state0 = key.new_zeros(bsz, heads, dk, dv)
    else:
        state0 = initial_state.to(key)
    ancestry = tree.ancestry(key.device)
    cum = g @ ancestry.transpose(0, 1)  # (B, H, T): sum of g over root..i

    if tree.method == "chunk":
        gap = _path_decay(cum, tree)
        k_beta = key * beta.unsqueeze(-1)
        decay0 = cum.exp().unsqueeze(-1)
        # lower-triangular with a unit diagonal: solve_triangular reads neither the diagonal nor the upper part;
        # S_0's term moved into the right-hand side first (linear), so the solve has dv columns, not dv + dk
        system = (k_beta @ key.transpose(-1, -2)) * gap
        rhs = value * beta.unsqueeze(-1) - (k_beta * decay0) @ state0
        deltas = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        core = (query * decay0) @ state0 + ((query @ key.transpose(-1, -2)) * gap) @ deltas
        return core, key, deltas, cum

    depths, parents = tree.depths(key.device), tree.parents(key.device)
    core = torch.zeros_like(value)
    deltas = torch.zeros_like(value)
    states = state0.unsqueeze(2).expand(bsz, heads, seq_len, dk, dv).contiguous()  # S after each node, so far
    for depth in range(tree.depth_bound + 1):
        here = depths == depth
        parent_states = state0.unsqueeze(2) if depth == 0 else states[:, :, parents]
        decayed = parent_states * g.exp()[..., None, None]
        predicted = (decayed * key.unsqueeze(-1)).sum(-2)
        delta = (value - predicted) * beta.unsqueeze(-1)
        new = decayed + key.unsqueeze(-1) * delta.unsqueeze(-2)
        states = torch.where(here[:, None, None], new, states)
        core = torch.where(here[:, None], (new * query.unsqueeze(-1)).sum(-2), core)
        deltas = torch.where(here[:, None], delta, deltas)
    return core, key, deltas, cum


# --------------------------------------------------------------------------- commit


def _versions(*tensors: torch.Tensor | None) -> tuple[int, ...] | None:
    """In-place version counters, None where untracked (inference tensors, no state)."""
    if any(t is None or t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


@dataclass
class _Pending:
    """What one GDN layer needs to commit any root-to-node path of the tree it verified."""

    tree: _Tree
    kernel: int  # conv kernel size
    extended: torch.Tensor  # (B, K + T, C): the conv state's last K columns (zeros: none), then the tree tokens'
    # pre-conv inputs, token-major (the forward's conv input)
    packed: torch.Tensor  # (B, Hv, T, dk + dv + 1) fp32: normalised keys, deltas, path-cumulative log decay
    dk: int
    conv_ref: torch.Tensor | None  # the cache's state tensors at verification (None: no prefix yet)
    recurrent_ref: torch.Tensor | None
    versions: tuple[int, ...] | None  # their in-place versions, where tracked
    # (packed buffer, extended buffer, slot) where packed and extended are slot `slot` of the cache's shared buffers
    slot: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @property
    def conv_inputs(self) -> torch.Tensor:  # (B, C, T)
        return self.extended[:, self.kernel:].transpose(1, 2)

    @property
    def keys(self) -> torch.Tensor:  # (B, Hv, T, dk)
        return self.packed[..., :self.dk]

    @property
    def deltas(self) -> torch.Tensor:  # (B, Hv, T, dv)
        return self.packed[..., self.dk:-1]

    @property
    def cum(self) -> torch.Tensor:  # (B, Hv, T)
        return self.packed[..., -1]

    def __deepcopy__(self, memo):
        copied = _Pending(**{name: copy.deepcopy(value, memo) for name, value in vars(self).items()})
        copied.versions = None  # a copied tensor starts a new version count
        copied.slot = None  # copied tensors are no longer slots of the shared buffers
        return copied

    def check_unchanged(self, layer, layer_idx: int) -> None:
        had_state = bool(layer.has_previous_state.get(0, False))
        conv, rec = (layer.conv_states[0], layer.recurrent_states[0]) if had_state else (None, None)
        if (conv is not self.conv_ref or rec is not self.recurrent_ref
                or (self.versions is not None and _versions(conv, rec) != self.versions)):
            raise RuntimeError(f"commit_linear_states: layer {layer_idx}'s linear-attention state changed "
                               "between verification and commit (a forward ran on this cache in between?)")


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
        inference = (rec.conv_ref if rec.conv_ref is not None else rec.packed).is_inference()
        if inference and torch.is_inference_mode_enabled():  # the engine's commit: already in inference mode
            _commit_group(cache, group, index, host_path)
            continue
        with torch.no_grad(), torch.inference_mode(inference):
            _commit_group(cache, group, index, host_path)


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
            key: tuple = ("fresh", *((t.shape, t.dtype, t.device) for t in (rec.packed, rec.extended)))
        elif (getattr(cache.layers[layer_idx], "record_past", False) or conv.shape[-1] != rec.kernel
              or conv.dtype != rec.extended.dtype):
            key = (layer_idx,)
        else:
            key = ("prefix", *((t.shape, t.dtype, t.device) for t in (rec.packed, rec.extended, conv, rec.recurrent_ref)))
        groups.setdefault(key, []).append((layer_idx, rec))
    return list(groups.values())


def _commit_stacked(cache, items: list[tuple[int, _Pending]], path: torch.Tensor,
                    host_path: list[int] | None = None) -> None:
    """_commit_layer's arithmetic for several like layers at once (about a third of the small ops: each layer's path
    is one gather of its packed keys/deltas/decays, none for a chain, whose paths are prefixes; the recurrent update
    runs stacked; the new conv state is one gather of the forward's `extended` rows, or a slice). tests/test_gdn_tree.py
    compares it with the layer-by-layer commit."""
    recs = [rec for _, rec in items]
    first = recs[0]
    index = path.to(first.packed.device)
    # a chain's paths are its prefixes (a prefill, a DFlash block): the first n rows, a view, no gather
    n = index.shape[0] if first.tree.draft.is_chain else None
    shared = _shared_buffers(recs)  # (packed (G, B, H, T, W), extended (G, B, K + T, C)), or None
    if shared is not None:
        gathered = shared[0][..., :n, :] if n else shared[0].index_select(3, index)
    else:  # (G, B, H, L, W)
        gathered = torch.stack([r.packed[..., :n, :] if n else r.packed.index_select(2, index) for r in recs])
    keys, deltas, cum = gathered[..., :first.dk], gathered[..., first.dk:-1], gathered[..., -1]
    cum_last = cum[..., -1:]  # (G, B, H, 1)
    weighted = keys * (cum_last - cum).exp_().unsqueeze(-1)
    new_state = weighted.transpose(-1, -2) @ deltas
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
        kept = shared[1][:, :, n: n + k] if shared is not None else torch.stack([r.extended[:, n: n + k] for r in recs])
    else:
        if host_path is not None and first.extended.device.type == "cpu":
            rows = torch.tensor(([*range(k)] + [i + k for i in host_path])[-k:])
        else:
            rows = torch.cat([torch.arange(k, device=index.device), index + k])[-k:].to(first.extended.device)
        kept = (shared[1].index_select(2, rows) if shared is not None  # (G, B, K, C)
                else torch.stack([rec.extended.index_select(1, rows) for rec in recs]))
    kept = kept.transpose(-1, -2)
    decay = cum_last.exp().unsqueeze(-1)
    stacked = _stacked_states(cache, items)
    if stacked is not None and stacked[1].dtype == new_state.dtype:  # one update of all the layers' states in place
        conv_all, rec_all = stacked  # (old * decay) + new: the same float ops as below (addition commutes exactly)
        rec_all.mul_(decay).add_(new_state)
        conv_all.copy_(kept)
        return
    old = torch.stack([r.recurrent_ref for r in recs])
    new_state = new_state.add_(old.to(new_state) * decay)
    for i, rec in enumerate(recs):
        rec.conv_ref.copy_(kept[i])
        rec.recurrent_ref.copy_(new_state[i])
    _adopt_states(cache, [i for i, _ in items])


def _shared_buffers(recs: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The group's packed and extended tensors as one (G, ...) view each, where they are consecutive slots of the
    same shared buffers (`_shared_slot`), else None."""
    slot = recs[0].slot
    if slot is None:
        return None
    packed, extended, start = slot
    for j, rec in enumerate(recs):
        if rec.slot is None or rec.slot[0] is not packed or rec.slot[1] is not extended or rec.slot[2] != start + j:
            return None
    if start == 0 and len(recs) == packed.shape[0]:
        return packed, extended
    return packed[start: start + len(recs)], extended[start: start + len(recs)]


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


def _checked_path(tree: _Tree, accepted: torch.Tensor | Sequence[int]) -> torch.Tensor:
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
    index = path.to(rec.keys.device)
    # S_a = exp(c_a) S_0 + sum over the path of exp(c_a - c_j) k_j delta_j^T (index_select: cheaper than [..., index])
    cum_path = rec.cum.index_select(2, index)  # (B, H, L)
    cum_last = cum_path[..., -1:]  # (B, H, 1)
    weighted = rec.keys.index_select(2, index).mul_((cum_last - cum_path).exp_().unsqueeze(-1))
    new_state = weighted.transpose(-1, -2) @ rec.deltas.index_select(2, index)
    accepted_inputs = rec.conv_inputs.index_select(2, index.to(rec.conv_inputs.device))
    if rec.conv_ref is None:  # no prefix: as a plain prefill of the path would (padded to the kernel)
        cache.update_conv_state(accepted_inputs, layer_idx, conv_kernel_size=rec.kernel)
        cache.update_recurrent_state(new_state, layer_idx)
        return
    layer = cache.layers[layer_idx]
    conv_old, rec_old = rec.conv_ref, rec.recurrent_ref
    new_state = new_state.add_(rec_old.to(new_state) * cum_last.exp().unsqueeze(-1))
    history = torch.cat([conv_old, accepted_inputs.to(conv_old.dtype)], dim=-1)
    if getattr(layer, "record_past", False):  # keeps the full history, as its update_conv_state does
        layer.conv_states[0] = history
    else:
        conv_old.copy_(history[..., -conv_old.shape[-1]:])
    rec_old.copy_(new_state)
