"""The compiled verification round: a static-shape target forward and commit, behind `compile=auto|true|false`.

A GPU at batch 1 is bound by kernel launches: the eager verification dispatches thousands of ops a round
(docs/gpu.md). Here the round's target side is two fixed-shape functions compiled with
`torch.compile(fullgraph=True, dynamic=False)` (on CUDA with `mode="reduce-overhead"`: CUDA graphs):

* **verify** (`StaticRound._verify`): token ids [1, N], the tree's parents, depths and ancestor matrix, and the
  cache's length as a device tensor. Every full-attention layer writes its N new keys and values at rows
  length .. length + N - 1 of its own fixed-capacity key and value buffers (`index_copy_`, offsets on the device:
  Inductor writes a buffer of its own in place, where a view of one stacked buffer made it copy the whole
  buffer) and attends over all C rows under an additive mask (the committed rows, plus the node's ancestors among
  the new ones), each KV group's queries stacked along the sequence (`grouped_attention`: no `enable_gqa` with a
  mask, which on CUDA only SDPA's math backend takes); every
  Gated DeltaNet layer runs `gdn.tree_layer` on its fixed-size conv and recurrent states, its tree metadata built
  inside the graph (`gdn.meta_tensors`). No Python-side state is read inside, no host sync.
* **commit** (`StaticRound._commit`): the accepted path padded to N with -1 (its count is read on the device):
  the GDN states move to prefix + path (`gdn._path_states`' arithmetic with the padding masked), every attention
  layer's accepted rows move to length .. (a gather of N rows into a temporary, then a copy into place: the reads
  and writes of overlapping rows never share a kernel), the length grows.

N is the round's node count (AR 1, DFlash the block, DDTree the tree size, MTP its chain or tree: fixed per
setting) and C the capacity: `ddtree.engine.capacity.capacity_bucket` of prompt + max_new_tokens + N (a power
of two up to 4,096 rows, then steps of 4,096 or 1/16 octave), kept for later generations while it suffices, so
prompts of other lengths reuse the same graphs (no recompile). The prefill stays eager (the usual `TargetSession`), and its cache
is copied into the static buffers once per generation.

Two more graphs where the method has them: DDTree's tree build (`best_first_tensors`, `StaticRound.tree`; a DFlash2
drafter's selector walk or pair tree, the proposer's `tree_graph`) and the DFlash (or DFlash2) drafter's forward
from a generation's second round (`StaticDraft`, ddtree.engine.drafter.model_static), or MTP's head, its context
read and its chain or tree drafting in one graph, from the second round too (`StaticMTP`,
ddtree.engine.drafter.mtp_static): each drafter's static form lives next to its model, and `StaticRound.attach`
builds the one a proposer declares (`Proposer.static_form`). The round then reads the device once, in the walk, as
the eager one does. Decoder layers are driven as `ddtree.engine.forward.LeanLayer` drives them (the model's own submodules,
step for step), so logits equal the eager engine's to rounding (greedy tokens equal: tests/test_compile.py).

Where it runs: a target the lean forward runs (a family whose table row names its positions, eager/sdpa, no
sliding layers, no device map, no hooks), every decoder layer a checked class with a dense MLP (an MoE block
routes tokens: not traced), methods ar, dflash, ddtree and mtp. `compile="auto"` uses it on a CUDA target where it
can run, and nowhere else: on a CPU a compile costs tens of seconds to minutes and a round gains little there
(docs/compile.md has the measurement); a target it cannot run takes the eager path with the reason logged.
`compile="true"` compiles on any device and refuses a target it cannot run with one ConfigError line.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from ddtree.engine import gdn
from ddtree.engine.capacity import capacity_bucket
from ddtree.engine.checks import compile_setting
from ddtree.engine.families import ROPE
from ddtree.engine.fixed_kv import grouped_attention, grouped_bias, kv_buffers
from ddtree.engine.forward import _MLPS, _NORMS_CENTERED, LeanLayer, lean_norm
from ddtree.engine.sharded import is_sharded
from ddtree.engine.tree import DraftTree, best_first_tensors
from ddtree.engine.weights import plain
from ddtree.errors import ConfigError

__all__ = ["StaticRound", "StaticSession", "auto_compiles", "capacity_bucket", "fused_sdpa_refusal", "static_round_for",
           "why_not_static"]

log = logging.getLogger("ddtree.engine.compiled")

# graphs a region may hold (node counts x capacities x dtypes x models in one process) before it refuses to compile
# another: per torch.compile call, not dynamo's process-wide setting
RECOMPILE_LIMIT = 64
# torch.compile takes recompile_limit= from torch 2.12 on (pytorch#177936, March 2026): torch 2.11 (the GPU image's)
# would raise TypeError; there `_run` lifts dynamo's own limit (8 a function, which a fullgraph region raises past:
# capacities x node counts x models reach it) to RECOMPILE_LIMIT around each graph call, not process-wide
_TAKES_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def why_not_static(binding, unfit: str | None) -> str | None:
    """Why the static round cannot run this target, in words; None where it can. unfit: the proposer, in words,
    where it does not declare `compilable` (one node count per engine), else None."""
    if unfit is not None:
        return f"{unfit}'s trees may vary in size (the compiled round needs a fixed node count per engine)"
    if is_sharded(binding.model):
        return ("the target is tensor-parallel (model.tp_plan): the compiled round does not trace its collectives "
                "yet, so each rank runs the eager round on its shards")
    lean = binding.lean
    if lean is None:
        return ("the lean forward does not run this target (its family, attention backend, sliding-window layers, "
                "device map or hooks)")
    for i, (layer, driven) in enumerate(zip(lean.layers, lean.lean_layers, strict=True)):
        if driven is None:
            return f"decoder layer {i} ({type(layer).__name__}) is not a layer the lean forward drives"
        if type(layer.mlp).__name__ not in _MLPS:
            return f"decoder layer {i}'s MLP ({type(layer.mlp).__name__}) routes tokens (MoE): not traced yet"
    linear = [layer.linear_attn for layer, lin in zip(lean.layers, lean.linear, strict=True) if lin]
    if linear and not binding.gdn:
        return "its linear-attention layers have no tree-exact verification"
    if len({(m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel_size) for m in linear}) > 1:
        return "its Gated DeltaNet layers differ in shape (the static round stacks their states)"
    return None


def auto_compiles(binding) -> bool:
    """Whether compile=auto compiles for this target: on a CUDA device, unless the binding's options (the engine's)
    turn it off (`auto_compile=False`, DDTREE_COMPILE=0)."""
    return binding.device.type == "cuda" and binding.options.auto_compile


def static_round_for(binding, unfit: str | None, setting: str,
                     backend: str | None = None) -> tuple[StaticRound | None, str | None]:
    """(the engine's StaticRound under compile=`setting`, or None for the eager path; why the eager one runs, in
    words, or None). unfit: as why_not_static's. auto logs the reason where the target is on CUDA; true refuses a
    target it cannot run. backend: torch.compile's backend (None: the binding's options' (the engine's), else
    inductor; "eager" or "aot_eager" trace the same graphs without the code generation: tests)."""
    setting = compile_setting(setting)
    if setting == "false":
        return None, "compile=false"
    if setting == "auto" and not auto_compiles(binding):  # a CPU compile costs far more than it saves
        why = ("auto_compile=False (DDTREE_COMPILE=0) turns compile=auto off" if binding.device.type == "cuda"
               else f"compile=auto compiles on CUDA only (here {binding.device.type}; docs/compile.md)")
        return None, why
    reason = why_not_static(binding, unfit)
    if reason is not None:
        if setting == "true":
            raise ConfigError("compile", f"the compiled round cannot run here: {reason}",
                              "use compile=auto (eager where it cannot run) or compile=false")
        log.info("compile=auto: the eager round runs: %s", reason)
        return None, f"compile=auto: {reason}"
    return StaticRound(binding, backend=backend or binding.options.compile_backend), None


def _tree_tensors(root: torch.Tensor, logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """best_first_tensors over the drafter's log-probabilities: fixed shapes for a budget, no host read."""
    return best_first_tensors(root, torch.log_softmax(logits, dim=-1), budget)


