"""Many streams in one round (`Engine.generate_many`): N streams' trees drafted in one drafter forward, verified in
one target forward over every stream's tree tokens, walked and committed per stream in batched ops, with one host
read a round for all of them. A stream that ends frees its slot; the next prompt's prefill seats it between rounds.

Layout: a slot is a row of every batched tensor. The target's attention layers keep their keys and values in one
buffer per layer group [layers, N, kv heads, C, d] (`SlotKV`), row r of slot i holding stream i's position r; a
round writes stream i's T tree tokens at rows length_i .. length_i + T - 1 and attends over rows [0, max length + T)
under a 4-D additive mask (`round_masks`: the committed rows of its own stream and its tree's ancestors; a sliding
layer's window on top). The DFlash drafter's cache (`SlotDrafterCache`) is its fixed-buffer cache with the slot
dimension, and so is a head's (method=mtp, eagle3: `hkv`, [2, N, kv heads, rows, d]), which drafts a chain or an
EAGLE-2 tree of every slot in the same ops (`head_draft`, `head_expand`). Under compile=true (compile=auto on CUDA)
a round's device work is one fixed-shape graph (`CompiledRound`: every row of the capacity read under the mask, the
drafter's context padded to a fixed width), the same function the eager round runs (`BatchRun.device_round`).
docs/concurrency.md has the whole story.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from ddtree.engine import batch_tree as bt
from ddtree.engine import gdn, verification
from ddtree.engine.adaptive import Choice, LoadBudget, smaller_tree_accepts, target_ranks
from ddtree.engine.capacity import capacity_bucket
from ddtree.engine.compiled import _TAKES_RECOMPILE_LIMIT, RECOMPILE_LIMIT, _owned
from ddtree.engine.drafter.model import _visible
from ddtree.engine.drafter.mtp import mtp_expand, mtp_tree_tensors
from ddtree.engine.fixed_kv import grouped_attention, grouped_bias
from ddtree.engine.host import host_branch
from ddtree.engine.result import GenerationResult
from ddtree.engine.target import TargetSession, context_features
from ddtree.engine.timing import StageTimer
from ddtree.engine.tree import tree_size
from ddtree.errors import ConfigError

__all__ = ["BatchRun", "CompiledRound", "SlotDrafterCache", "SlotKV", "generate_many", "round_masks",
           "why_not_compiled"]

# the methods the batched round runs (the others are refused with concurrency > 1, in one line)
# budget="auto" (method=ddtree): the DDTree budgets LoadBudget weighs each round, besides the chain and no draft
AUTO_CANDIDATES = (4, 8, 16, 32, 64)
# Prompts joining at once prefill in one target forward of at most this many tokens (padding included: k prompts
# left-padded to the longest), an attention target's (BatchRun.join)
JOIN_TOKENS = 8192
# budget=auto, eager rounds: one drafted round in RANK_EVERY carries the drafter ranks to the acceptance estimate
RANK_EVERY = 4


# ---------------------------------------------------------------- the target's keys and values, a row per slot

class _SlotLayer(DynamicLayer):
    """One attention layer of a SlotKV: its keys and values are views of the group's buffers; `update_rows` (the lean
    forward's, `update` the model's) writes a round's tokens at each slot's rows (SlotKV.rows) in one indexed write a
    tensor and returns the rows every query may read; `attend` is the lean forward's attention over them (SlotKV's)."""

    is_sliding = False

    def __init__(self, kv: SlotKV, group: int, index: int):
        super().__init__()
        self.kv, self.group, self.index = kv, group, index
        self.views = (kv.keys[group][index], kv.values[group][index])  # [N, kv heads, C, d] each: made once
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.update_rows(key_states.transpose(1, 2), value_states.transpose(1, 2))

    def update_rows(self, key_rows: torch.Tensor, value_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update() of keys and values [N, T, kv heads, d] (the projections' layout): row t of slot i at the
        slot's row lengths_i + t, one index_put_ each (the indices: SlotKV.begin's, once a round)."""
        kv = self.kv
        # (a graph selects its layer in the graph: its inputs are the group buffers, at static addresses)
        k, v = (kv.keys[self.group][self.index], kv.values[self.group][self.index]) \
            if torch.compiler.is_compiling() else self.views
        slot, rows = kv.slot_col, kv.rows
        index = [slot, None, rows]  # (the op itself: `k[slot, :, rows] = ...` views the values first)
        torch.ops.aten.index_put_(k, index, key_rows if key_rows.dtype == k.dtype else key_rows.to(k.dtype))
        torch.ops.aten.index_put_(v, index, value_rows if value_rows.dtype == v.dtype else value_rows.to(v.dtype))
        end = kv.read_end
        return k[:, :, :end], v[:, :, :end]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        return self.kv.attend(query, key, value, mask, scale)

    def get_seq_length(self) -> int:
        return self.kv.read_end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.read_end, 0


