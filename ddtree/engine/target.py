"""The target side of a generation: prefill, verify a tree in one forward, commit the accepted path."""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from ddtree.engine import attention, gdn, verification
from ddtree.engine.families import family, model_type
from ddtree.engine.forward import LazyTail, lean_forward_for
from ddtree.engine.host import allocator_wanted, host_branch, tune_host_allocator
from ddtree.engine.tree import DraftTree, chain_tree, tree_attention_mask
from ddtree.errors import ConfigError

__all__ = ["PreallocatedLayer", "TargetBinding", "TargetSession", "WalkRows", "context_features", "model_type",
           "new_cache"]


# split: ddtree.engine.attention (any backend); dense: a 4-D additive mask (eager/sdpa); auto: per round, dense
# where that is cheaper (a CPU eager/sdpa target without sliding layers, past + tree <= DENSE_AUTO_KEYS), else split
TREE_ATTENTION = ("auto", "split", "dense")
# On CPU one sdpa call with a small mask beats split's two calls and merge; a masked sdpa copies K/V per GQA head,
# so long contexts stay on split
DENSE_AUTO_KEYS = 1024
# Prompts up to this many tokens prefill a CPU hybrid through the tree-exact GDN as one chain (faster there
# up to ~64 tokens; its T x T solve loses to the chunked fallback beyond: docs/engine-internals.md)
CHAIN_PREFILL_MAX = 64
# A greedy verification of a branching tree this large on a CPU lean target runs the head only on the walked
# rows (TargetSession.lazy_head); below it the batched head over every node cost about the same (toy pairs, on/off
# interleaved: 0.99-1.00x at budget 16, 1.00-1.05x at 64, 1.02-1.06x at 256)
LAZY_HEAD_MIN = 65
# From this many nodes a lazy-head round also runs the last decoder layer only for the walked rows (LazyTail):
# on/off interleaved (docs/engine-internals.md) 1.03x (hybrid) and 1.07x (pure) at budget 256, 0.98-1.00x at 64
LAZY_TAIL_MIN = 129


class WalkRows:
    """verify(head=False): the target's argmax after the nodes a greedy walk asks about, and the features of the
    path it accepts, computed as asked.

    Over a `LazyTail` (the last layer an attention layer, a dense tree mask) the last layer itself runs only for
    the asked rows; otherwise every row's final-norm hidden state is there and only the head is lazy. Ask before
    the commit: a LazyTail reads the verified keys and values where the cache holds them until then.
    """

    def __init__(self, lean, out, kept: dict, hidden_ids: list[int] | None):
        self.head, self.kept, self.hidden_ids = lean.head_op or lean.head.forward, kept, hidden_ids
        self.final = out.final if isinstance(out, LazyTail) else (lambda nodes: out[0][nodes])

    @torch.inference_mode()
    def argmax(self, nodes: list[int]) -> list[int]:
        """For host_walk: the target's token after each of `nodes`."""
        return self.head(self.final(nodes)).argmax(-1).tolist()

    @torch.inference_mode()
    def features(self, path: list[int]) -> torch.Tensor | None:
        """[1, len(path), F]: what verify(head=True)'s features hold at `path`."""
        if not self.hidden_ids:
            return None
        parts = [self.kept[i][:, path] if i in self.kept else self.final(path)[None] for i in self.hidden_ids]
        return torch.cat(parts, dim=-1)


