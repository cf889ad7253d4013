"""method=mtp's head in its static form: its context read and its chain or tree drafting as one fixed-shape graph
a round (ddtree.engine.compiled's round attaches it where a proposer declares it: `static_form`)."""

from __future__ import annotations

import torch

from ddtree.engine.compiled import StaticRound
from ddtree.engine.drafter.mtp import mtp_expand, mtp_tree_tensors
from ddtree.engine.tree import _ancestor_index, _ancestor_matrix, chain_tensors


class StaticMTP:
    """method=mtp's head (ddtree.engine.drafter.mtp.MTPHead) as one fixed-shape graph a round (`_draft`): it reads
    the tokens committed since the last round, then drafts the chain (greedy) or the EAGLE tree (mtp_expand, the
    eager proposer's code), from a generation's second round on. Each step is the head's own `step` (the eager
    proposer's), traced (`traced_step`), where the head says it can be (`why_not_traced`); method=eagle3 runs this
    round over its drafter's.

    The first round runs the eager proposer (the prompt: any length) on the head's fixed KV buffer, which `load`
    takes over: keys and values [2, 1, Hkv, Cd, d], row r holding position r of the committed context, and the
    context length [1] on the device. Each later round the target's commit graph leaves the accepted path's
    features in `context` [1, P, H] (P = min(N, steps + 1): padded), its tokens in `path_tokens` [P] and its length
    in `count`; the graph reads row i of the path with the token after it (the next path token, the new root after
    the last), writing rows length .. length + P - 1 (causal: padding rows are never seen by real ones), then the
    drafts behind the real rows, where the eager proposer puts them (chain step s at row start + s - 1; tree step
    s's k entries at start + (s - 1) k ..), each query attending over all Cd rows under a mask (the committed rows,
    its ancestors' entries and its own). Rows past the committed ones are never read before being written again:
    no crop. The chain at T > 0 samples with the generation's generator: it stays eager (its verification compiled).
    """

    def __init__(self, static: StaticRound, proposer):
        self.static, self.proposer, self.head = static, proposer, proposer.head
        self.steps, self.k, self.budget = proposer.steps, proposer.topk, proposer.budget
        self._step = self.head.traced_step()
        self.graph = torch.compile(self._draft, **static.options)
        self.kv: torch.Tensor | None = None
        self.length = self.context = self.count = self.path_tokens = None
        self.ready = False

    @staticmethod
    def why_not(static: StaticRound, proposer) -> str | None:
        return proposer.head.why_not_traced(static.device)

    def reset(self) -> None:
        self.ready = False

    def commit_io(self, n: int, feats: torch.Tensor, tokens: torch.Tensor) -> tuple:
        """The commit graph's extra arguments: the features, the tree's tokens and the buffers receiving the path's."""
        rows = min(n, self.steps + 1)  # a path is at most steps + 1 nodes deep
        if self.context is None or self.context.shape[1] != rows:
            dev = self.head.fc.weight.device
            with torch.inference_mode():
                self.context = torch.zeros(1, rows, feats.shape[-1], dtype=feats.dtype, device=dev)
                self.path_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
                self.count = torch.ones(1, dtype=torch.long, device=dev)
            for t in (self.context, self.path_tokens, self.count):
                torch._dynamo.mark_static_address(t)
        return feats, self.context, self.count, tokens, self.path_tokens

    @torch.inference_mode()
    def load(self, kv: torch.Tensor, rows: int) -> None:
        """After the eager first round: the proposer's KV buffer (`new_kv`: sized for the generation's capacity
        bucket, kept across generations) and its `rows` committed rows, taken over (no copy)."""
        if self.kv is not kv:
            self.kv = kv
            torch._dynamo.mark_static_address(kv)
        if self.length is None or self.length.device != kv.device:
            self.length = torch.zeros(1, dtype=torch.long, device=kv.device)
            torch._dynamo.mark_static_address(self.length)
        self.length.fill_(rows)
        self.ready = True

    def draft(self, root: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The round's draft tree after `root`, root first (one graph call): the chain's (tokens, parents, depths,
        ancestor matrix), or the tree's (tokens, parents, depths, scores, ancestor index, ancestor matrix)."""
        return self.static._run(self.graph, root, self.context, self.count, self.path_tokens, self.length, self.kv)

    def _draft(self, root: torch.Tensor, ctx: torch.Tensor, count: torch.Tensor, path_tokens: torch.Tensor,
               length: torch.Tensor, kv: torch.Tensor):
        head = self.head
        dev = ctx.device
        p = ctx.shape[1]
        ar = torch.arange(p, device=dev)
        # row i of the path reads the token after it: the next path token, the new root after the last one
        ids = torch.where(ar == count - 1, root.reshape(1).to(path_tokens.dtype), path_tokens.roll(-1))
        rows = length + ar
        key_pos = torch.arange(kv.shape[-2], device=dev)
        out = self._step(ids.view(1, p), ctx.to(head.dtype), rows, rows, key_pos[None, :] <= rows[:, None], kv)
        start = length + count  # the root's position: the drafts follow the committed rows
        hidden = out[0].index_select(0, count - 1)  # [1, H]: the root's row
        logits = head.logits(hidden[0]).float()
        length.add_(count)
        committed = key_pos < start  # [Cd]
        if self.k == 1:  # the chain (greedy): token s sits at start + s, the head reads it one before
            toks = [logits.argmax(-1).view(1)]
            for s in range(1, self.steps):
                here = start + s - 1
                hidden = self._step(toks[-1].view(1, 1), hidden.view(1, 1, -1), here, here,
                                    (key_pos <= here)[None], kv)[0]
                toks.append(head.logits(hidden[0]).float().argmax(-1).view(1))
            return chain_tensors(root, torch.cat(toks))  # chain_tree's, with its ancestor matrix
        k = self.k

        def step(s: int, f_tok: torch.Tensor, f_src: torch.Tensor, f_anc: torch.Tensor):
            entries = start + (s - 1) * k + torch.arange(k, device=dev)  # where the eager head's cache puts them
            vis = torch.zeros(k, kv.shape[-2], dtype=torch.bool, device=dev)
            vis.scatter_(1, torch.cat([f_anc, entries[:, None]], 1), True)
            vis = vis | committed[None, :]
            here = (start + s - 1).expand(k)
            return self._step(f_tok[None], f_src[None], here, entries, vis, kv)[0], entries

        pool = mtp_expand(head, logits, hidden[0], k, self.steps, step)
        tokens, parents, depths, scores = mtp_tree_tensors(root, *pool, self.budget)
        aidx = _ancestor_index(parents, self.steps)
        return tokens, parents, depths, scores, aidx, _ancestor_matrix(aidx)