class SlotKV:
    """Every full-attention layer's keys and values for N slots of `capacity` rows, in one buffer per group of layers
    of equal shapes ([layers, N, kv heads, capacity, d]): a commit moves each group's accepted rows in one gather and
    one scatter, whatever the number of layers or slots. `lengths` (host list and device [N]) are each slot's
    committed rows."""

    def __init__(self, model, slots: int, capacity: int, like: DynamicCache):
        self.slots, self.capacity = slots, capacity
        self.cache = DynamicCache(config=model.config)
        attn = [i for i, layer in enumerate(self.cache.layers)
                if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)]
        shapes: dict[tuple, list[int]] = {}
        for i in attn:
            src = like.layers[i]
            shapes.setdefault((tuple(src.keys.shape[1:2]) + tuple(src.keys.shape[3:]),
                               tuple(src.values.shape[1:2]) + tuple(src.values.shape[3:]),
                               src.keys.dtype, src.keys.device), []).append(i)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.where: dict[int, tuple[int, int]] = {}  # layer -> (group, index in the group)
        for g, ((ks, vs, dtype, dev), members) in enumerate(shapes.items()):
            self.keys.append(torch.zeros(len(members), slots, ks[0], capacity, ks[1], dtype=dtype, device=dev))
            self.values.append(torch.zeros(len(members), slots, vs[0], capacity, vs[1], dtype=dtype, device=dev))
            for j, i in enumerate(members):
                self.where[i] = (g, j)
                self.cache.layers[i] = _SlotLayer(self, g, j)
        self.linear = [i for i, layer in enumerate(self.cache.layers)
                       if isinstance(layer, LinearAttentionCacheLayerMixin)]
        dev = like.layers[attn[0]].keys.device if attn else model.device
        self.device = dev
        self.length_list = [0] * slots
        self.lengths = torch.zeros(slots, dtype=torch.long, device=dev)
        self.rows: torch.Tensor | None = None  # [N, T]: the rows this round writes (lengths + arange(T))
        self.start: torch.Tensor | None = None  # [N, 1]: a view of lengths (read before the commit moves them)
        self.slot_col = torch.arange(slots, device=dev)[:, None]  # [N, 1]: with `rows`, a write's index
        self.read_end = 0  # rows [0, read_end) the round's attention reads
        self._bias: tuple | None = None  # (the round's mask, groups, its grouped bias): built by the first layer

    def seat(self, slot: int, prefilled: DynamicCache, length: int, row: int = 0, start: int = 0) -> None:
        """Slot `slot` takes a stream whose prompt `prefilled` (a TargetSession's cache) holds in its batch row `row`,
        at rows start .. start + length - 1 (a left-padded prefill of several prompts: `TargetSession.prefill_many`;
        recurrent states only from a prompt prefilled alone)."""
        if self.linear and (row or start):
            raise ValueError("SlotKV.seat: a hybrid target's prompt is prefilled alone (row 0, no padding)")
        for i, (g, j) in self.where.items():
            src = prefilled.layers[i]
            self.keys[g][j, slot, :, :length].copy_(src.keys[row, :, start: start + length])
            self.values[g][j, slot, :, :length].copy_(src.values[row, :, start: start + length])
        if self.linear:
            gdn.seat_linear_states(self.cache, prefilled, slot, streams=self.slots)
        self.length_list[slot] = length
        self.lengths[slot] = length

    def compact(self, keep: torch.Tensor, host: list[int]) -> None:
        """Keep the slots `keep` (long [n], ascending; `host` the same as ints), in that order, as slots 0 … n - 1:
        each group's buffers and the lengths (an attention target's: BatchRun.compact)."""
        self.keys = [k.index_select(1, keep) for k in self.keys]
        self.values = [v.index_select(1, keep) for v in self.values]
        self.slots = len(host)
        self.length_list = [self.length_list[i] for i in host]
        self.lengths = self.lengths.index_select(0, keep)
        self.slot_col = torch.arange(self.slots, device=self.device)[:, None]
        self._bias = None
        for i, (g, j) in self.where.items():
            self.cache.layers[i].views = (self.keys[g][j], self.values[g][j])

    def begin(self, width: int, fixed: bool = False) -> None:
        """A round of `width` tokens a slot: its rows, and how far the attention reads (fixed: every row of the
        capacity, under the round's mask, as the compiled round's fixed shapes want; else the longest slot's rows,
        a host int)."""
        self.start = self.lengths[:, None]  # [N, 1]: each slot's first row this round (the tree's positions too)
        self.rows = self.start + torch.arange(width, device=self.device)
        self.read_end = self.capacity if fixed else max(self.length_list) + width
        self._bias = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        """SDPA of query [N, H, T, d] over a layer's rows (key, value [N, kv heads, K, d]) under the round's mask
        [N, 1, T, K], each key/value group's queries stacked along the sequence (`grouped_attention`: no key or value
        copies, where the model's sdpa repeats them per query head); the mask tiled to the stacked rows once a round
        (a graph: in it). Returns [N, T, H, d]."""
        n, h, t, d = query.shape
        groups = h // key.shape[1]
        memo = self._bias
        if memo is not None and memo[0] is mask and memo[1] == groups:
            bias = memo[2]
        else:
            bias = mask.repeat(1, 1, groups, 1) if groups > 1 else mask
            if not torch.compiler.is_compiling():
                self._bias = (mask, groups, bias)
        return grouped_attention(query, key, value, bias, scale).transpose(1, 2)

    def check(self, width: int) -> None:
        """Refuse a round of `width` tokens a slot past the capacity (on the host, before the round's device work)."""
        if max(self.length_list) + width > self.capacity:
            raise RuntimeError(f"batched round past its capacity ({max(self.length_list) + width} > "
                               f"{self.capacity} rows)")

    def commit(self, path: torch.Tensor, lengths: torch.Tensor) -> None:
        """Each slot keeps its committed rows plus its accepted path (`path` [N, K] flat node indices, padded with
        the path's last node; `lengths` [N] nodes accepted): device work only (`advance` counts them on the host)."""
        if path.shape[1] == 1:  # the root alone (an AR round): its row is where it was written
            self.lengths += lengths
            return
        start = self.lengths[:, None]
        src = [None, self.slot_col, None, start + path]  # buf[:, i, :, src_i]: [N, K, layers, heads, d]
        dst = [None, self.slot_col, None, start + torch.arange(path.shape[1], device=path.device)]
        for bufs in (self.keys, self.values):
            for buf in bufs:  # (aten's ops: the indexing syntax's own views cost ops too)
                torch.ops.aten.index_put_(buf, dst, torch.ops.aten.index(buf, src))
        self.lengths += lengths

    def advance(self, host_lengths: list[int]) -> None:
        """The round's accepted nodes per slot, read from the walk: the host's copy of `lengths`."""
        self.length_list = [a + b for a, b in zip(self.length_list, host_lengths, strict=True)]


def round_masks(tree: bt.BatchTree, lengths: torch.Tensor, read_end: int, dtype: torch.dtype,
                windows: Iterable[int | None], rows: torch.Tensor | None = None) -> dict[int | None, torch.Tensor]:
    """The round's additive masks [N, 1, T, read_end] by sliding window (None: full attention): query j of slot i
    sees its slot's committed rows and its tree's ancestors (rows lengths_i + a), within the window where one is set
    (a key's position: its row below lengths_i, lengths_i + its depth in the tree). rows: lengths[:, None] +
    arange(T), where the caller has it (SlotKV.rows)."""
    n, t = tree.tokens.shape
    dev = tree.tokens.device
    cols = torch.arange(read_end, device=dev)  # [K]
    # the committed rows of each slot, then its tree's ancestors written over its tree's rows (lengths_i + a)
    if rows is None:
        rows = lengths[:, None] + torch.arange(t, device=dev)  # [N, T]
    seen = (cols < lengths[:, None])[:, None, :].expand(n, t, read_end).scatter(
        2, rows[:, None, :].expand(n, t, t), tree.ancestors)
    out: dict[int | None, torch.Tensor] = {}
    lowest = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=dev)
    for window in dict.fromkeys(windows):
        vis = seen
        if window is not None:
            rel = cols - lengths[:, None]  # [N, K]: the column's node in the tree, where 0 <= rel < T
            qpos = lengths[:, None] + tree.depths  # [N, T]
            kpos = torch.where(rel < 0, cols, lengths[:, None] + tree.depths.gather(1, rel.clamp(0, t - 1)))
            vis = seen & ((qpos[:, :, None] - kpos[:, None, :]) < window)
        out[window] = zero.where(vis, lowest)[:, None]
    return out


# ---------------------------------------------------------------- the DFlash drafter's cache, a row per slot

