"""The proposers: what each method drafts in a round (AR the root alone, DFlash a chain, DDTree a
best-first tree, MTP the target's own head as a chain or an EAGLE-style tree), and the per-round state they share
with the generate loop (its stage timer: ddtree.engine.timing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ddtree.engine.capacity import capacity_bucket
from ddtree.engine.checks import check_block_size, check_budget, check_mtp_args
from ddtree.engine.drafter.model_static import StaticDraft
from ddtree.engine.drafter.mtp import MTPHead, mtp_expand, mtp_tree_tensors
from ddtree.engine.drafter.mtp_static import StaticMTP
from ddtree.engine.host import host_branch
from ddtree.engine.options import EngineOptions
from ddtree.engine.timing import StageTimer
from ddtree.engine.tree import DraftTree, best_first_tree, chain_tree, root_tree, tree_of_tensors
from ddtree.errors import ConfigError


@dataclass
class DecodeState:
    """What a proposer sees at the start of a round."""

    root: torch.Tensor  # scalar long: the last committed token, not yet seen by the target
    start: int  # position of the root = committed length seen by the target
    prompt_len: int
    generated: list[int]  # new tokens committed so far (root included)
    new_context: torch.Tensor | None  # [1, c, F] target features of tokens committed since the last round
    temperature: float
    generator: torch.Generator | None
    timer: StageTimer = field(repr=False, default=None)
    input_ids: torch.Tensor | None = None  # [1, P] the prompt (a proposer reading every committed token needs it)
    path: torch.Tensor | None = None  # the last round's accepted path (flat indices into its tree, root first)


class Proposer:
    """What a method drafts each round (`propose`), and everything the generate loop (ddtree.engine.loop) and the
    compiled round (ddtree.engine.compiled) read from a proposer: each is declared here with a default (a proposer
    that reads no target features, drafts the root alone, records no diagnosis and has no compiled form); a proposer
    subclasses this and overrides what it does. Nothing reads a proposer by probing for attributes.

    feature_layers: decoder layer indices whose hidden states it reads at every committed token
      (DecodeState.new_context), or None. block_size: its drafter's block (None: no block; reported in the result).
    max_nodes: the most nodes a tree it proposes holds, root included (the caches are sized for prompt + new tokens +
      max_nodes + 1 rows once per generation).
    compilable: its trees keep one node count per engine (the compiled round's graphs are per shape; compile=true
      refuses a proposer that does not declare it).
    diagnoses: it sets `last_logits` ([L, V], its per-position logits) every round, which the per-round diagnosis
      (ddtree.engine.diagnostics) records.
    best_first: its tree is the best-first tree over `last_logits` with `budget` nodes: under compile it builds it with
      the compiled round's graph, `tree_tensors` (root, logits, budget) -> best_first_tensors' outputs.
    static_form: the compiled form of its drafter the compiled round attaches under compile, as `static_draft`:
      a class next to its drafter's model (ddtree.engine.drafter.model_static.StaticDraft of its `drafter`,
      ddtree.engine.drafter.mtp_static.StaticMTP of its `head`) or None (it drafts eagerly).
    tree_graph: a tree build of its own (not best_first's) as a function of tensors to tensors (fixed shapes, no host
      read; e.g. a DFlash2 selector's walk, ddtree.engine.selector): under compile the round compiles it as one graph
      and hands it back as `tree_tensors` (same arguments); None: none.
    batch_tree: the batched round's trees (ddtree.engine.batch) built its own way, as a function (roots [N],
      logits [N, L, V], hidden [N, L, H] the block's final rows, budget (None: the chain), temperature, seeds [N],
      positions [N, L] the drafted tokens' own at T > 0, else None) -> ddtree.engine.batch_tree.BatchTree, every
      stream's in the same ops (e.g. a DFlash2 selector's walk and pair trees, ddtree.engine.selector); None: the
      round's own (the logits' chain, or best-first trees over them).
    """

    feature_layers: list[int] | None = None
    block_size: int | None = None
    max_nodes: int = 1
    compilable: bool = False
    diagnoses: bool = False
    last_logits: torch.Tensor | None = None
    best_first: bool = False
    static_form: type | None = None
    tree_graph = None
    batch_tree = None
    tree_tensors = None  # set by the compiled round where `best_first` or `tree_graph`
    static_draft = None  # set by the compiled round where `static_form`
    last_top1: torch.Tensor | None = None  # per node of the latest tree: is it its parent's best child (diagnosis;
    # None: the drafter's top-1 at its position, as marginal scores rank it)
    record_scores = "marginal"  # what `record_logits` rows score: "marginal" (per position) or "pair" (a DFlash2
    # selector's, given the previous token of the target's path)

    @property
    def needs_features(self) -> bool:
        return bool(self.feature_layers)

    def reset(self, capacity: int) -> None:
        """A new generation of up to `capacity` rows (prompt + new tokens + max_nodes + 1)."""

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError

    def record_logits(self, tree: DraftTree, path: torch.Tensor, accepted: int) -> torch.Tensor | None:
        """The rows the diagnosis records for the latest round ([L, V], row d drafting depth d + 1), given its accepted
        path (flat indices on the device) and depth: `last_logits`, the per-position scores the tree was ranked by."""
        return self.last_logits


class ARProposer(Proposer):
    compilable = True

    def propose(self, state: DecodeState) -> DraftTree:
        return root_tree(state.root)


class DrafterBlock(Proposer):
    """Runs the DFlash drafter on [root, mask, …] and returns per-position logits [block_size - 1, V]."""

    compilable = True
    diagnoses = True
    static_form = StaticDraft
    draft_hidden = False  # its rounds read `last_hidden` (the block's final hidden rows): the compiled forward's too

    def __init__(self, target: PreTrainedModel, drafter, block_size: int | None = None):
        self.target, self.drafter = target, drafter
        self.block_size = block_size or drafter.block_size
        check_block_size(self.block_size)  # the drafter's own, when no block size is passed
        self.feature_layers = drafter.target_layer_ids
        self.max_nodes = self.block_size  # the root and a chain of block_size - 1
        self.embed = target.get_input_embeddings()  # its weight's rows: the drafter's `embed_block`
        self.lm_head = target.get_output_embeddings()
        self.cache = None
        self.ctx_len = 0
        self.last_logits: torch.Tensor | None = None  # the latest round's [L, V] (ddtree.engine.diagnostics reads it)
        # static_draft: the compiled drafter forward (ddtree.engine.drafter.model_static.StaticDraft), set by an Engine with compile
        # on: it takes over from the second round of a generation (the first reads the prompt's features eagerly)
        self._capacity = 0

    def reset(self, capacity: int) -> None:
        """A new generation; capacity: prompt + new tokens + one block (sizes the drafter cache once)."""
        self.cache = self.drafter.new_cache(capacity)
        self.ctx_len = 0
        self._capacity = capacity
        self._block = None  # [root, mask, …] ids and their position offsets, built once per generation
        if self.static_draft is not None:
            self.static_draft.reset()

    def _block_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([root, mask, …] ids [1, block], position offsets [1, block], the index [0]), built once per generation."""
        if self._block is None or self._block[0].device != device:
            ids = torch.full((1, self.block_size), self.drafter.mask_token_id, dtype=torch.long, device=device)
            self._block = (ids, torch.arange(self.block_size, device=device).unsqueeze(0),
                           torch.zeros(1, dtype=torch.long, device=device))
        return self._block

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's float32 logits of its final hidden states (DFlash: the target's head)."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def draft_logits(self, state: DecodeState) -> torch.Tensor:
        static = self.static_draft
        if static is not None and static.ready:  # the context arrived through the target's commit graph
            self.ctx_len = state.start
            out = static.logits(state.root)
            if self.draft_hidden:
                out, self.last_hidden = out
            self.last_logits = out
            return out
        dev = state.root.device
        ctx = state.new_context
        c = 0 if ctx is None else ctx.shape[1]
        assert self.ctx_len + c == state.start, "drafter context must cover every committed token"
        block, offsets, first = self._block_inputs(dev)
        root = state.root
        block.index_fill_(1, first, root if root.dim() == 0 else root.reshape(()))  # the mask ids behind never change
        ctx_pos = offsets[:, :c] + self.ctx_len if c <= self.block_size else (
            torch.arange(self.ctx_len, self.ctx_len + c, device=dev).unsqueeze(0))
        x = self.drafter.embed_block(self.embed.weight, block)
        hidden = self.drafter(x, ctx, ctx_pos, offsets + state.start, cache=self.cache)
        self.ctx_len += c
        # .to(dev): under a device map lm_head returns on its own device, the tree is built on the root's
        self.last_hidden = hidden[0, 1:]  # the rows drafting positions 1.. (a DFlash2 selector reads them)
        logits = self.head_logits(self.last_hidden)
        self.last_logits = logits if logits.device == dev else logits.to(dev)
        if static is not None:
            static.load(self.cache, self._capacity)
        return self.last_logits