def _frozen_norm(norm: torch.nn.Module):
    """lean_norm(norm) without its weight-version check (a host read of attributes dynamo cannot trace): the
    centred norm's (1 + w) is built once here. The arithmetic is lean_norm's."""
    if type(norm).__name__ not in _NORMS_CENTERED or not plain(norm.weight):
        return lean_norm(norm)
    with torch.no_grad():
        scale = 1.0 + norm.weight.detach().float()
    torch._dynamo.mark_static_address(scale)  # read by every replay: not copied in
    eps = norm.eps
    return lambda x: F.rms_norm(x.float(), (x.shape[-1],), scale, eps).type_as(x)


class _FrozenLayer(LeanLayer):
    """A LeanLayer whose norms are `_frozen_norm`s (traceable)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__(layer)
        self.norm1 = _frozen_norm(layer.input_layernorm)
        self.norm2 = _frozen_norm(layer.post_attention_layernorm)
        if not self.linear:
            self.q_norm, self.k_norm = (None if getattr(self.attn, n, None) is None
                                        else _frozen_norm(getattr(self.attn, n)) for n in ("q_norm", "k_norm"))


def _owned(out):
    """`out` with every tensor cloned (tuples and lists walked): memory of our own, outside the CUDA graph pool."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple | list):
        return type(out)(_owned(o) for o in out)
    return out