class SlotDrafterCache:
    """The DFlash drafter's fixed-buffer cache (as FixedDrafterCache) with a row per slot: keys, values [N, kv heads,
    Cd, d] a layer (row r: position r), `length` [N] each slot's context rows, `count` [N] the real rows among a
    forward's context rows (the rest padding, overwritten by the block that follows the real ones)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: torch.Tensor,
                 block: int):
        self.keys, self.values, self.length, self.block = keys, values, length, block
        self.count: torch.Tensor | None = None
        self.rows: tuple = ()  # a write's index (slots, all heads, rows): write_positions'
        self.index: torch.Tensor | None = None  # a subset's slots (`subset`), else every slot
        self.read_end: int | None = None  # rows [0, read_end) a forward's attention reads (None: every row)

    @classmethod
    def empty(cls, drafter, slots: int, capacity: int, block: int) -> SlotDrafterCache:
        cfg = drafter.config
        shape = (slots, cfg.num_key_value_heads, capacity, cfg.head_dim)
        dev, dtype = drafter.device, drafter.dtype
        keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        return cls(keys, values, torch.zeros(slots, dtype=torch.long, device=dev), block)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep the slots `keep` (long [n], ascending) as slots 0 … n - 1 (BatchRun.compact)."""
        self.keys = [k.index_select(0, keep) for k in self.keys]
        self.values = [v.index_select(0, keep) for v in self.values]
        self.length = self.length.index_select(0, keep)
        self.__dict__.pop("_slot_col", None)

    def subset(self, index: torch.Tensor) -> SlotDrafterCache:
        """The slots `index` (long [n]) as a cache of n rows: writes land in the shared buffers at those slots' rows,
        attention reads a copy of those rows; `length` is a copy (write it back after the forward): the cache the
        prompts joining at once fill (`BatchRun.read_prompts`)."""
        view = SlotDrafterCache(self.keys, self.values, self.length.index_select(0, index), self.block)
        view.index = index
        return view

    def write_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The forward's positions [N, c + block] are the rows it writes (the context's padding rows: all onto the
        buffer's last row, never read, so that no row is written twice: `BatchRun.draft`); the keys are every row of
        the buffers."""
        n = position_ids.shape[0]
        col = self.slot_col(n, position_ids.device) if self.index is None else self.index[:, None]
        self.rows = (col, None, position_ids)
        return torch.arange(self.read_end or self.keys[0].shape[-2], device=position_ids.device)[None].expand(n, -1)

    def slot_col(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n)[:, None]: the slot index of a write (made once)."""
        col = self.__dict__.get("_slot_col")
        if col is None or col.shape[0] != n or torch.compiler.is_compiling():
            col = torch.arange(n, device=device)[:, None]
            if not torch.compiler.is_compiling():
                self._slot_col = col
        return col

    def write_rows(self, layer_idx: int, keys: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, n, kv heads, d] (the projections' layout) at their rows, one index_put_ each."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        torch.ops.aten.index_put_(k, list(self.rows), keys if keys.dtype == k.dtype else keys.to(k.dtype))
        torch.ops.aten.index_put_(v, list(self.rows), values if values.dtype == v.dtype else values.to(v.dtype))
        if self.read_end is not None:  # the rows written so far (an eager forward: rows past them hold nothing)
            k, v = k[:, :, : self.read_end], v[:, :, : self.read_end]
        if self.index is not None:  # a subset: its slots' rows
            return k.index_select(0, self.index), v.index_select(0, self.index)
        return k, v

    def mask(self, block_position_ids: torch.Tensor, key_positions: torch.Tensor, window: int | None, causal: bool,
             dtype: torch.dtype, groups: int) -> tuple[torch.Tensor, int]:
        """grouped_attention's additive mask [N, 1, groups * q, Cd] of the rows written up to the block's end."""
        visible = key_positions[:, None, :] <= block_position_ids[:, -1:, None]  # written: [N, 1, Cd]
        if window is not None or causal:
            visible = _visible(block_position_ids, key_positions, window, causal) & visible
        else:  # every written row, for each of the block's queries
            visible = visible.expand(-1, block_position_ids.shape[1], -1)
        return grouped_bias(visible, groups, dtype), 0

    @staticmethod
    def attend(module, query, key, value, bias, scaling, **_):
        return grouped_attention(query, key, value, bias, scaling).transpose(1, 2), None

    def advance(self, context_rows: int) -> None:
        self.length.add_(self.count)


# ---------------------------------------------------------------- the batched loop

@dataclass
class _Stream:
    index: int  # the prompt's
    result: GenerationResult
    out: list[int]
    t_first: float  # when its first token was chosen
    done: bool = False


def check_batch_method(engine) -> None:
    """Refuse, in one line, what the batched round does not run: every method's own proposer runs, a custom one not."""
    if engine.custom_proposer:
        raise ConfigError("concurrency", "a custom proposer does not run batched", "use concurrency=1")


class BatchRun:
    """One `generate_many` call: the slots, their caches, the queue of prompts and the results.

    A round (`round`): its plan on the host (`plan`), then its device work (`device_round`: draft every slot's block
    in one drafter forward, `draft`; build the trees, `trees`; verify them in one target forward, `verify`; choose,
    walk and commit, `commit`), eager or as one compiled graph (`CompiledRound`, where `compiled` is given: fixed
    shapes, `fixed`), then the walk's one host read (`bt.read_walk`) and each stream's tokens. A free slot takes
    the next prompt between rounds (`join`: the prompts joining at once prefilled in one forward, a hybrid's each
    alone, then each one's keys, values and states seated in its row);
    a slot with no stream left runs along (fixed shapes) and keeps nothing."""

    def __init__(self, engine, prompts: list[torch.Tensor], concurrency: int, temperature: float,
                 max_new_tokens: int, stop_token_ids: Iterable[int] | None, seed: int, budget: int | None,
                 compiled: CompiledRound | None = None):
        check_batch_method(engine)
        # the compiled round (its graphs, kept by the engine across calls) or None: the eager one
        self.compiled = compiled
        self.fixed = compiled is not None  # fixed shapes: every row of the capacity read, the context padded
        self.engine, self.model, self.binding, self.proposer = engine, engine.target, engine.binding, engine.proposer
        self.method, self.temperature, self.max_new, self.seed = engine.method, temperature, max_new_tokens, seed
        self.auto = budget == "auto"
        if self.auto and not engine.spec.auto_budget:
            raise ConfigError("budget", f"budget=auto chooses DDTree's tree every round; method={self.method} has "
                              "none", "use method=ddtree with budget=auto, or a number")
        self.budget = None if self.auto else budget
        # the controller of budget="auto" (ddtree.engine.adaptive): the round's draft from the load; the engine's,
        # kept across its calls (the machine and the pair do not change: its calibration and estimates carry over)
        self.load = None
        if self.auto:
            if engine.load_budget is None:
                engine.load_budget = LoadBudget(AUTO_CANDIDATES, block_size=engine.proposer.block_size)
            self.load = engine.load_budget
            self.first_round = len(self.load.history)
        self.stops = set(stop_token_ids or ())
        self.prompts = prompts
        self.dev = dev = self.binding.device
        self.slots = n = max(1, min(concurrency, len(prompts)))
        self.rows = n  # the slots the call started with (`compact` drops free ones in the batch's tail)
        self.drafts = engine.spec.tree != "root"
        self.head = getattr(self.proposer, "head", None)  # mtp, eagle3: a head that drafts step by step
        self.steps = self.proposer.steps if self.head is not None else 0
        # a proposer's own trees (a DFlash2 selector's walk and pair trees): from the block's final hidden rows too
        self.hidden: torch.Tensor | None = None  # [N, L, H]: the latest draft's rows (where its `draft_hidden`)
        self.topk = self.proposer.topk if self.head is not None else 1  # > 1: the head's EAGLE-2 tree
        if self.topk > 1 and self.budget is None:
            self.budget = self.proposer.budget
        self.block = self.steps + 1 if self.head is not None else (self.proposer.block_size if self.drafts else 1)
        text = self.model.config.get_text_config()
        self.vocab = vocab = text.vocab_size
        most = max(AUTO_CANDIDATES) if self.auto else (self.budget or 1)
        block_tree = self.head is None and engine.spec.tree == "tree"  # DDTree's best-first (a head's: below)
        nodes = 1 if not self.drafts else (max(self.block, 1 + tree_size(most, self.block - 1, vocab)) if block_tree
                                           else self.block)
        if self.topk > 1:  # the head's tree: the budget best of its pool (k at depth 1, then k * k a step)
            nodes = 1 + min(self.budget, self.topk + (self.steps - 1) * self.topk ** 2)
        self.capacity = max(p.shape[1] for p in prompts) + max_new_tokens + nodes + self.block + 1
        if self.fixed:  # a bucket: calls with other prompt lengths reuse the graphs (ddtree.engine.capacity)
            self.capacity = capacity_bucket(self.capacity)
        self.windows = _windows(self.model)
        # a hybrid target (recurrent layers: Gated DeltaNet): its joining prompts prefill alone (`join`)
        self.recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin)
                             for layer in DynamicCache(config=self.model.config).layers)
        self.timer = StageTimer(dev, engine.sync_timing)
        self.kv: SlotKV | None = None
        self.dcache: SlotDrafterCache | None = None
        self.active: list[_Stream | None] = [None] * n
        self.live = torch.zeros(n, dtype=torch.long, device=dev)  # 1 where a stream holds the slot
        self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
        self.roots = torch.zeros(n, dtype=torch.long, device=dev)
        # [N, W, F]: each slot's new drafter context (the last accepted path's rows, then padding; an MTP or EAGLE-3
        # head's: [N, K, F], the path's)
        self.ctx: torch.Tensor | None = None
        self.ctx_count = torch.zeros(n, dtype=torch.long, device=dev)  # its real rows
        self.ctx_max = 0  # rows queued behind the drafter's last read (budget=auto's AR rounds), at most
        self.unread: dict[int, torch.Tensor] = {}  # slot -> its prompt's features, not yet in its drafter rows
        self.last_drafted = True  # whether the last round drafted (the first one's drafter context: the prompts)
        self.drafted_rounds = 0  # (budget=auto: which eager rounds carry the drafter ranks)
        self.last_choice: Choice | None = None  # (budget=auto: the last round's option, which its joins are charged to)
        self.want_ranks = False
        self.results: list[GenerationResult | None] = [None] * len(prompts)
        self.queue = list(range(len(prompts)))
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        self.offsets = torch.arange(self.block, device=dev)[None, :]
        if self.head is not None:  # the head's KV rows, a row per slot; each slot's rows it has not read yet
            # (a tree's step s writes its k entries at rows start + (s - 1) k ..: past the committed rows)
            self.hkv = self.head.new_kv(self.capacity + (self.steps - 1) * self.topk, n)
            self.ctx_ids = torch.zeros(n, 1, dtype=torch.long, device=dev)  # the tokens after the context's rows
            self.ctx_start = torch.zeros(n, dtype=torch.long, device=dev)  # the row of each slot's first one
        elif self.drafts:
            self.block_ids = torch.full((n, self.block), self.proposer.drafter.mask_token_id, dtype=torch.long,
                                        device=dev)
            width = len(self.binding.feature_layers) * text.hidden_size
            self.ctx = torch.zeros(n, self.block, width, dtype=self.binding.dtype, device=dev)
        self.t_call = time.perf_counter()

    # ---- streams
    def join(self, slots: list[int]) -> None:
        """The next prompts take `slots` (one each, in queue order): their prefills, then each seated in its slot's
        rows. Several prompts joining an attention target at once prefill in one forward, left-padded to the
        longest (`TargetSession.prefill_many`; up to JOIN_TOKENS padded tokens a forward); a prompt alone, or any
        prompt of a hybrid target (its recurrent layers' state would read the padding), prefills alone
        (`TargetSession.prefill`). A stream's ttft: its group's prefill and the seats before its own."""
        ids = [self.prompts[i].to(self.dev) for i in self.queue[: len(slots)]]
        for at, n, width in _groups([x.shape[1] for x in ids], alone=self.recurrent):
            group = [self.queue.pop(0) for _ in range(n)]
            t0 = time.perf_counter()
            session = TargetSession(self.model, capacity=width + 1, binding=self.binding)
            if n == 1:
                logits, feats = session.prefill(ids[at])
                logits, rows, pads = logits[None], [feats], [0]
            else:
                logits, rows, pads = session.prefill_many(ids[at: at + n], self.windows)
            if self.kv is None:
                self.kv = SlotKV(self.model, self.slots, self.capacity, session.cache)
            for r, i in enumerate(group):
                self._seat(slots[at + r], i, ids[at + r], session.cache, r, pads[r], logits[r], rows[r], t0)

    def _seat(self, slot: int, i: int, ids: torch.Tensor, cache: DynamicCache, row: int, start: int,
              logits: torch.Tensor, feats: torch.Tensor | None, t0: float) -> None:
        """Prompt i, prefilled in `cache`'s batch row `row` from row `start` on (logits [V]: after its last token,
        feats: its rows' features), takes `slot`: its keys, values and states, seed, root, the drafter's or head's
        rows, its result."""
        dev, p = self.dev, ids.shape[1]
        self.kv.seat(slot, cache, p, row, start)
        self.seeds[slot] = _stream_seed(self.seed, i)
        root = _choose(logits[None, None], self.temperature, self.seeds[slot: slot + 1],
                       torch.full((1, 1), p, device=dev))[0, 0]
        self.roots[slot] = root
        if self.head is not None:
            self._join_head(slot, ids, feats, root)
        elif self.drafts:  # the prompt's features reach the slot's drafter rows before its first drafted round
            if self.dcache is None:
                self.dcache = SlotDrafterCache.empty(self.proposer.drafter, self.slots, self.capacity, self.block)
            self.dcache.length[slot] = 0
            self.ctx_count[slot] = 0
            self.unread[slot] = feats
        now = time.perf_counter()
        r = GenerationResult(output_ids=[], method=self.method, prompt_len=p, temperature=self.temperature,
                             budget=(self.budget if self.engine.spec.reads_budget else None),
                             block_size=self.proposer.block_size)
        r.ttft_s, r.queued_s = now - t0, t0 - self.t_call
        stream = self.active[slot] = _Stream(i, r, [int(root)], now)
        self.live[slot] = 1
        if stream.out[0] in self.stops:
            r.stopped_by = "stop_token"
            self.finish(slot, now)
        elif self.max_new <= 1:
            self.finish(slot, now)

    def read_prompts(self) -> None:
        """The prompts joined since the last drafted round into their slots' drafter rows: before the next drafted
        round, so a budget=auto run of AR rounds never pays them (the rows its AR rounds queued, `ctx`, follow them).
        The prompts read at once go through the drafter in one forward over those slots' rows
        (`SlotDrafterCache.subset`), right-padded to the longest (up to JOIN_TOKENS padded rows a forward; the
        padding rows onto the buffer's last row, never read, as `draft` does)."""
        items = list(self.unread.items())
        for at, n, width in _groups([f.shape[1] for _, f in items]):
            group = items[at: at + n]
            index = torch.tensor([slot for slot, _ in group], dtype=torch.long, device=self.dev)
            count = torch.tensor([f.shape[1] for _, f in group], dtype=torch.long, device=self.dev)
            feats = torch.nn.utils.rnn.pad_sequence([f[0] for _, f in group], batch_first=True)  # [n, width, F]
            rows = torch.arange(width, device=self.dev)[None, :]
            ctx_pos = torch.where(rows < count[:, None], rows, self.capacity - 1)
            view = self.dcache.subset(index)
            view.count = count
            view.read_end = min(self.capacity, width + self.block)
            x = self.proposer.drafter.embed_block(self.embed.weight, self.block_ids[:n])
            self.proposer.drafter(x, feats, ctx_pos, count[:, None] + self.offsets, cache=view)
            self.dcache.length.index_copy_(0, index, view.length)
        self.unread.clear()

    def _join_head(self, slot: int, ids: torch.Tensor, feats: torch.Tensor, root: torch.Tensor) -> None:
        """A head's rows of the prompt (row r: the target's state at r with token r + 1), all but the last one, which
        the slot's first round reads with the others' new rows (its token: the root)."""
        p, dev = ids.shape[1], self.dev
        if p > 1:
            rows = torch.arange(p - 1, device=dev)
            visible = rows[:, None] >= torch.arange(self.capacity, device=dev)[None, :]
            self.head.step(ids[:, 1:], feats[:, : p - 1].to(self.head.dtype), rows, rows, visible,
                           self.hkv[:, slot: slot + 1])
        width = 1 if self.ctx is None else self.ctx.shape[1]
        if self.ctx is None:
            self.ctx = feats.new_zeros(self.slots, 1, feats.shape[-1])
        self.ctx[slot, 0] = feats[0, p - 1]
        self.ctx_ids[slot, 0] = root
        self.ctx_count[slot] = 1
        self.ctx_start[slot] = p - 1
        assert width >= 1

    def head_draft(self) -> torch.Tensor | tuple:
        """Each slot's new rows read by the head (one step over all of them), then `steps - 1` steps of the chain:
        the drafted tokens [N, steps] (argmax; at T > 0 keyed samples coupled to the target's); topk > 1, the
        EAGLE-2 expansion instead (`head_expand`: its pool)."""
        head, dev, cap = self.head, self.dev, self.capacity
        k = self.ctx.shape[1]
        rows = self.ctx_start[:, None] + torch.arange(k, device=dev)[None, :]  # [N, k]: positions are rows
        cols = torch.arange(cap, device=dev)[None, None, :]
        out = head.step(self.ctx_ids, self.ctx.to(head.dtype), rows, rows, cols <= rows[:, :, None], self.hkv)
        last = out.gather(1, (self.ctx_count - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[-1]))
        if self.topk > 1:
            return self.head_expand(last[:, 0])
        start = self.kv.lengths  # the root's position; token s of the chain at start + s
        picks = []
        for s in range(1, self.steps + 1):
            logits = head.logits(last).float()  # [N, 1, V]
            pos = (start + s)[:, None]
            pick = bt.keyed_choice(logits, self.temperature, self.seeds, pos) if self.temperature > 0 else (
                logits.argmax(-1))
            picks.append(pick)
            if s == self.steps:
                break
            row = (start + s - 1)[:, None]
            last = head.step(pick, last, row, row, cols <= row[:, :, None], self.hkv)
        return torch.cat(picks, dim=1)

    def head_expand(self, last: torch.Tensor) -> tuple:
        """topk > 1: every slot's EAGLE-2 expansion at once (mtp_expand with a stream dimension: row i as the one-
        stream proposer expands it), from `last` [N, H], the head's output at each root. Step s writes its k entries
        at rows start_i + (s - 1) k .. of slot i's head buffer (the one-stream proposer's rows), each query seeing
        its slot's committed rows, its ancestors' entries and its own. The tree is deterministic (the head's top-k,
        also at T > 0: the target's choices are the keyed samples). Returns the pool (mtp_tree_tensors' input)."""
        head, dev, k, kv = self.head, self.dev, self.topk, self.hkv
        start = self.kv.lengths  # [N]: each root's position = the slot's committed rows
        cols = torch.arange(kv.shape[-2], device=dev)
        committed = (cols[None, :] < start[:, None])[:, None, :]  # [N, 1, C]
        ar = torch.arange(k, device=dev)

        def step(s: int, f_tok: torch.Tensor, f_src: torch.Tensor, f_anc: torch.Tensor):
            entries = start[:, None] + (s - 1) * k + ar  # [N, k]
            vis = torch.zeros(self.slots, k, kv.shape[-2], dtype=torch.bool, device=dev)
            vis = vis.scatter_(2, torch.cat([f_anc, entries[:, :, None]], 2), True) | committed
            pos = (start + s - 1)[:, None].expand(-1, k)
            return head.step(f_tok, f_src, pos, entries, vis, kv), entries

        return mtp_expand(head, head.logits(last).float(), last, k, self.steps, step)

    def finish(self, slot: int, now: float) -> None:
        stream = self.active[slot]
        stream.result.output_ids = stream.out
        stream.result.decode_s = now - stream.t_first
        self.results[stream.index] = stream.result
        self.active[slot] = None
        self.live[slot] = 0
        self.unread.pop(slot, None)

    # ---- a round: its device work (`device_round`: one function of the slots' tensors, eager or one compiled graph
    # per plan), then the walk's one host read and the host's bookkeeping (`round`)
    def plan(self, choice: Choice | None) -> tuple:
        """The round's shape, as host constants (a compiled graph per plan): (drafted, the tree's kind: "root",
        "chain" or "tree", its budget, the drafter's context rows read)."""
        drafted = self.drafts and (choice is None or choice.drafted)
        if not drafted:
            kind = "root"
        elif self.head is not None:  # its chain, or its EAGLE-2 tree (topk > 1)
            kind = "tree" if self.topk > 1 else "chain"
        elif self.engine.spec.tree == "chain" or (choice is not None and choice.kind == "chain"):
            kind = "chain"
        else:
            kind = "tree"
        budget = (self.budget if choice is None else choice.budget) if kind == "tree" else None
        if kind == "tree" and self.head is not None:  # the budget best of the head's pool
            nodes = 1 + min(budget, self.topk + (self.steps - 1) * self.topk ** 2)
        else:
            nodes = {"root": 1, "chain": self.block}.get(kind) or 1 + tree_size(budget, self.block - 1, self.vocab)
        if nodes == 1:
            kind, budget = "root", None
        self.kv.check(nodes)
        width = 0
        if self.ctx is not None and self.head is None:
            # the rows this round may queue (an AR round of budget=auto: behind those the drafter has not read)
            self._ensure_context(self.block if drafted else self.ctx_max + 1)
            width = self.ctx.shape[1] if self.fixed else min(self.ctx.shape[1], self.ctx_max)
        return drafted, kind, budget, width

    def _ensure_context(self, need: int) -> None:
        """The drafter's context buffer [N, W, F] holds `need` rows (grown by doubling: few widths, few graphs)."""
        if need > self.ctx.shape[1]:
            grown = self.ctx.new_zeros(self.slots, max(need, 2 * self.ctx.shape[1]), self.ctx.shape[-1])
            grown[:, : self.ctx.shape[1]] = self.ctx
            self.ctx = grown

    def draft(self, width: int) -> torch.Tensor:
        """Every slot's block [root, mask, ...] through the drafter at once, after the first `width` rows of each
        slot's context (those past its count: padding, overwritten by the block or never read): logits
        [N, block - 1, V] (float32: the proposer's `head_logits`, a DFlash2 drafter's with its multiplier and soft
        cap); the rows drafting them kept in `hidden` where a selector reads them."""
        blk = self.block_ids.clone()
        blk[:, 0] = self.roots
        x = self.proposer.drafter.embed_block(self.embed.weight, blk)
        dcache = self.dcache
        dcache.count = self.ctx_count
        # eager: the attention reads the rows up to the longest stream's block (its context rows are committed
        # positions, below its target length); a compiled round's every row (fixed shapes)
        dcache.read_end = None if self.fixed else min(self.capacity, max(self.kv.length_list) + self.block)
        ctx_pos = None
        if width:
            at = torch.arange(width, device=self.dev)[None, :]
            # the padding rows (past each slot's count) onto the buffer's last row (past every block's end: never
            # read), so that the forward's rows, the block's after them, are written in one op (SlotDrafterCache)
            ctx_pos = torch.where(at < dcache.count[:, None], dcache.length[:, None] + at, self.capacity - 1)
        hidden = self.proposer.drafter(x, self.ctx[:, :width] if width else None, ctx_pos,
                                       self.kv.lengths[:, None] + self.offsets, cache=dcache)
        if self.proposer.draft_hidden:
            self.hidden = hidden[:, 1:]
        return self.proposer.head_logits(hidden[:, 1:])

    def trees(self, logits: torch.Tensor | None, kind: str, budget: int | None) -> bt.BatchTree:
        if kind == "root":
            return bt.batch_root_trees(self.roots)
        if self.head is not None and self.topk > 1:  # each row the budget best nodes of its head_expand pool: the
            # one-stream proposer's tree, node for node in its flat order (every row the same node count, no padding)
            return bt.batch_full_trees(*mtp_tree_tensors(self.roots, *logits, self.budget), depth_bound=self.steps)
        if self.head is not None:  # (head_draft chose the tokens)
            return bt.batch_chain_trees(self.roots, logits)
        chain = kind == "chain"
        # the drafted tokens' positions: a sample's keyed noise (coupled to the target's at the same positions)
        pos = self.kv.lengths[:, None] + self.offsets[:, 1:] if self.temperature > 0 else None
        if self.proposer.batch_tree is not None:  # its own (a DFlash2 selector's walk or pair trees)
            return self.proposer.batch_tree(self.roots, logits, self.hidden, None if chain else budget,
                                            self.temperature, self.seeds, pos)
        if chain:
            if self.temperature > 0:  # the drafter's sample, coupled to the target's by the same keyed noise
                return bt.batch_chain_trees(self.roots, bt.keyed_choice(logits, self.temperature, self.seeds, pos))
            return bt.batch_chain_trees(self.roots, logits.argmax(-1))
        # on a CPU one C call for every stream (the single-stream engine's build), unless the options turn the
        # `host_tree` branch off; a compiled round traces the torch ops
        host = None if host_branch("host_tree", self.dev, self.binding.options) else False
        return bt.batch_tree_of_tensors(*bt.batch_best_first_tensors(self.roots, torch.log_softmax(logits, dim=-1),
                                                                     budget, host=host))

    def verify(self, tree: bt.BatchTree) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One target forward over every slot's tree: (logits [N, T, V], features [N, T, F] or None, positions)."""
        kv = self.kv
        kv.begin(tree.width, self.fixed)
        masks = round_masks(tree, kv.lengths, kv.read_end, self.binding.dtype, self.windows.values(), kv.rows)
        # a dict where the model has sliding layers (transformers' mask mapping by layer type), else the mask
        mapping = {kind: masks[w] for kind, w in self.windows.items()} if len(self.windows) > 1 else masks[None]
        pos = kv.start + tree.depths
        hidden_ids = self.binding.hidden_ids if self.drafts else None
        kw = {"output_hidden_states": hidden_ids} if hidden_ids else {}
        lean = self.binding.lean  # the engine's lean forward where the family has one (its fused ops on CUDA)
        with _gdn_context(kv, tree):
            if lean is not None and not isinstance(mapping, dict):
                logits, kept = lean(tree.tokens, pos, mapping, kv.cache, hidden_ids)
                feats = torch.cat([kept[i] for i in hidden_ids], dim=-1) if hidden_ids else None
                return logits, feats, pos
            out = self.model(input_ids=tree.tokens, position_ids=pos, attention_mask=mapping, cache=kv.cache,
                             use_cache=True, **kw)
        feats = context_features(out.hidden_states, self.binding.feature_layers) if hidden_ids else None
        return out.logits, feats, pos

    def commit(self, tree: bt.BatchTree, logits: torch.Tensor, feats: torch.Tensor | None,
               pos: torch.Tensor, drafted: bool = True) -> tuple[torch.Tensor, ...]:
        """Choose, walk (its device part: `read_walk` reads it after), keep each live slot's accepted path, hand the
        drafter its features. The slots' state is written in place (fixed addresses: a compiled round replays on
        them). Returns batch_walk_tensors' (path, lengths, next_root, packed)."""
        choice = _choose(logits, self.temperature, self.seeds, pos + 1 if self.temperature > 0 else None)
        path, lengths, nxt, packed = bt.batch_walk_tensors(tree, choice)
        kept = lengths * self.live  # a free slot keeps nothing
        self.kv.commit(path, kept)
        if self.kv.linear:
            gdn.commit_linear_states_batch(self.kv.cache, path, kept)
        if self.drafts:
            k = path.shape[1]
            rows = feats.gather(1, path[:, :, None].expand(-1, k, feats.shape[-1]))
            if self.head is not None:  # row r: the target's state at r with token r + 1 (the path's next, the root)
                self.ctx_start = self.kv.lengths - kept
                ids = torch.cat([tree.tokens.gather(1, path[:, 1:]), nxt[:, None]], dim=1)
                self.ctx_ids = ids.scatter(1, (lengths - 1)[:, None], nxt[:, None])
                self.ctx, self.ctx_count = rows, kept
            elif drafted:  # the drafter read its rows this round: the path's replace them
                self.ctx[:, :k].copy_(rows)
                self.ctx_count.copy_(kept)
            else:  # (budget=auto's AR round) behind the rows the drafter has not read
                at = self.ctx_count[:, None] + torch.arange(k, device=self.dev)[None, :]
                self.ctx.scatter_(1, at[:, :, None].expand(-1, -1, rows.shape[-1]), rows)
                self.ctx_count.add_(kept)
        self.roots.copy_(nxt)
        return path, lengths, nxt, packed

    def device_round(self, drafted: bool, kind: str, budget: int | None, width: int) -> tuple[torch.Tensor, ...]:
        """A round's device work, no host read (`plan`'s arguments): draft, tree, verify, choose, the walk's device
        part, commit. The eager round calls it; the compiled one is this function traced, one graph per plan
        (`CompiledRound`). Returns (packed for `read_walk`, path, lengths, the drafter's ranks for budget=auto or
        None)."""
        stage = _no_stage if torch.compiler.is_compiling() else self.timer.stage
        logits = None
        if drafted:
            with stage("draft"):
                logits = self.head_draft() if self.head is not None else self.draft(width)
        with stage("tree"):
            tree = self.trees(logits, kind, budget)
        with stage("verify"):
            out, feats, pos = self.verify(tree)
        with stage("commit"):
            path, lengths, nxt, packed = self.commit(tree, out, feats, pos, drafted)
        ranks = None
        # the round's outcome for the next choice (read after the walk): in a compiled graph every drafted round's,
        # eagerly every RANK_EVERY-th drafted round's (a sample of the rounds: a dozen small ops saved a round)
        if (self.load is not None and drafted and (self.want_ranks or torch.compiler.is_compiling())
                and self.load.ranked(Choice(kind, self.block - 1 if kind == "chain" else budget))):
            ranks = target_ranks(logits, tree.tokens, path, lengths, nxt)
            smaller = self.smaller(kind, budget)
            if smaller:  # (after the ranks' L columns: each smaller tree's accepted draft tokens)
                ranks = torch.cat([ranks, smaller_tree_accepts(tree.scores, path, lengths,
                                                               [c.nodes for c in smaller])], dim=1)
        return packed, path, lengths, ranks

    def smaller(self, kind: str, budget: int | None) -> list[Choice]:
        """budget=auto: the smaller tree options a round of this kind measures as well: a DDTree round of the
        drafter's own best-first trees (nested: `smaller_tree_accepts`), not a proposer's own trees (a DFlash2
        selector's)."""
        if self.load is None or kind != "tree" or self.proposer.batch_tree is not None or self.head is not None:
            return []
        return self.load.smaller_trees(Choice("tree", budget))

    def round(self) -> None:
        live = [s is not None for s in self.active]
        streams = sum(live)
        # (budget=auto: the rows the round computes, a tail's that dropped its free slots too; whether prompts wait)
        queued = bool(self.queue)
        choice = self.load.choose(streams, self.slots, queued) if self.load is not None else None
        plan = self.plan(choice)
        drafted = plan[0]
        # a drafted round after AR rounds reads the rows and the prompts they queued: a switch's cost, not the round's
        # (budget=auto: not measured)
        switch = drafted and not self.last_drafted
        self.last_drafted = drafted
        self.want_ranks = drafted and self.drafted_rounds % RANK_EVERY == 0
        self.drafted_rounds += drafted
        if drafted and self.unread:  # the drafter prefill of the prompts that joined since its last drafted round
            # (a prefill: outside the round's stages, as a join's; budget=auto: a join's cost of the drafted option
            # after drafted rounds; after AR rounds, the prompts their joins queued: the switch's cost)
            t0 = time.perf_counter()
            self.read_prompts()
            if self.load is not None and not switch and self.last_choice is not None:  # (not the call's first fill)
                self.load.joined(choice, time.perf_counter() - t0, rows=self.rows)
        t0 = time.perf_counter()
        traced = False
        if self.compiled is not None and self.compiled.runs(self, plan):
            with self.timer.stage("verify"):  # one graph: its draft, tree and commit timed with its verification
                packed, path, lengths, ranks = self.compiled(self, plan)
            traced = self.compiled.traced  # (a round that compiled its graph: its seconds are no round's cost)
        else:
            packed, path, lengths, ranks = self.device_round(*plan)
        with self.timer.stage("commit"):  # the round's one host read (budget=auto: the drafter's ranks with it)
            if ranks is None:
                tokens, rank_rows = bt.read_walk(packed, self.slots), None
            else:
                host = torch.cat([packed.reshape(-1), ranks.reshape(-1).to(packed.dtype)]).tolist()
                tokens = bt.walk_lists(host[: packed.numel()], self.slots)
                rank_rows = np.array(host[packed.numel():]).reshape(self.slots, -1)
        smaller = self.smaller(plan[1], plan[2]) if rank_rows is not None else []
        self.kv.advance([len(t) if s else 0 for t, s in zip(tokens, live, strict=True)])
        self.ctx_max = path.shape[1] + (0 if drafted else self.ctx_max)  # rows the drafter has not read, at most
        now = time.perf_counter()
        kept, cut = [], []
        for slot, s in enumerate(self.active):
            if s is None:
                continue
            new = tokens[slot][: self.max_new - len(s.out)]  # never past max_new_tokens
            cut.append(len(new) < len(tokens[slot]))
            for j, t in enumerate(new):
                if t in self.stops:  # stop at (and including) a stop token
                    new, s.done, s.result.stopped_by = new[: j + 1], True, "stop_token"
                    cut[-1] = True
                    break
            s.out.extend(new)
            s.result.acceptance_lengths.append(len(new))
            s.result.streams = max(s.result.streams, streams)
            kept.append(len(new))
            if s.done or len(s.out) >= self.max_new:
                self.finish(slot, now)
        if self.load is not None:  # the round's outcome, for the next choice: the tokens the outputs kept
            idx = [i for i, a in enumerate(live) if a]
            rows = None if rank_rows is None else rank_rows[idx]
            width = self.block - 1  # the ranks' columns; then each smaller tree's accepted draft tokens
            # a smaller tree keeps its accepted tokens and the bonus token, no more than the output kept where it
            # was cut (a stop token, max_new_tokens)
            also = {c: [min(int(a) + 1, k) if x else int(a) + 1 for a, k, x in zip(rows[:, width + i], kept, cut,
                                                                                  strict=True)]
                    for i, c in enumerate(smaller)}
            # (0: unmeasured: a round that compiled, a switch from AR, a tail round over fewer rows than the load's)
            measured = not (traced or switch or self.slots < self.rows)
            self.load.observe(choice, streams=streams, seconds=now - t0 if measured else 0.0,
                              accepted=kept, ranks=None if rows is None else rows[:, :width], rows=self.rows,
                              others=also, queued=queued)
            self.last_choice = choice

    def compacts(self) -> bool:
        """Whether the batch's tail drops its free slots: no prompt left to take them, at most half the slots live,
        an eager round (a compiled one keeps its fixed shapes), an attention target (a hybrid's GDN states are
        committed through views made once) and a drafter that is not a head."""
        live = sum(s is not None for s in self.active)
        return (not self.queue and 0 < live <= self.slots // 2 and not self.fixed and self.kv is not None
                and not self.kv.linear and self.head is None)

    def compact(self) -> None:
        """The live slots become slots 0 … n - 1 (their order kept) and the free ones go: every slot tensor keeps
        those rows. A round computes every slot, so the tail of a batch, where streams end and nothing takes their
        slots, would otherwise pay full rows for a few streams."""
        host = [i for i, s in enumerate(self.active) if s is not None]
        keep = torch.tensor(host, dtype=torch.long, device=self.dev)
        self.kv.compact(keep, host)
        if self.dcache is not None:
            self.dcache.compact(keep)
        for name in ("live", "seeds", "roots", "ctx", "ctx_count", "block_ids"):
            value = getattr(self, name, None)
            if value is not None:
                setattr(self, name, value.index_select(0, keep))
        self.unread = {host.index(i): f for i, f in self.unread.items() if i in host}
        self.active = [self.active[i] for i in host]
        self.slots = len(host)

    def run(self) -> list[GenerationResult]:
        with torch.inference_mode():
            while self.queue or any(s is not None for s in self.active):
                # free slots take the next prompts (their prefills: between rounds; again where one ends at once)
                t0, waiting = time.perf_counter(), len(self.queue)
                while self.queue and (free := [i for i, s in enumerate(self.active) if s is None]):
                    self.join(free[: len(self.queue)])
                if len(self.queue) < waiting and self.last_choice is not None and self.load is not None:
                    # (budget=auto: charged to the round whose streams freed the slots; the call's first joins fill
                    # its empty slots: nobody's)
                    self.load.joined(self.last_choice, time.perf_counter() - t0, rows=self.rows)
                if self.compacts():
                    self.compact()
                if any(s is not None for s in self.active):
                    self.round()
        stages = self.timer.finish()
        load = self.load.summary(since=self.first_round) if self.load is not None else None
        for r in self.results:
            r.stage_seconds = dict(stages)  # the rounds' stages, shared by the streams that took part
            r.load_budget = load
        return self.results


