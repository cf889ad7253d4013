"""The DFlash drafter's static form: its forward as one fixed-shape graph a round (ddtree.engine.compiled's round
attaches it where a proposer declares it: `static_form`)."""

from __future__ import annotations

import torch

from ddtree.engine.compiled import StaticRound, capacity_bucket
from ddtree.engine.drafter.model import FixedDrafterCache


class StaticDraft:
    """The DFlash drafter's forward as one fixed-shape graph (`_draft`), from a generation's second round on.

    The first round runs the eager forward (the prompt's features: any length), whose cache `load` copies into a
    FixedDrafterCache (ddtree.engine.drafter.model): fixed buffers of every drafter layer's keys and values (row r
    holds position r, as in `DrafterCache`) and the context length [1] on the device. Each later round, the target's
    commit graph leaves the accepted path's features in `context` [1, P, F] (P = min(N, block): padded) and its length
    in `count`; the graph runs the drafter's own forward (`DFlashDrafter.forward`: its attention, mask, RoPE and
    cache writes, a DFlash2 layer's convolutions) over that cache with the P context rows at length .. length + P - 1
    and the block right behind the real ones (at length + count: over the padding), and returns the block's logits
    [block - 1, V] (float32; the proposer's `head_logits`).
    """

    def __init__(self, static: StaticRound, proposer):
        self.static, self.proposer = static, proposer
        self.drafter, self.embed, self.lm_head = proposer.drafter, proposer.embed, proposer.lm_head
        self.q = proposer.block_size
        self.hidden = proposer.draft_hidden  # the graph returns the block's final hidden rows too (a DFlash2 selector)
        self.graph = torch.compile(self._draft, **static.options)
        self.fixed: FixedDrafterCache | None = None  # the drafter's cache: fixed buffers, its length on the device
        self.context = self.count = self.mask_ids = None
        self.ready = False  # the eager first round has been loaded this generation

    @staticmethod
    def why_not(static: StaticRound, proposer) -> str | None:
        """Why the proposer's drafter cannot draft as this graph, in words; None where it can."""
        drafter = proposer.drafter
        if drafter.attn_implementation not in ("eager", "sdpa"):
            return f"the drafter's attention is {drafter.attn_implementation}"
        if drafter.device != static.device:
            return "the drafter is on another device"
        return None

    def reset(self) -> None:
        self.ready = False

    def commit_io(self, n: int, feats: torch.Tensor, tokens: torch.Tensor) -> tuple:
        """The commit graph's extra arguments: the features and the buffers that receive the path's."""
        return (feats, *self.context_for(n))

    def context_for(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(context [1, P, F], count [1]) buffers for a tree of n nodes (P = min(n, block size))."""
        rows = min(n, self.q)
        if self.context is None or self.context.shape[1] != rows:
            return self._context_buffers(rows)
        return self.context, self.count

    def _context_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = len(self.drafter.target_layer_ids) * self.drafter.config.hidden_size
        dev = self.drafter.device
        with torch.inference_mode():
            self.context = torch.zeros(1, rows, width, dtype=self.drafter.dtype, device=dev)
            self.count = torch.ones(1, dtype=torch.long, device=dev)
        for t in (self.context, self.count):
            torch._dynamo.mark_static_address(t)
        return self.context, self.count

    @torch.inference_mode()
    def load(self, cache, needed: int) -> None:
        """After the eager first round: its cache (`cache.length` context rows) into the fixed buffers."""
        capacity = capacity_bucket(needed + 2 * self.q)
        if self.fixed is None or not self.fixed.fits(cache, capacity):  # (its bucket: grows, shrinks)
            self.fixed = None
            self.fixed = FixedDrafterCache.like(cache, capacity)
            self.mask_ids = torch.full((self.q - 1,), self.drafter.mask_token_id, dtype=torch.long,
                                       device=self.fixed.length.device)
            torch._dynamo.mark_static_address(self.mask_ids)
        self.fixed.load(cache)
        self.ready = True

    @property
    def keys(self) -> list[torch.Tensor] | None:
        return None if self.fixed is None else self.fixed.keys

    def logits(self, root: torch.Tensor):
        """The block's logits [block - 1, V] after `root` (the round's drafter forward: one graph call); with
        `hidden` (the proposer's `draft_hidden`), (logits, the final hidden rows drafting them [block - 1, H])."""
        fixed = self.fixed
        return self.static._run(self.graph, root, self.context, self.count, fixed.length, fixed.keys, fixed.values,
                                self.mask_ids)

    def _draft(self, root: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor, length: torch.Tensor,
               k_bufs: list, v_bufs: list, mask_ids: torch.Tensor) -> torch.Tensor:
        drafter, q = self.drafter, self.q
        dev = ctx.device
        ids = torch.cat([root.reshape(1).to(mask_ids.dtype), mask_ids]).view(1, q)
        x = drafter.embed_block(self.embed.weight, ids)
        ctx_rows = length + torch.arange(ctx.shape[1], device=dev)  # the context at its rows (padding included),
        block_rows = length + count + torch.arange(q, device=dev)  # the block right behind the real ones
        hidden = drafter(x, ctx, ctx_rows.view(1, -1), block_rows.view(1, -1),
                         FixedDrafterCache(k_bufs, v_bufs, length, count, q))[0, 1:]
        logits = self.proposer.head_logits(hidden)  # float32 (a DFlash2 drafter: its multiplier and soft cap)
        return (logits, hidden) if self.hidden else logits