def fused_sdpa_refusal(query, keys, values, mask, enable_gqa: bool = False) -> str | None:
    """Why CUDA's memory-efficient SDPA kernel would refuse this masked call (the math backend then runs: K/V
    expanded per query head, fp32 scores), in words; None where it takes it. Its rules as torch's sdp_utils checks
    them (tensors' metadata only: runs on any device): 4-D inputs, no GQA, a last dim of stride 1 and a multiple of
    8, half or float, a mask in the queries' dtype broadcastable to [B, H, L, S] whose rows are 16-aligned (else
    torch pads a copy of it)."""
    if enable_gqa or query.shape[1] != keys.shape[1]:
        return f"grouped-query attention ({query.shape[1]} query heads over {keys.shape[1]} KV heads)"
    if any(t.dim() != 4 for t in (query, keys, values)):
        return "inputs not 4-D"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    if any(t.stride(-1) != 1 for t in (query, keys, values)):
        return "a last dim of stride != 1"
    if query.shape[-1] % 8:
        return f"head dim {query.shape[-1]} not a multiple of 8"
    if mask is not None:
        if mask.dtype != query.dtype:
            return f"a {mask.dtype} mask (torch converts it to {query.dtype}: a copy a call)"
        if mask.dim() != 4 or mask.shape[-2:] != (query.shape[-2], keys.shape[-2]):
            return f"mask shape {tuple(mask.shape)} for [.., {query.shape[-2]}, {keys.shape[-2]}]"
        if mask.shape[-1] % 16:
            return f"mask rows of {mask.shape[-1]} (not 16-aligned: torch pads a copy)"
    return None


def _stack_pending(bufs: list) -> tuple[torch.Tensor, ...]:
    """What the commit graph reads of the GDN layers' LayerBuffers, stacked over the layers once: the k rows of each
    key head (G, B, Hk, T, dk: `keys` holds [q; k] rows per value head, the commit reads k once per key head), then
    deltas, xy and extended whole."""
    return (torch.stack([b.keys[:, :, 0, 1] for b in bufs]),
            *(torch.stack([getattr(b, name) for b in bufs]) for name in ("deltas", "xy", "extended")))


def pending_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """One GDN layer's shapes of `_stack_pending`'s four, from `gdn._buffer_shapes`'."""
    bsz, hk, _, _, n, dk = shapes["keys"]
    return {"keys": (bsz, hk, n, dk), **{name: shapes[name] for name in ("deltas", "xy", "extended")}}


def _move_rows(src: torch.Tensor, dst: torch.Tensor, *buffers: list[torch.Tensor]) -> None:
    """Rows `src` of every buffer to rows `dst` (dim -2), in place: a gather of the rows, then the copy."""
    for group in buffers:
        for t in group:
            t.index_copy_(-2, dst, t.index_select(-2, src))


class StaticState:
    """The fixed buffers of one capacity: the keys and the values of every attention layer (`fixed_kv.kv_buffers`: one
    [1, Hkv, C, d] buffer each), the GDN conv [G, 1, channels, K] and recurrent [G, 1, Hv, dk, dv] states, the
    length [1] (long). Static addresses (CUDA graphs replay on them); kept by the StaticRound across generations."""

    def __init__(self, capacity: int, keys: list | None, values: list | None, conv: torch.Tensor | None,
                 rec: torch.Tensor | None, length: torch.Tensor):
        self.capacity, self.keys, self.values, self.conv, self.rec, self.length = (capacity, keys, values, conv, rec,
                                                                                 length)
        for t in (conv, rec, length):
            if t is not None:
                torch._dynamo.mark_static_address(t)