def generate_many(engine, prompts: Sequence[torch.Tensor], concurrency: int, temperature: float,
                  max_new_tokens: int, stop_token_ids: Iterable[int] | None, seed: int,
                  budget: int | None, compiled: CompiledRound | None = None) -> list[GenerationResult]:
    """Engine.generate_many's body (see there): one BatchRun (its rounds compiled where `compiled` is given)."""
    return BatchRun(engine, list(prompts), concurrency, temperature, max_new_tokens, stop_token_ids, seed,
                    budget, compiled).run()


# ---------------------------------------------------------------- the compiled round

def why_not_compiled(engine) -> str | None:
    """Why the batched round cannot run compiled for this engine, in words; None where it can."""
    if getattr(engine.proposer, "head", None) is not None:
        return (f"method={engine.method}'s head drafts its chain or tree step by step: its batched round is not compiled "
                "yet")
    return None


class CompiledRound:
    """The batched round's device work (`BatchRun.device_round`) as fixed-shape graphs:
    torch.compile(fullgraph=True, dynamic=False), on CUDA with mode="reduce-overhead" (CUDA graphs). A graph per
    plan (the round's drafted or not, tree kind and budget, the drafter's context width: budget="auto" compiles a
    choice on its first use) and per slot shapes (N, the capacity bucket); the engine keeps it across
    generate_many calls. The slots' state (keys and values, lengths, the drafter's cache and context, the GDN
    states, roots) is written in place at static addresses (`pin`). Joins (prefill, seating) run eagerly, and the
    walk's host read (`read_walk`) follows the graph."""

    def __init__(self, device: torch.device, backend: str | None = None):
        opts: dict = {"fullgraph": True, "dynamic": False}
        if _TAKES_RECOMPILE_LIMIT:
            opts["recompile_limit"] = RECOMPILE_LIMIT
        if backend is not None:
            opts["backend"] = backend
        elif device.type == "cuda":
            opts["mode"] = "reduce-overhead"  # CUDA graphs: one launch a graph
        self.limit = None if _TAKES_RECOMPILE_LIMIT else RECOMPILE_LIMIT
        self.cudagraphs = opts.get("mode") == "reduce-overhead"
        self.graph = torch.compile(_device_round, **opts)
        self.traced = False  # whether the last call compiled a graph

    def runs(self, run: BatchRun, plan: tuple) -> bool:
        """Whether this round runs compiled (a drafting head's rounds do not: `why_not_compiled`)."""
        return run.head is None

    def pin(self, run: BatchRun) -> None:
        """The slots' persistent tensors at static addresses (CUDA graphs replay on them, mutating them in place)."""
        kv, tensors = run.kv, [run.live, run.seeds, run.roots, run.ctx_count]
        tensors += [*kv.keys, *kv.values, kv.lengths, kv.slot_col]
        if run.ctx is not None:
            tensors.append(run.ctx)
        if run.dcache is not None:
            tensors += [*run.dcache.keys, *run.dcache.values, run.dcache.length]
        for i in kv.linear:  # the GDN layers' states (per state index), and their stacked form where adopted
            layer = kv.cache.layers[i]
            for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
                found = states.values() if isinstance(states, dict) else states if isinstance(states, list) else ()
                tensors += [t for t in found if isinstance(t, torch.Tensor)]
        stacked = kv.cache.__dict__.get(gdn.commit._STATES_ATTR)  # (conv_all, rec_all, ...)
        if stacked is not None:
            tensors += [t for t in stacked[1:3] if isinstance(t, torch.Tensor)]
        for t in tensors:  # (an attribute on the tensor: idempotent, microseconds)
            torch._dynamo.mark_static_address(t)

    def __call__(self, run: BatchRun, plan: tuple) -> tuple:
        """The round's graph call; `traced` tells whether this call compiled a graph (its seconds are not a round's)."""
        self.pin(run)
        graphs = counters["stats"]["unique_graphs"]
        out = self._run(self.graph, run, *plan)
        self.traced = counters["stats"]["unique_graphs"] != graphs
        return out

    def _run(self, graph, *args):
        """One call of the compiled graph (the seam ddtree.testing.dispatch counts graph calls at), as
        ddtree.engine.compiled.StaticRound._run makes it: the recompile limit, outputs out of the CUDA graph pool."""
        if self.limit is None:
            out = graph(*args)
        else:  # (torch 2.11: the limit for this call only)
            with torch._dynamo.config.patch(recompile_limit=self.limit):
                out = graph(*args)
        if self.cudagraphs:  # the next replay reuses the pool
            out = _owned(out)
        return out


