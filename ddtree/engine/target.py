"""The target side of a generation: prefill, verify a tree in one forward, commit the accepted path."""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from ddtree.engine import attention, gdn, verification
from ddtree.engine.families import family, model_type
from ddtree.engine.forward import LazyTail, lean_forward_for
from ddtree.engine.host import allocator_wanted, host_branch, tune_host_allocator
from ddtree.engine.kv_cache import PreallocatedLayer, new_cache
from ddtree.engine.options import EngineOptions, scoped
from ddtree.engine.tree import DraftTree, chain_tree, tree_attention_mask
from ddtree.errors import ConfigError

__all__ = ["TargetBinding", "TargetSession", "WalkRows", "context_features", "model_type"]


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

    options: the engine's (ddtree.engine.options.EngineOptions): the CPU-only branches, the allocator, flex compile,
    auto compile and the compiled round's backend are read from them, here and by the sessions and the compiled round
    built on this binding (None: resolved now, from the scope or the environment).
    """

    def __init__(self, model: PreTrainedModel, feature_layers: list[int] | None = None,
                 tree_attention: str = "auto", lean: bool = True, options: EngineOptions | None = None):
        if tree_attention not in TREE_ATTENTION:
            raise ConfigError("tree_attention", f"unknown value '{tree_attention}'", f"use one of {TREE_ATTENTION}")
        self.model = model
        self.options = options if options is not None else EngineOptions.resolve()
        self.device, self.dtype = model.device, model.dtype  # (properties that walk the parameters: read once)
        self.cpu = self.device.type == "cpu"
        # process-wide malloc thresholds, only when asked (ddtree.engine.host); what holds, in words
        self.host_allocator = (tune_host_allocator(self.options) if self.cpu and allocator_wanted(self.options)
                               else "untouched")
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
                           and host_branch("dense_attention", self.device, self.options))
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
        """The target on ids, under the binding's options (transformers' forward calls code that reads them from
        the scope: ddtree.engine.options); lean: `mask` is the whole story (none: every cached key visible to every
        query). head=False (lean only): a `WalkRows` instead of (logits, features)."""
        with scoped(self.binding.options):
            return self._call(ids, position_ids, mask, logits_to_keep, lean, head)

    def _call(self, ids, position_ids, mask, logits_to_keep, lean, head):
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

    @torch.inference_mode()
    def prefill_many(self, prompts: list[torch.Tensor],
                     windows: dict[str, int | None]) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
        """Several prompts ([1, p_i] each) in one forward, left-padded to the longest P: row i's prompt at rows
        pad_i .. P - 1 of the cache's batch row i, at positions 0 .. p_i - 1 (a row's keys as its prefill alone
        makes them), every query seeing its own row's prompt up to itself (causal; within the window on a sliding
        layer: `windows`, the mask kinds of the model's layers and each one's window) and no padding (a padding
        query sees itself only: no empty softmax). Every row's last token is its prompt's last: logits_to_keep=1.
        Returns (logits [k, V], each prompt's features [1, p_i, F] or None, pads). A fresh session only; attention
        targets only (a recurrent layer's state would read the padding): `BatchRun.join` sends hybrids alone.
        Sliding layers keep every row here (the slots a batched round seats need the whole prompt)."""
        if self.length or any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.cache.layers):
            raise ValueError("prefill_many: a fresh session of an attention target only")
        dev, k = self.binding.device, len(prompts)
        lengths = [p.shape[1] for p in prompts]
        width = max(lengths)
        pads = [width - n for n in lengths]
        ids = torch.zeros((k, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, pads[i]:] = p[0].to(dev)
        start = torch.tensor(pads, device=dev)[:, None]  # [k, 1]: each row's first real token
        cols = torch.arange(width, device=dev)
        pos = (cols[None, :] - start).clamp(min=0)  # [k, P]
        q, kcol = cols[None, :, None], cols[None, None, :]
        seen = ((kcol <= q) & (kcol >= start[:, :, None])) | (kcol == q)  # [k, P, P]
        lowest = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=dev)
        masks = {kind: zero.where(seen if w is None else seen & (q - kcol < w), lowest)[:, None]
                 for kind, w in windows.items()}  # [k, 1, P, P] by mask kind
        mapping = masks if len(masks) > 1 else next(iter(masks.values()))
        self.cache = new_cache(self.model, width + 1, full_sliding=True)
        self._arena = None
        kw = {"output_hidden_states": self.hidden_ids} if self.hidden_ids else {}
        with scoped(self.binding.options):
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mapping, cache=self.cache,
                             use_cache=True, logits_to_keep=1, **kw)
        self.length = width
        feats = context_features(out.hidden_states, self.feature_layers) if self.hidden_ids else None
        rows = [None if feats is None else feats[i: i + 1, pads[i]:] for i in range(k)]
        return out.logits[:, -1], rows, pads

    def lazy_head(self, tree: DraftTree) -> bool:
        """Whether a greedy round should verify `tree` with head=False and walk with `host_walk`: a
        branching tree of at least LAZY_HEAD_MIN nodes, built on the host, on a CPU lean target.

        The greedy walk reaches a node only through its parent's argmax, so it needs the logits of its own
        path alone: the head then reads a handful of rows in a few small batches instead of all n."""
        return (self.lean is not None and not tree.is_chain and tree._host is not None
                and len(tree) >= LAZY_HEAD_MIN and host_branch("lazy_head", self.binding.device, self.binding.options))

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
        options = self.binding.options
        self._gdn_step_tree = n == 1 and self.gdn and not host_branch("gdn_step", self.binding.device, options)
        if n > 1 or self._gdn_step_tree:  # (one token off the CPU branch: the tree-exact GDN too, see commit)
            context = verification.tree_verification(tree, past, flex_compile=options.flex_compile)
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
            gdn.commit_linear_states(self.cache, accepted, host_path,
                                     host_rows=host_branch("host_tree", self.binding.device, self.binding.options))
        self._gdn_step_tree = False
        self.length += k