class StaticRound:
    """One engine's compiled verify and commit (see the module docstring). Built once per Engine; its graphs and
    buffers serve every generation whose rows fit its capacity."""

    def __init__(self, binding, backend: str | None = None):
        lean = binding.lean
        self.binding, self.model, self.lean = binding, binding.model, lean
        self.device = binding.device
        self.hidden_ids = binding.hidden_ids
        with torch.inference_mode():
            self.layers = [_FrozenLayer(layer) for layer in lean.layers]
            self.final_norm = _frozen_norm(lean.base.norm)
            self.gdn_modules = [layer.layer.linear_attn for layer in self.layers if layer.linear]
            self.consts = [gdn.layer_consts(m) for m in self.gdn_modules]
        for consts in self.consts:  # read by every replay: static inputs, not copied in
            for t in vars(consts).values():
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_static_address(t)
        self.kernel = self.gdn_modules[0].conv_kernel_size if self.gdn_modules else 0
        self.attn_layers = [i for i, layer in enumerate(self.layers) if not layer.linear]
        self.mrope = lean.positions != ROPE
        opts: dict = {"fullgraph": True, "dynamic": False}
        backend = backend if backend is not None else binding.options.compile_backend  # the engine's option
        if _TAKES_RECOMPILE_LIMIT:
            opts["recompile_limit"] = RECOMPILE_LIMIT
        if backend is not None:
            opts["backend"] = backend
        elif self.device.type == "cuda":
            opts["mode"] = "reduce-overhead"  # CUDA graphs: one launch a graph
        self.options = opts
        # CUDA graph trees reuse a graph's output memory once another compiled function runs (each call starts a new
        # generation), and every output here is read after the next graph: each is cloned out of the pool (`_run`)
        self.cudagraphs = opts.get("mode") == "reduce-overhead"
        self.verify_graph = torch.compile(self._verify, **opts)
        self.tree_graph = torch.compile(_tree_tensors, **opts)  # DDTree's torch tree build (DDTreeProposer)
        self.commit_graph = torch.compile(self._commit, **opts)
        self.state: StaticState | None = None
        # the compiled drafter forward or MTP head, where the proposer's can run (attach)
        self.draft = None

    def attach(self, proposer) -> str | None:
        """Compile what `proposer` declares (ddtree.engine.proposers.Proposer): its best-first tree build (`tree`,
        as `tree_tensors`) or its own (`tree_graph`, one graph, as `tree_tensors`) and its drafter's static form (`static_form`: a class next to its model, e.g.
        ddtree.engine.drafter.model_static.StaticDraft, built as `static_form(self, proposer)` where its
        `why_not(self, proposer)` finds nothing, as `static_draft`); returns why its drafter drafts eagerly, or None
        (compiled, or nothing to draft)."""
        if proposer.best_first:
            proposer.tree_tensors = self.tree
        elif proposer.tree_graph is not None:  # a tree build of the proposer's own, as one graph
            graph = torch.compile(proposer.tree_graph, **self.options)
            proposer.tree_tensors = lambda *args: self._run(graph, *args)  # (`_run` looked up at each call: a seam)
        form = proposer.static_form
        if form is None:
            # nothing of the proposer's to compile (AR), or a proposer with no compiled form that drafts
            return None if proposer.max_nodes <= 1 else "no compiled draft form"
        reason = form.why_not(self, proposer)
        if reason is None:
            self.draft = proposer.static_draft = form(self, proposer)
        else:
            log.info("the drafter drafts eagerly (its verification compiled): %s", reason)
        return reason

    def detach(self, proposer) -> None:
        """Undo `attach`: the proposer drafts and builds its tree eagerly again (compile=auto's fallback)."""
        if proposer.tree_tensors == self.tree or proposer.tree_graph is not None:
            proposer.tree_tensors = None
        if proposer.static_draft is self.draft:
            proposer.static_draft = None
        self.draft = None

    def session(self, needed: int) -> StaticSession:
        """A fresh generation's session; `needed`: prompt + max_new_tokens + the largest tree (rows)."""
        return StaticSession(self, needed)

    # ------------------------------------------------------------------------------------------- buffers
    def _state_for(self, cache, needed: int) -> StaticState:
        """The buffers of `needed` rows' capacity bucket (kept while a generation needs that bucket), else new ones: a
        long generation's capacity does not stay with the short ones after it (attention reads every row)."""
        attn = [cache.layers[i] for i in self.attn_layers]
        linear = [i for i, layer in enumerate(self.layers) if layer.linear]
        st = self.state
        capacity = capacity_bucket(needed)
        if st is not None and st.capacity == capacity:
            return st
        self.state = st = None  # (a larger capacity's buffers freed first: the new ones may be smaller)
        keys = values = conv = rec = None
        if attn:
            keys, values = kv_buffers(len(attn), attn[0].keys, capacity)
        if linear:
            c0, r0 = cache.get_conv_state(linear[0], state_idx=0), cache.get_recurrent_state(linear[0], state_idx=0)
            conv = torch.zeros(len(linear), *c0.shape[:-1], self.kernel, dtype=c0.dtype, device=c0.device)
            rec = torch.zeros(len(linear), *r0.shape, dtype=r0.dtype, device=r0.device)
        self.state = StaticState(capacity, keys, values, conv, rec,
                                 torch.zeros(1, dtype=torch.long, device=self.device))
        return self.state

    @torch.inference_mode()
    def load(self, cache, length: int, needed: int) -> StaticState:
        """Copy an eager prefill's cache (`length` rows) into the static buffers."""
        st = self._state_for(cache, needed)
        for a, i in enumerate(self.attn_layers):
            layer = cache.layers[i]
            st.keys[a][..., :length, :].copy_(layer.keys[..., :length, :])
            st.values[a][..., :length, :].copy_(layer.values[..., :length, :])
        for g, i in enumerate(i for i, layer in enumerate(self.layers) if layer.linear):
            st.conv[g].copy_(cache.get_conv_state(i, state_idx=0)[..., -self.kernel:])
            st.rec[g].copy_(cache.get_recurrent_state(i, state_idx=0))
        st.length.fill_(length)
        return st

    # ------------------------------------------------------------------------------------------- the graphs
    def _verify(self, ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                length: torch.Tensor, keys: list | None, values: list | None, conv: torch.Tensor | None,
                rec: torch.Tensor | None):
        """(logits [N, V], features [1, N, F] or None, the GDN layers' stacked (keys, deltas, xy, extended) or
        None). Writes the N new rows of every attention layer into its `keys` and `values` buffers; reads the GDN
        states, writes none."""
        n = ids.shape[1]
        dev = ids.device
        base = self.lean.base
        positions = (depths + length).view(1, n)
        hidden = base.embed_tokens.forward(ids)
        rope_ids = positions[None].expand(3, *positions.shape) if self.mrope else positions
        rope = base.rotary_emb.forward(hidden, rope_ids)
        visible = rows = None
        biases: dict[int, torch.Tensor] = {}  # grouped_bias per group size, built once a round
        if keys is not None:
            rel = torch.arange(keys[0].shape[-2], device=dev) - length  # each cache row's place after the committed
            tree_cols = anc.index_select(1, rel.clamp(0, n - 1)) & (rel >= 0) & (rel < n)
            visible = (rel < 0) | tree_cols  # [N, C]
            rows = length + torch.arange(n, device=dev)
        meta = bufs = None
        if conv is not None:
            meta, bufs = self._gdn_round(hidden, parents, depths, anc)
        wanted = set(self.hidden_ids or ())
        kept = {0: hidden} if 0 in wanted else {}
        last = len(self.layers)
        a = g = 0
        for i, layer in enumerate(self.layers):
            h = layer.norm1(hidden)
            if layer.linear:
                h = gdn.tree_layer(layer.layer.linear_attn, h, conv[g], rec[g], meta, self.consts[g], bufs[g])
                g += 1
            else:
                query, gate = layer._queries(h)
                key, value = layer._keys_values(h)
                query, key = layer.rotary(query, key, *rope)
                k_buf, v_buf = keys[a], values[a]
                k_buf.index_copy_(-2, rows, key.to(k_buf.dtype))
                v_buf.index_copy_(-2, rows, value.to(v_buf.dtype))
                groups = query.shape[1] // k_buf.shape[1]
                if groups not in biases:
                    biases[groups] = grouped_bias(visible, groups, query.dtype)
                out = grouped_attention(query, k_buf, v_buf, biases[groups], layer.attn.scaling)
                out = out.transpose(1, 2)  # [1, N, heads, d], as the gate (LeanLayer._queries)
                if gate is not None:
                    out = out * torch.sigmoid(gate)
                h = layer.o(out.reshape(1, n, -1))
                a += 1
            hidden = layer._feed_forward(hidden + h)
            if i + 1 in wanted and i + 1 != last:
                kept[i + 1] = hidden
        hidden = self.final_norm(hidden)
        if last in wanted:
            kept[last] = hidden
        logits = self.lean.head.forward(hidden)[0]
        feats = torch.cat([kept[i] for i in self.hidden_ids], dim=-1) if self.hidden_ids else None
        pending = None
        if conv is not None:  # the commit's inputs, stacked over the GDN layers once
            pending = _stack_pending(bufs)
        return logits, feats, pending

    def _gdn_round(self, hidden: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor):
        """The round's TreeMeta and every GDN layer's LayerBuffers (the four the commit reads are stacked by `_verify`
        after the layers have written them)."""
        n = hidden.shape[1]
        up = parents.clamp(min=0)
        hop = torch.arange(n, device=hidden.device)
        hops = [hop]
        for _ in range(self.kernel - 1):  # the K-window's ancestors: the root repeats past it
            hop = up[hop]
            hops.append(hop)
        conv_index, decay_map, decay_mask = gdn.meta_tensors(torch.stack(hops, dim=1), depths, anc)
        meta = gdn.TreeMeta(conv_index, decay_map, decay_mask, depths, up, n - 1)
        module = self.gdn_modules[0]
        channels = module.conv1d.weight.shape[0]
        shapes = gdn._buffer_shapes(module, hidden.shape[0], n, channels)
        bufs = []
        for consts in self.consts:  # buffers of its own per layer: writes into slots of a stacked buffer made
            # Inductor copy the whole stack at every layer (G^2 slots a round); the commit's four are stacked once
            b = gdn.LayerBuffers(**{name: torch.empty(shape, device=hidden.device, dtype=hidden.dtype
                                                      if name in gdn._MODEL_DTYPE else torch.float32)
                                    for name, shape in shapes.items()})  # as gdn.new_buffers lays them out
            gdn._fill_gates(b.gates, consts)
            bufs.append(b)
        return meta, bufs

    def _commit(self, path: torch.Tensor, length: torch.Tensor, keys: list | None, values: list | None,
                conv: torch.Tensor | None, rec: torch.Tensor | None, pending: tuple | None,
                feats: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_count: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None, path_tokens: torch.Tensor | None = None):
        """Move the GDN states to prefix + path, every attention layer's path rows behind the committed ones
        (`_move_rows`: padding rows copy row `length`, behind the real ones) and the length past it.
        path: [N] flat indices root first, padded with -1.
        feats, context, context_count: the verification's features, and the compiled drafter's buffers that receive
        the path's rows (padded) and its length (StaticDraft, StaticMTP); tokens, path_tokens: the tree's tokens
        and the buffer that receives the path's (StaticMTP: the head reads each row with the token after it)."""
        n = path.shape[0]
        count = (path >= 0).sum().view(1)
        index = path.clamp(min=0)
        if context is not None:
            context.copy_(feats.index_select(1, index[: context.shape[1]]))
            context_count.copy_(count)
        if path_tokens is not None:
            path_tokens.copy_(tokens.index_select(0, index[: path_tokens.shape[0]]))
        if keys is not None:
            _move_rows(length + index, length + torch.arange(n, device=path.device), keys, values)
        if conv is not None:
            keys, deltas, xy, extended = pending
            x = xy[..., : 3 * n].unflatten(-1, (n, 3))
            y = xy[..., 3 * n:].unflatten(-1, (n + 1, 3))
            last = index.gather(0, count - 1)
            d_path = deltas.index_select(-2, index)  # k_path: each key head's rows, per value head (G, B, Hv, N, dk)
            k_path = keys.index_select(-2, index).unsqueeze(3).expand(
                -1, -1, -1, deltas.shape[2] // keys.shape[2], -1, -1).flatten(2, 3)
            x_last = x.index_select(-2, last)
            y_path = y.index_select(-2, torch.cat([index.new_zeros(1), index + 1]))
            weights = gdn.path_weights(y_path, x_last)  # (..., N + 1, 1): exp(c_a), the path's weights
            on_path = (torch.arange(n, device=path.device) < count).view(n, 1)
            added = (k_path * torch.where(on_path, weights[..., 1:, :], 0.0)).transpose(-1, -2) @ d_path
            rec.copy_(rec.to(added.dtype) * weights[..., :1, :] + added)
            k = self.kernel  # the last K of [the K old conv columns, the path's inputs]: rows of `extended`
            order = torch.cat([torch.arange(k, device=path.device), index + k])
            kept = extended.index_select(2, order.index_select(0, count + torch.arange(k, device=path.device)))
            conv.copy_(kept.transpose(-1, -2))
        length.add_(count)

    # ------------------------------------------------------------------------------------------- a round
    def _run(self, graph, *args):
        """One call of a compiled graph (the seam ddtree.testing.dispatch counts graph calls at). Under CUDA graphs
        its tensor outputs are cloned: the draft's logits feed the tree build, the tree the verification, the
        verification the walk and the commit, and the diagnosis reads the draft and the tree after the commit, while
        torch frees (and reports as overwritten) a graph's outputs as soon as another compiled function runs."""
        if _TAKES_RECOMPILE_LIMIT:
            out = graph(*args)
        else:  # (torch 2.11: RECOMPILE_LIMIT for this call only, not dynamo's 8 a function: capacities x node counts)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = graph(*args)
        return _owned(out) if self.cudagraphs else out

    def tree(self, root: torch.Tensor, logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
        """DDTree's tree build (best_first_tensors) as one graph call: DDTreeProposer.tree_tensors."""
        return self._run(self.tree_graph, root, logits, budget)

    def verify(self, st: StaticState, tree: DraftTree):
        return self._run(self.verify_graph, tree.tokens.view(1, -1), tree.parents, tree.depths, tree.ancestor_matrix(),
                                 st.length, st.keys, st.values, st.conv, st.rec)

    def commit(self, st: StaticState, path: torch.Tensor, n: int, pending, feats: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> None:
        padded = F.pad(path.to(st.length.device), (0, n - path.shape[0]), value=-1)
        draft = self.draft if self.draft is not None and feats is not None else None
        io = draft.commit_io(n, feats, tokens) if draft is not None else ()
        self._run(self.commit_graph, padded, st.length, st.keys, st.values, st.conv, st.rec, pending, *io)


class StaticSession:
    """TargetSession's interface (prefill, verify, commit, length) over a StaticRound, for one generation."""

    def __init__(self, static: StaticRound, needed: int):
        self.static, self.needed = static, needed
        self.length = 0
        self.state: StaticState | None = None
        self._pending = self._feats = None
        self._n = 0

    def prefill(self, input_ids: torch.Tensor):
        from ddtree.engine.target import TargetSession

        eager = TargetSession(self.static.model, capacity=input_ids.shape[1], binding=self.static.binding)
        logits, feats = eager.prefill(input_ids)
        self.state = self.static.load(eager.cache, eager.length, self.needed)
        self.length = eager.length
        return logits, feats

    @property
    def keeps_features(self) -> bool:
        """Whether the commit hands the path's features to the compiled drafter itself (the loop then skips its
        gather): from the second round on, where the drafter's forward is compiled."""
        draft = self.static.draft
        return draft is not None and draft.ready

    @torch.inference_mode()
    def verify(self, tree: DraftTree):
        logits, feats, self._pending = self.static.verify(self.state, tree)
        self._n, self._feats = len(tree), feats
        return logits, feats

    @torch.inference_mode()
    def commit(self, tree: DraftTree, accepted: torch.Tensor, host_path: list[int] | None = None) -> None:
        self.static.commit(self.state, accepted, self._n, self._pending, self._feats, tree.tokens)
        self._pending = self._feats = None
        self.length += accepted.shape[0]