def sample_rows(logits: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, draft probabilities) of a chain's rows `logits` [..., V]: the argmax and None at T = 0, else one sample
    of each row's softmax(logits / T) and those softmax rows (what the loop verifies the chain against by rejection:
    ddtree.engine.tree.rejection_walk)."""
    if state.temperature <= 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits / state.temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=state.generator).reshape(
        probs.shape[:-1]), probs


class DFlashProposer(DrafterBlock):
    """A chain of the drafter's choices (argmax at T = 0; at T > 0 a sample, verified by rejection against its row)."""

    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            logits = self.draft_logits(state)
        with state.timer.stage("tree"):
            return chain_tree(state.root, *sample_rows(logits, state))


class DDTreeProposer(DrafterBlock):
    """The best-first `budget` prefixes under the drafter's per-position log-probabilities. options: the engine's
    (its `host_tree` branch: the C build on the host; None: resolved now, from the scope or the environment)."""

    best_first = True  # tree_tensors: the compiled round's graph of the torch build, used where it runs (not the C one)

    def __init__(self, target, drafter, budget: int, block_size: int | None = None, *,
                 options: EngineOptions | None = None):
        super().__init__(target, drafter, block_size)
        check_budget(budget)
        self.options = options if options is not None else EngineOptions.resolve()
        self.budget = budget
        self.max_nodes = max(self.block_size, budget + 1)

    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            logits = self.draft_logits(state)
        with state.timer.stage("tree"):
            host = host_branch("host_tree", logits.device, self.options)
            if self.tree_tensors is not None and not host:
                return tree_of_tensors(*self.tree_tensors(state.root, logits, self.budget))
            return best_first_tree(state.root, torch.log_softmax(logits, dim=-1), self.budget,
                                   host=None if host else False)


