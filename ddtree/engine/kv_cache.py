"""The target's KV cache: every full-attention layer's keys and values preallocated for a generation's capacity, in
one arena a commit moves in one gather and copy (`KVArena`, `PreallocatedLayer`, `new_cache`). TargetSession
(ddtree.engine.target) makes one per generation; the lean forward writes its rows (`update_rows`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["KVArena", "PreallocatedLayer", "new_cache"]


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