class _Rows:
    """arange(start, end) on a device, made once for the attention layers of a forward (each layer asks for it)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.rows: torch.Tensor | None = None

    def __call__(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        key = (start, end, device, torch.is_inference_mode_enabled())
        if key != self.key:
            self.key, self.rows = key, torch.arange(start, end, device=device)
        return self.rows


class KVArena:
    """One buffer [layers, 2, ..., capacity, head_dim] for the keys and values of a cache's full-attention layers:
    a commit then moves the accepted rows of every layer in one gather and one copy (`keep`), not four ops a layer.

    A layer joins at its first update when its tensors match the buffer (shape, dtype, device: the first layer
    to arrive sets them); one that does not keeps a buffer of its own. Growing (a short capacity hint) grows
    the buffer for every member at once.
    """

    def __init__(self, capacity: int, slots: int):
        self.capacity_hint, self.slots = capacity, slots
        self.buf: torch.Tensor | None = None
        self.members: dict[int, PreallocatedLayer] = {}
        self.rows = _Rows()  # the rows a forward writes, shared by the members

    def join(self, layer: PreallocatedLayer, slot: int, ks: torch.Tensor, vs: torch.Tensor) -> bool:
        if self.buf is None:
            capacity = max(self.capacity_hint, 2 * ks.shape[-2], 64)
            self.buf = ks.new_empty(self.slots, 2, *ks.shape[:-2], capacity, ks.shape[-1])
        buf = self.buf
        if (ks.shape[:-2] != buf.shape[2:-2] or ks.shape[-1] != buf.shape[-1] or vs.shape != ks.shape
                or ks.dtype != buf.dtype or vs.dtype != buf.dtype or ks.device != buf.device or slot in self.members):
            return False
        self.members[slot] = layer
        layer._k, layer._v = buf[slot, 0], buf[slot, 1]
        return True

    def replace(self, buf: torch.Tensor) -> None:
        """Move every member to `buf` (a larger or cloned copy of the old buffer's contents)."""
        self.buf = buf
        for slot, layer in self.members.items():
            layer._k, layer._v = buf[slot, 0], buf[slot, 1]
            layer.set_length(layer.length)

    def grow(self, capacity: int) -> None:
        old = self.buf
        new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
        new[..., : old.shape[-2], :].copy_(old)
        self.replace(new)

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Every member: keep [:start] plus the rows `rows` (absolute, in order), as PreallocatedLayer.keep."""
        k = rows.shape[0]
        buf = self.buf
        buf[..., start: start + k, :].copy_(buf.index_select(-2, rows))
        for layer in self.members.values():
            layer.set_length(start + k)


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV layer in a preallocated buffer: a forward writes its tokens in place.

    DynamicLayer concatenates (copies) the whole cache at every forward and the tree commit used to
    re-gather it; here a forward writes only its new tokens (one index_copy_ each for keys and values, at the rows
    of the forward: one arange shared by the layers of an arena), a commit moves only the accepted ones,
    and the buffer grows by doubling when a hint was short. `keys`/`values` are views [..., :length, :], made
    when read (a commit sets the host-side `length` only: no view ops for the layers nobody reads before the next
    forward, whose update makes them). Assigning `keys`/`values` (transformers' crop, offload) sets them as given.
    arena, slot: a KVArena shared with the cache's other attention layers, and this layer's place in it.
    """

    def __init__(self, capacity: int = 0, arena: KVArena | None = None, slot: int = 0):
        self._k = self._v = None
        self.length = 0  # rows held
        self._views: list = [None, None]  # (keys, values) of [:length), or None: made when read
        self._row_views: tuple | None = None  # (_k, _k and _v transposed [B, capacity, kv heads, d]): update_rows
        self._rows = _Rows()  # the rows a forward writes (an arena's member uses the arena's, shared)
        super().__init__()
        self.capacity_hint = capacity
        self.arena, self.slot = arena, slot

    @property
    def keys(self) -> torch.Tensor | None:
        if self._views[0] is None and self._k is not None:
            self._views[0] = self._k[..., : self.length, :]
        return self._views[0]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._views[0] = t
        self.length = 0 if t is None else t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        if self._views[1] is None and self._v is not None:
            self._views[1] = self._v[..., : self.length, :]
        return self._views[1]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._views[1] = t

    def set_length(self, n: int) -> None:
        """Hold rows [:n) of the buffers (their views made when next read)."""
        self.length = n
        self._views = [None, None]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0 or not self.is_initialized:
            return super().crop(tokens_to_remove)
        self.set_length(max(self.length + tokens_to_remove, 0))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        if self.arena is None or not self.arena.join(self, self.slot, key_states, value_states):
            self.arena = None
            self._alloc(key_states, value_states, max(self.capacity_hint, 2 * key_states.shape[-2], 64))
        self.set_length(0)
        self.is_initialized = True

    def _alloc(self, ks: torch.Tensor, vs: torch.Tensor, capacity: int) -> None:
        self._k = ks.new_empty(*ks.shape[:-2], capacity, ks.shape[-1])
        self._v = vs.new_empty(*vs.shape[:-2], capacity, vs.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cur = self.length
        new = cur + key_states.shape[-2]
        if self._k.is_inference() and not torch.is_inference_mode_enabled():
            # a plain forward after inference-mode rounds (tests, notebooks): leave inference tensors behind
            if self.arena is not None:
                self.arena.replace(self.arena.buf.clone())
            else:
                self._k, self._v = self._k.clone(), self._v.clone()
        if new > self._k.shape[-2]:
            if self.arena is not None:
                self.arena.grow(max(2 * self._k.shape[-2], new))
            else:
                old_k, old_v = self.keys, self.values
                self._alloc(key_states, value_states, max(2 * self._k.shape[-2], new))
                self._k[..., :cur, :].copy_(old_k)
                self._v[..., :cur, :].copy_(old_v)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # a forward that records autograd (not the engine's): in place on fresh views of the buffers
            self._k[..., cur:new, :].copy_(key_states)
            self._v[..., cur:new, :].copy_(value_states)
        else:
            rows = (self.arena.rows if self.arena is not None else self._rows)(cur, new, self._k.device)
            self._k.index_copy_(-2, rows, key_states)
            self._v.index_copy_(-2, rows, value_states)
        self.set_length(new)
        return self.keys, self.values

    def update_rows(self, key_rows: torch.Tensor, value_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update() of keys and values [B, T, kv heads, d] (the projections' layout: no transposes), written by
        index_copy_ into the buffers' transposed views (made once per buffer). The same rows, the same views back."""
        new = self.length + key_rows.shape[1]
        if (not self.is_initialized or new > self._k.shape[-2] or (self._k.is_inference()
                and not torch.is_inference_mode_enabled()) or (torch.is_grad_enabled()
                and (key_rows.requires_grad or value_rows.requires_grad))):
            return self.update(key_rows.transpose(1, 2), value_rows.transpose(1, 2))
        if self._row_views is None or self._row_views[0] is not self._k:
            self._row_views = self._k, self._k.transpose(1, 2), self._v.transpose(1, 2)
        rows = (self.arena.rows if self.arena is not None else self._rows)(self.length, new, self._k.device)
        self._row_views[1].index_copy_(1, rows, key_rows)
        self._row_views[2].index_copy_(1, rows, value_rows)
        self.set_length(new)
        return self.keys, self.values

    def keep(self, start: int, index: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep [:start] plus the rows start + index (in that order); drop the rest. Moves len(index) rows.

        rows: start + index on this layer's device, when the caller has it already (one per commit)."""
        k = index.shape[0]
        if rows is None or rows.device != self._k.device:  # under a device map the layer may sit elsewhere
            rows = start + index.to(self._k.device)
        self._k[..., start: start + k, :].copy_(self.keys.index_select(-2, rows))
        self._v[..., start: start + k, :].copy_(self.values.index_select(-2, rows))
        self.set_length(start + k)

    def reset(self) -> None:
        if self.arena is not None:
            self.arena.members.pop(self.slot, None)
            self.arena = None
        self._k = self._v = None
        super().reset()


def new_cache(model: PreTrainedModel, capacity: int = 0, full_sliding: bool = False) -> DynamicCache:
    """The model's DynamicCache with every full-attention layer preallocated.

    full_sliding: sliding-window layers keep their whole history too (the tree attention applies the
    window), so a rejected branch can be rolled back; a DynamicSlidingWindowLayer forgets too early.
    """
    cache = DynamicCache(config=model.config)
    kv = [i for i, layer in enumerate(cache.layers)
          if type(layer) is DynamicLayer or (full_sliding and type(layer) is DynamicSlidingWindowLayer)]
    arena = KVArena(capacity, len(kv)) if len(kv) > 1 else None
    for slot, i in enumerate(kv):
        cache.layers[i] = PreallocatedLayer(capacity, arena, slot)
    # transformers' linear-attention layers (after 5.22) keep a token counter made on the host and moved to the device
    # when they first see a state: a host-to-device copy per GDN layer in every prefill. Made on the device here (views
    # of one buffer), their `.to(device)` finds it there.
    counted = [layer for layer in cache.layers
               if isinstance(getattr(layer, "cumulative_length_linear", None), torch.Tensor)]
    if counted:
        counters = torch.zeros(len(counted), dtype=counted[0].cumulative_length_linear.dtype,
                               device=model.get_input_embeddings().weight.device)
        for j, layer in enumerate(counted):
            layer.cumulative_length_linear = counters[j]
    return cache


def _has_sliding_layers(model: PreTrainedModel) -> bool:
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    return getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)


def context_features(hidden_states: tuple, layer_ids: list[int]) -> torch.Tensor:
    """DFlash context features: hidden_states[i + 1] of each target layer id, concatenated."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _rebind_hooked_forwards(model: PreTrainedModel, classes: tuple[type, ...]) -> list[tuple[object, object]]:
    """A module placed by accelerate (device_map) calls the forward its hook saw when it was attached;
    point it at the class's current (patched) forward, or a patch installed after loading is bypassed.
    Returns (module, the forward it had) for each module rebound, so that they can be put back."""
    rebound = []
    stack = [model]  # every submodule, walked by hand (model.modules() costs ~1.5x more here)
    while stack:
        module = stack.pop()
        state = module.__dict__
        if "_old_forward" in state and isinstance(module, classes):
            rebound.append((module, state["_old_forward"]))
            module._old_forward = type(module).forward.__get__(module, type(module))
        stack.extend(child for child in state["_modules"].values() if child is not None)
    return rebound


class TargetBinding:
    """What a target session knows of its model before any generation: the tree-attention path, the lean forward, the
    GDN patch. Built once (`ddtree.engine.loop.Engine` keeps one for all its generations) and shared by sessions.

    It describes the model as it is when built: a hook, a compat patch or a device move made later needs a new one.
    What it changes on the model (its attention implementation, the forwards accelerate's hooks call) `restore()`
    puts back; the GDN class patch (the compat row gdn-tree-forward) is process-wide: held by every binding of a
    hybrid, restored when the last one is restored or collected (ddtree.engine.gdn.hold).
    """

    def __init__(self, model: PreTrainedModel, feature_layers: list[int] | None = None,
                 tree_attention: str = "auto", lean: bool = True, tune_allocator: bool | None = None):
        if tree_attention not in TREE_ATTENTION:
            raise ConfigError("tree_attention", f"unknown value '{tree_attention}'", f"use one of {TREE_ATTENTION}")
        self.model = model
        self.device, self.dtype = model.device, model.dtype  # (properties that walk the parameters: read once)
        self.cpu = self.device.type == "cpu"
        # process-wide malloc thresholds, only when asked (ddtree.engine.host); what holds, in words
        self.host_allocator = tune_host_allocator() if self.cpu and allocator_wanted(tune_allocator) else "untouched"
        self.feature_layers = feature_layers
        self.hidden_ids = [i + 1 for i in feature_layers] if feature_layers else None
        dense_ok = attention.base_backend(model.config._attn_implementation) in ("eager", "sdpa")
        if tree_attention == "dense" and not dense_ok:
            raise ConfigError("tree_attention", f"a dense tree mask needs eager or sdpa, not "
                              f"{model.config._attn_implementation}", "use tree_attention='split'")
        self.split = tree_attention != "dense"  # auto may take either path: the split layout serves both
        sliding = _has_sliding_layers(model)
        # auto takes the dense path only where one masked call is exact and cheaper
        self.dense_auto = (tree_attention == "auto" and dense_ok and not sliding
                           and host_branch("dense_attention", self.device))
        self.attn_before = model.config._attn_implementation  # what restore() puts back
        if self.split:
            attention.use_tree_attention(model)
        # the lean forward passes the engine's own mask: only where the backend reads a mask as eager/sdpa do
        self.lean = lean_forward_for(model) if lean and dense_ok and not sliding else None
        self.lean_prefill = self.lean is not None and attention.base_backend(model.config._attn_implementation) == "sdpa"
        self.mtype = model_type(model)
        # a chain verified as a tree (split attention) on a family the lean forward knows: ~800 fewer ops a round on a
        # 64-layer target than the model call's causal path (bench/bench_launches.py); with lean=False too, so the
        # lean forward's bitwise test compares the same attention
        self.chain_as_tree = self.split and dense_ok and not sliding and family(self.mtype).lean is not None
        self.gdn = family(self.mtype).gdn
        self.rebound: list[tuple[object, object]] = []
        self._gdn_hold = None
        if self.gdn:  # held until restore() (or this binding is collected); inert outside a tree_verification context
            self._gdn_hold = weakref.finalize(self, gdn.release, gdn.hold())
            self._gdn_hold.atexit = False
            self.rebound = _rebind_hooked_forwards(model, tuple(gdn.target_classes()))

    def ensure(self) -> None:
        """Before a generation: the model is still on the tree implementation and the GDN row applied (another
        engine's restore() or a compat.revert() may have taken them away). Cheap: two checks when nothing changed."""
        if self.split and self.model.config._attn_implementation not in attention.SPLIT_IMPLEMENTATIONS:
            attention.use_tree_attention(self.model)
        if self.gdn:
            gdn.ensure_installed()

    def restore(self) -> None:
        """Put back what binding changed on the model: its attention implementation (unless another engine had
        switched it already: it stays on the tree implementation, which is the plain backend outside verification),
        and the forwards of hooked modules. Idempotent."""
        before, now = self.attn_before, self.model.config._attn_implementation
        if before not in attention.SPLIT_IMPLEMENTATIONS and now in attention.SPLIT_IMPLEMENTATIONS:
            self.model.set_attn_implementation(before)
        for module, forward in reversed(self.rebound):
            module._old_forward = forward
        self.rebound = []
        if self._gdn_hold is not None:
            self._gdn_hold()  # the last binding to let go restores the GDN classes (ddtree.engine.gdn.hold)


class TargetSession:
    """One generation's target state: the cache, its committed length, feature extraction.

    tree_attention: "split" verifies trees through ddtree.engine.attention (the model is switched to the tree
    implementation wrapping its backend, which is the plain backend outside verification); "dense"
    passes a 4-D additive mask over past + tree (eager/sdpa only; the reference the split is tested against).
    capacity: expected total length (prompt + new tokens + one tree), to size the KV buffers once.
    lean: verify through ddtree.engine.forward.LeanForward (bitwise the model call, without its wrappers) where
    the family, backend and mask allow it; False: always the plain model call.
    binding: a `TargetBinding` of this model built before (then feature_layers, tree_attention and lean are its own).
    """

    def __init__(self, model: PreTrainedModel, feature_layers: list[int] | None = None,
                 tree_attention: str = "auto", capacity: int = 0, lean: bool = True,
                 binding: TargetBinding | None = None):
        b = binding if binding is not None else TargetBinding(model, feature_layers, tree_attention, lean)
        if b.model is not model:
            raise ValueError("TargetSession: the binding was built for another model")
        self.binding, self.model = b, model
        self.feature_layers, self.hidden_ids, self.cpu = b.feature_layers, b.hidden_ids, b.cpu
        self.split, self.dense_auto, self.lean, self.lean_prefill = b.split, b.dense_auto, b.lean, b.lean_prefill
        self.chain_as_tree = b.chain_as_tree
        self.mtype, self.gdn, self.dtype = b.mtype, b.gdn, b.dtype
        self.cache = new_cache(model, capacity, full_sliding=self.split)
        self._arena = next((layer.arena for layer in self.cache.layers if isinstance(layer, PreallocatedLayer)), None)
        self.length = 0
        self._gdn_step_tree = False  # the last verify ran one token through the tree-exact GDN (commit it)
        self._mask: torch.Tensor | None = None  # the dense path's preallocated mask buffer
        self._mask_zero = self._mask_dirty = 0  # columns [:zero) are 0 in every row; [zero:dirty) may be stale

    def check_method(self, spec) -> None:
        """Refuse a multi-token method (spec: its row of the methods table, ddtree.engine.methods.Method) when the
        cache holds linear-attention state no patch verifies exactly."""
        method = spec.name
        text_config = getattr(self.model.config, "text_config", None) or self.model.config
        if spec.verifies_tree and getattr(text_config, "attn_logit_softcapping", None):
            raise ConfigError("method", f"{method} on a '{self.mtype}' target is not supported: its soft-capped "
                              "attention logits cannot be verified as a tree", "use method=dflash or method=ar")
        if self.gdn or not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.cache.layers):
            return
        raise ConfigError("method", f"{method} on a '{self.mtype}' target is not supported: its linear-attention "
                          "layers have no exact tree verification or rollback", "use method=ar for this model family")

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 logits_to_keep: int = 0, lean: bool = False, head: bool = True):
        """The target on ids; lean: `mask` is the whole story (none: every cached key visible to every query).
        head=False (lean only): a `WalkRows` instead of (logits, features)."""
        if lean and self.lean is not None:
            lazy = "lazy" if ids.shape[1] >= LAZY_TAIL_MIN else False
            out, kept = self.lean(ids, position_ids, mask, self.cache, self.hidden_ids, logits_to_keep,
                                  head=True if head else lazy)
            if not head:
                return WalkRows(self.lean, out, kept, self.hidden_ids), None
            feats = torch.cat([kept[i] for i in self.hidden_ids], dim=-1) if self.hidden_ids else None
            return out[0], feats
        if not head:
            raise ValueError("verify(head=False) needs the lean forward (see TargetSession.lazy_head)")
        kw = {}
        if self.hidden_ids:
            kw["output_hidden_states"] = self.hidden_ids
        out = self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                         use_cache=True, logits_to_keep=logits_to_keep, **kw)
        feats = context_features(out.hidden_states, self.feature_layers) if self.hidden_ids else None
        return out.logits[0], feats

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt; returns the last position's logits [V] and the prompt's features.

        A short prompt on a CPU hybrid goes through the tree-exact GDN as one chain (then committed whole):
        one small triangular solve per layer instead of the upstream chunked fallback, which pads every
        prompt to a 64-token chunk and runs a depthwise conv1d that is slow on the CPU.
        """
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0)
        if self.gdn and self.lean is not None and self.dense_auto and 1 < n <= CHAIN_PREFILL_MAX and self.length == 0:
            tree = chain_tree(input_ids[0, 0], input_ids[0, 1:])
            with verification.tree_verification(tree):
                logits, feats = self._forward(input_ids, pos, self._dense_mask(tree), logits_to_keep=1, lean=True)
            self.commit(tree, pos[0])
            return logits[-1], feats
        # an empty cache under sdpa: no mask is the causal mask (sdpa's is_causal), as the model's own build decides
        lean = self.lean_prefill and self.length == 0
        logits, feats = self._forward(input_ids, pos, None, logits_to_keep=1, lean=lean)
        self.length = n
        return logits[-1], feats

    def lazy_head(self, tree: DraftTree) -> bool:
        """Whether a greedy round should verify `tree` with head=False and walk with `host_walk`: a
        branching tree of at least LAZY_HEAD_MIN nodes, built on the host, on a CPU lean target.

        The greedy walk reaches a node only through its parent's argmax, so it needs the logits of its own
        path alone: the head then reads a handful of rows in a few small batches instead of all n."""
        return (self.lean is not None and not tree.is_chain and tree._host is not None
                and len(tree) >= LAZY_HEAD_MIN and host_branch("lazy_head", self.binding.device))

    @torch.inference_mode()
    def verify(self, tree: DraftTree, head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over [root] + nodes; logits [n, V] (row i: the target after node i), features [1, n, F].
        head=False (a branching tree on a lean target, `lazy_head`): (WalkRows, None), the rows a walk asks for."""
        ids = tree.tokens.unsqueeze(0)
        pos = (tree.depths + self.length).unsqueeze(0)
        n = len(tree)
        mask, lean, past = None, n == 1, None  # one token sees every cached key: no mask at all
        if n > 1 and not self.split:
            mask, lean = tree_attention_mask(tree, self.length, self.dtype), True
        elif n > 1 and self.dense_auto and self.length + n <= DENSE_AUTO_KEYS:
            mask, lean = self._dense_mask(tree), True
        elif not tree.is_chain or (n > 1 and self.chain_as_tree):  # a chain as a tree on a lean family: fused norms
            past, lean = self.length, True  # the tree attention is active and builds its own masks
        # else a long chain on split: the causal mask the model builds itself
        # one context for the round: the tree attention (where `past` is given) and the tree-exact GDN read it
        self._gdn_step_tree = n == 1 and self.gdn and not host_branch("gdn_step", self.binding.device)
        if n > 1 or self._gdn_step_tree:  # (one token off the CPU branch: the tree-exact GDN too, see commit)
            context = verification.tree_verification(tree, past)
        else:
            context = verification.tree_verification(None, step=True)
        with context:
            return self._forward(ids, pos, mask, lean=lean, head=head)

    def _dense_mask(self, tree: DraftTree) -> torch.Tensor:
        """tree_attention_mask(tree, length) as a view of a buffer kept across rounds: O(n * (accepted + n)) a round."""
        n, past = len(tree), self.length
        buf, fill = self._mask, torch.finfo(self.dtype).min
        if buf is None or buf.shape[2] < n or buf.shape[3] < past + n:
            rows = max(n, 0 if buf is None else buf.shape[2])
            cols = max(2 * (past + n), 0 if buf is None else 2 * buf.shape[3])
            buf = self._mask = torch.full((1, 1, rows, cols), fill, dtype=self.dtype, device=self.binding.device)
            self._mask_zero = self._mask_dirty = 0
        buf[..., self._mask_zero: past] = 0  # newly committed columns: visible to every node
        if self._mask_dirty > past:
            buf[..., past: self._mask_dirty] = fill  # the last tree's columns past the new prefix
        block = buf[0, 0, :n, past: past + n]
        block.masked_fill_(tree.ancestor_matrix(), 0)
        self._mask_zero, self._mask_dirty = past, past + n
        return buf[:, :, :n, : past + n]

    @torch.inference_mode()
    def commit(self, tree: DraftTree, accepted: torch.Tensor, host_path: list[int] | None = None) -> None:
        """Keep the committed prefix plus the accepted path (flat indices, root first, on the device); drop the rest.
        host_path: the same path as a list, where the walk has it on the host (saves the GDN commit a few ops)."""
        n, k = len(tree), accepted.shape[0]
        contiguous = tree.is_chain  # a chain's accepted path is always its first k nodes
        rows = None if contiguous else self.length + accepted  # the kept rows, shared by the layers on its device
        arena = self._arena
        moved = (not contiguous and arena is not None and len(arena.members) == arena.slots
                 and rows.device == arena.buf.device
                 and all(m.length == self.length + n for m in arena.members.values()))
        if moved:  # every attention layer in one buffer: one gather and one copy for all of them
            arena.keep(self.length, rows)
        for layer in self.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                continue  # GDN states are committed below
            if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
                raise NotImplementedError(f"cannot roll back a {type(layer).__name__} cache layer exactly")
            if not layer.is_initialized:
                continue
            if contiguous:
                layer.crop(k - n)
            elif isinstance(layer, PreallocatedLayer):
                if not (moved and layer.arena is arena):
                    layer.keep(self.length, accepted, rows)
            else:
                dev = layer.keys.device  # under a device map each layer's cache sits on its own device
                keep = torch.cat([torch.arange(self.length, device=dev), self.length + accepted.to(dev)])
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
        if self.gdn and (len(tree) > 1 or self._gdn_step_tree):
            # the device path: no host read. One token (AR) verified as a one-node tree lands here too: its GDN layers
            # dispatch what every other round's do (~30 ops a layer, against ~100 for the upstream step without
            # its optional fused kernels), and this commit updates every layer's state in a handful of ops
            gdn.commit_linear_states(self.cache, accepted, host_path)
        self._gdn_step_tree = False
        self.length += k