class MTPProposer(Proposer):
    """The target's own MTP head (ddtree.engine.drafter.mtp): each round it first reads the tokens committed since
    the last one with the target's hidden states before them (its KV cache then covers every committed position,
    as the serving engines refill it after verification), then drafts:

    * topk = 1: a chain of `steps` tokens, the head applied on its own output (argmax, or a sample at T > 0);
    * topk > 1: an EAGLE-style tree: the top-k children of each frontier node per step, the next frontier the
      k best of them by cumulative log-probability, `steps` deep; the `budget` best nodes are verified.

    Every step is the head's `step` over its fixed KV buffer (`new_kv`), the one the compiled round takes over
    (StaticMTP). Draft entries sit past the committed rows and are written over the next round (nothing to crop),
    so the rollback is the target's commit. head: an MTPHead, or None to read it from the target's checkpoint.
    """

    compilable = True
    static_form = StaticMTP

    def __init__(self, target: PreTrainedModel, head=None, *, steps: int, topk: int = 1, budget: int = 64):
        check_mtp_args(steps, topk)
        check_budget(budget)
        if head is None:
            head = MTPHead.from_target(target)
        elif not isinstance(head, MTPHead):
            raise ConfigError("drafter", "method=mtp drafts with the target's own MTP head, not a DFlash drafter",
                              "pass no drafter (the head is read from the target's checkpoint) or an MTPHead")
        head.bind(target)
        self.head, self.steps, self.topk, self.budget = head, steps, topk, budget
        self.feature_layers = head.target_layer_ids  # the target's output hidden state (after its final norm)
        self.max_nodes = (steps if topk == 1 else budget) + 1  # the chain ignores the budget
        self.kv = None  # the head's KV buffer (rows: positions of the committed context, then the round's drafts)
        self.ctx_len = 0
        self._tokens = None
        # static_draft: the compiled head (ddtree.engine.drafter.mtp_static.StaticMTP), set by an Engine with compile on: it
        # takes over from a generation's second round (the first reads the prompt eagerly), drafting as the eager head
        self._capacity = 0

    def reset(self, capacity: int) -> None:
        """A new generation; capacity: prompt + new tokens + the largest tree (sizes the compiled head's buffer)."""
        # the committed rows, the compiled read's padded path and the largest round of drafts; one bucket, kept
        rows = capacity_bucket(capacity + 2 * (self.steps + 1) + self.steps * self.topk)
        if self.kv is None or self.kv.shape[-2] != rows or self.kv.dtype != self.head.dtype:
            self.kv = None
            self.kv = self.head.new_kv(rows)
        self.ctx_len = 0
        self._capacity = capacity
        self._tokens = None  # the last tree's tokens
        if self.static_draft is not None:
            self.static_draft.reset()

    def _read_context(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed tokens since the last round into the head's cache; (logits [V], output [1, 1, H]) of the
        last one (the root), i.e. the head's guess for the token after the root."""
        ctx, dev = state.new_context, state.root.device
        c = ctx.shape[1]
        assert self.ctx_len + c == state.start, "the MTP head must read every committed position"
        if self.ctx_len == 0:  # the prompt: position p reads token p + 1 (the root after the last one)
            ids = torch.cat([state.input_ids[0, 1:], state.root.reshape(1)])
        elif state.path is not None and self._tokens is not None:  # the last path after its root, then the new root:
            # on the device (the host's list of them would be copied up: a sync)
            ids = torch.cat([self._tokens.index_select(0, state.path[1:]), state.root.reshape(1)])
        else:
            ids = torch.tensor(state.generated[-c:], dtype=torch.long, device=dev)
        head = self.head
        hdev = head.fc.weight.device  # under a device map the features (and the head's logits) may sit elsewhere
        pos = torch.arange(self.ctx_len, state.start, device=hdev)
        visible = state.start  # one new row: every row; more: causal over the new rows
        if c > 1:
            visible = torch.arange(state.start, device=hdev)[None, :] <= pos[:, None]
        out = head.step(ids[None], ctx.to(device=hdev, dtype=head.dtype), pos, pos, visible, self.kv)
        self.ctx_len = state.start
        last = out[:, -1:]
        return head.logits(last[0, 0]).float().to(dev), last

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        tree = self._propose(state)
        self._tokens = tree.tokens  # the next round reads the accepted ones (_read_context)
        return tree

    def _propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            static = self.static_draft
            if static is not None and static.ready:  # the context arrived through the target's commit graph
                self.ctx_len = state.start
                out = static.draft(state.root)
                with state.timer.stage("tree"):
                    if self.topk == 1:  # chain_tree's, built in the graph
                        tokens, parents, depths, anc = out
                        return DraftTree(tokens, parents, depths, is_chain=True, depth_bound=self.steps, _anc=anc)
                    return tree_of_tensors(*out)
            logits, hidden = self._read_context(state)
            tree = self._chain(state, logits, hidden) if self.topk == 1 else self._tree(state, logits, hidden)
            if static is not None and (self.topk > 1 or state.temperature <= 0):  # (a sampled chain stays eager)
                static.load(self.kv, self.ctx_len)
            return tree

    def _chain(self, state: DecodeState, logits: torch.Tensor, hidden: torch.Tensor) -> DraftTree:
        """topk = 1: argmax at T = 0; at T > 0 a sample of each step's softmax, verified by rejection against it."""
        head, dev = self.head, state.root.device
        picks = [sample_rows(logits, state)]
        hdev = head.fc.weight.device
        for s in range(1, self.steps):  # token s sits at start + s; the head runs one before it, at that row
            row = torch.full((1,), state.start + s - 1, dtype=torch.long, device=hdev)
            hidden = head.step(picks[-1][0].reshape(1, 1), hidden, row, row, state.start + s, self.kv)
            picks.append(sample_rows(head.logits(hidden[0, 0]).float().to(dev), state))
        with state.timer.stage("tree"):
            toks, probs = zip(*picks, strict=True)
            return chain_tree(state.root, torch.stack(toks), None if probs[0] is None else torch.stack(probs))

    def _tree(self, state: DecodeState, logits: torch.Tensor, hidden: torch.Tensor) -> DraftTree:
        """EAGLE-style expansion on the device, without a host read (mtp_expand): step s's k entries at rows
        start + (s - 1) k .. of the head's buffer, each query seeing the committed rows, its ancestors' entries and
        its own."""
        head, dev = self.head, state.root.device

        def step(s: int, f_tok: torch.Tensor, f_src: torch.Tensor, f_anc: torch.Tensor):
            k = f_tok.shape[0]
            past = self.ctx_len + (s - 1) * k
            entries = torch.arange(past, past + k, device=dev)
            vis = torch.zeros(k, past + k, dtype=torch.bool, device=dev)
            vis[:, : self.ctx_len] = True
            vis.scatter_(1, torch.cat([f_anc, entries[:, None]], 1), True)
            pos = torch.full((k,), state.start + s - 1, dtype=torch.long, device=dev)
            return head.step(f_tok[None], f_src[None], pos, entries, vis, self.kv)[0], entries

        pool = mtp_expand(head, logits, hidden[0, 0], self.topk, self.steps, step)
        with state.timer.stage("tree"):
            tokens, parents, depths, scores = mtp_tree_tensors(state.root, *pool, self.budget)
            return DraftTree(tokens, parents, depths, scores=scores, depth_bound=self.steps)