def _device_round(run: BatchRun, drafted: bool, kind: str, budget: int | None, width: int) -> tuple:
    """What CompiledRound traces: the round's device work, as the eager round runs it."""
    return run.device_round(drafted, kind, budget, width)


def _windows(model) -> dict[str, int | None]:
    """The attention-mask kinds the model's layers ask for (transformers' layer_types), and each one's window."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    out = {"full_attention": None}
    if "sliding_attention" in kinds:
        out["sliding_attention"] = window
    return out


def _gdn_context(kv: SlotKV, tree: bt.BatchTree):
    if not kv.linear:
        return contextlib.nullcontext()
    # (flex attention: not for a BatchTree, which passes its own mask; stated, so a compiled round reads no option)
    return verification.tree_verification(tree, flex_compile=False)


def _no_stage(name: str):
    """A compiled round's stages: one graph, timed as a whole (as "verify": BatchRun.round)."""
    return contextlib.nullcontext()


def _groups(lengths: list[int], alone: bool = False) -> list[tuple[int, int, int]]:
    """Consecutive prompts (their `lengths`) grouped for one padded forward each: (first, count, longest), each
    group as long as count x longest stays within JOIN_TOKENS (alone: one prompt a group)."""
    out, at = [], 0
    while at < len(lengths):
        n, width = 1, lengths[at]
        while (not alone and at + n < len(lengths)
               and (n + 1) * max(width, lengths[at + n]) <= JOIN_TOKENS):
            width = max(width, lengths[at + n])
            n += 1
        out.append((at, n, width))
        at += n
    return out


def _stream_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFFFFFF


def _choose(logits: torch.Tensor, temperature: float, seeds: torch.Tensor, positions: torch.Tensor | None):
    """The target's token after each row of `logits` [N, T, V]: argmax at T = 0, else the keyed sample of stream
    seeds[i] at the chosen token's absolute position (ddtree.engine.batch_tree.keyed_choice; None at T = 0)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return bt.keyed_choice(logits, temperature, seeds, positions)
