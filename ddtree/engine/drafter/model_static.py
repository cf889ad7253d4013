"""The DFlash drafter's static form: its forward as one fixed-shape graph a round (ddtree.engine.compiled's round
attaches it where a proposer declares it: `static_form`)."""

from __future__ import annotations

import torch

from ddtree.engine.compiled import StaticRound, _kv_buffers, capacity_bucket, grouped_attention, grouped_bias
from ddtree.engine.forward import RopeTables


class StaticDraft:
    """The DFlash drafter's forward as one fixed-shape graph (`_draft`), from a generation's second round on.

    The first round runs the eager forward (the prompt's features: any length), whose cache `load` copies into fixed
    buffers: keys and values of every drafter layer [layers, 2, 1, Hkv, Cd, d] (row r holds position r, as in
    `DrafterCache`; one buffer each per layer: `_kv_buffers`) and the context length [1] on the device. Each later round, the target's commit graph leaves the
    accepted path's features in `context` [1, P, F] (P = min(N, block): padded) and its length in `count`; the graph
    writes the P context rows at length .. length + P - 1, then the block's rows right behind the real ones (at
    length + count: they overwrite the padding), attends over all Cd rows under a mask (rows before the block's end,
    the causal and window rules of each layer; `grouped_attention`), and returns the block's logits [block - 1, V]
    (float32; the proposer's `head_logits`). Each layer runs as its class lays it out (`around`, with this graph's
    attention): a DFlash2 layer's convolutions run inside the graph (ddtree.engine.drafter.dflash2).
    """

    def __init__(self, static: StaticRound, proposer):
        self.static, self.proposer = static, proposer
        self.drafter, self.embed, self.lm_head = proposer.drafter, proposer.embed, proposer.lm_head
        self.q = proposer.block_size
        self.hidden = proposer.draft_hidden  # the graph returns the block's final hidden rows too (a DFlash2 selector)
        self.graph = torch.compile(self._draft, **static.options)
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None
        self.length = self.context = self.count = self.mask_ids = None
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
        k0 = cache.keys[0]
        capacity = capacity_bucket(needed + 2 * self.q)
        if self.keys is None or self.keys[0].shape[-2] != capacity or self.keys[0].dtype != k0.dtype:  # (its bucket: grows, shrinks)
            self.keys = self.values = None
            self.keys, self.values = _kv_buffers(len(cache.keys), k0, capacity)
            self.length = torch.zeros(1, dtype=torch.long, device=k0.device)
            self.mask_ids = torch.full((self.q - 1,), self.drafter.mask_token_id, dtype=torch.long, device=k0.device)
            for t in (self.length, self.mask_ids):
                torch._dynamo.mark_static_address(t)
        rows = cache.length
        for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            self.keys[i][..., :rows, :].copy_(k[..., :rows, :])
            self.values[i][..., :rows, :].copy_(v[..., :rows, :])
        self.length.fill_(rows)
        self.ready = True

    def logits(self, root: torch.Tensor):
        """The block's logits [block - 1, V] after `root` (the round's drafter forward: one graph call); with
        `hidden` (the proposer's `draft_hidden`), (logits, the final hidden rows drafting them [block - 1, H])."""
        return self.static._run(self.graph, root, self.context, self.count, self.length, self.keys, self.values,
                                self.mask_ids)

    def _draft(self, root: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor, length: torch.Tensor,
               k_bufs: list, v_bufs: list, mask_ids: torch.Tensor) -> torch.Tensor:
        drafter, q = self.drafter, self.q
        dev = ctx.device
        rows_ctx = ctx.shape[1]
        start = length + count  # the root's position: the block follows the real context rows
        ids = torch.cat([root.reshape(1).to(mask_ids.dtype), mask_ids]).view(1, q)
        x = drafter.embed_block(self.embed.weight, ids)
        context = drafter.hidden_norm(drafter.fc(ctx))
        ctx_rows = length + torch.arange(rows_ctx, device=dev)
        block_rows = start + torch.arange(q, device=dev)
        cos, sin = drafter.rotary_emb(x, torch.cat([ctx_rows, block_rows]).view(1, -1))
        rope = drafter._rope.tables(cos, sin, drafter.config.head_dim)  # built in the graph (RopeTables)
        block_rope = (rope[0][:, :, -q:], rope[1][:, :, -q:], rope[2])
        key_pos = torch.arange(k_bufs[0].shape[-2], device=dev)
        delta = block_rows[:, None] - key_pos[None, :]  # [q, Cd]: query position - key position (row)
        written = (key_pos < start + q)[None, :]
        masks: dict[int | None, torch.Tensor] = {}  # visible [q, Cd] per window
        biases: dict[tuple, torch.Tensor] = {}  # grouped_bias per (window, groups)
        declared = drafter.config.is_causal
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            window = attn.sliding_window
            if window not in masks:
                visible = written & (delta >= 0) if (declared if declared is not None else window is not None) else written
                if window is not None:
                    visible = visible & (delta.abs() < window)
                masks[window] = visible.expand(q, -1)

            def attention(h, attn=attn, window=window, k_buf=k_bufs[i], v_buf=v_bufs[i]):
                queries = attn.q_norm(attn.q_proj(h).view(1, q, -1, attn.head_dim)).transpose(1, 2)
                queries = RopeTables.apply(queries, block_rope)
                fresh = torch.cat([context, h], dim=1)
                n = fresh.shape[1]
                keys = RopeTables.apply(attn.k_norm(attn.k_proj(fresh).view(1, n, -1, attn.head_dim)).transpose(1, 2),
                                        rope)
                values = attn.v_proj(fresh).view(1, n, -1, attn.head_dim).transpose(1, 2)
                for buf, new in ((k_buf, keys), (v_buf, values)):
                    new = new.to(buf.dtype)
                    buf.index_copy_(-2, ctx_rows, new[..., :rows_ctx, :])
                    buf.index_copy_(-2, block_rows, new[..., rows_ctx:, :])
                groups = queries.shape[1] // k_buf.shape[1]
                if (window, groups) not in biases:
                    biases[window, groups] = grouped_bias(masks[window], groups, queries.dtype)
                # not the drafter's own attention function (`_attend`): the model's sdpa path expands K/V per query
                # head (a copy of every cached row, each layer) where the grouped call reads them once
                out = grouped_attention(queries, k_buf, v_buf, biases[window, groups], attn.scaling).transpose(1, 2)
                return attn.o_proj(out.reshape(1, q, -1))

            x = layer.around(x, attention)  # the layer's own structure (a DFlash2 layer: its convolutions too)
        length.add_(count)
        hidden = drafter.norm(x)[0, 1:]
        logits = self.proposer.head_logits(hidden)  # float32 (a DFlash2 drafter: its multiplier and soft cap)
        return (logits, hidden) if self.hidden else logits
