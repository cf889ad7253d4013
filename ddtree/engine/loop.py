"""One generation loop for every method: propose a tree → verify it → walk → commit."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ddtree.engine.methods import check_block_size, check_budget, check_method_args, get_method
from ddtree.engine.result import STAGES, GenerationResult
from ddtree.engine.target import TargetSession, check_target_supported, context_features, model_type
from ddtree.engine.tree import DraftTree, best_first_tree, chain_tree, root_tree, walk
from ddtree.errors import ConfigError

__all__ = ["DecodeState", "Proposer", "ARProposer", "DFlashProposer", "DDTreeProposer",
           "StageTimer", "generate", "context_features"]


class StageTimer:
    """Wall seconds per stage. On CUDA with sync=True each stage boundary synchronises, for honest
    attribution; with sync=False nothing waits on the device (stage times are then launch times)."""

    def __init__(self, device: torch.device, sync: bool = True):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._sync = sync and device.type == "cuda"

    @contextmanager
    def stage(self, name: str):
        if self._sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t


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


class Proposer(Protocol):
    """Proposes a draft tree each round. `needs_features`: wants target context features."""

    needs_features: bool

    def reset(self) -> None: ...

    def propose(self, state: DecodeState) -> DraftTree: ...


class ARProposer:
    needs_features = False

    def reset(self) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        return root_tree(state.root)


class _DrafterBlock:
    """Runs the DFlash drafter on [root, mask, …] and returns per-position logits [block_size - 1, V]."""

    needs_features = True

    def __init__(self, target: PreTrainedModel, drafter, block_size: int | None = None):
        self.target, self.drafter = target, drafter
        self.block_size = block_size or drafter.block_size
        check_block_size(self.block_size)  # the drafter's own, when no block size is passed
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.cache = None
        self.ctx_len = 0

    def reset(self, capacity: int = 0) -> None:
        """A new generation; capacity: prompt + new tokens + one block (sizes the drafter cache once)."""
        self.cache = self.drafter.new_cache(capacity)
        self.ctx_len = 0
        self._block = None  # [root, mask, …] ids and their position offsets, built once per generation

    def _block_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._block is None or self._block[0].device != device:
            ids = torch.full((1, self.block_size), self.drafter.mask_token_id, dtype=torch.long, device=device)
            self._block = ids, torch.arange(self.block_size, device=device).unsqueeze(0)
        return self._block

    @torch.inference_mode()
    def draft_logits(self, state: DecodeState) -> torch.Tensor:
        dev = state.root.device
        ctx = state.new_context
        c = 0 if ctx is None else ctx.shape[1]
        assert self.ctx_len + c == state.start, "drafter context must cover every committed token"
        block, offsets = self._block_inputs(dev)
        block[0, 0] = state.root  # the mask ids behind it never change
        ctx_pos = offsets[:, :c] + self.ctx_len if c <= self.block_size else (
            torch.arange(self.ctx_len, self.ctx_len + c, device=dev).unsqueeze(0))
        hidden = self.drafter(self.embed(block), ctx, ctx_pos, offsets + state.start, cache=self.cache)
        self.ctx_len += c
        # .to(dev): under a device map lm_head returns on its own device, the tree is built on the root's
        return self.lm_head(hidden[0, 1:]).float().to(dev)


class DFlashProposer(_DrafterBlock):
    """A chain of the drafter's choices (argmax at T = 0, a sample at T > 0)."""

    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            logits = self.draft_logits(state)
        with state.timer.stage("tree"):
            if state.temperature > 0:
                probs = torch.softmax(logits / state.temperature, dim=-1)
                toks = torch.multinomial(probs, 1, generator=state.generator).squeeze(-1)
            else:
                toks = logits.argmax(-1)
            return chain_tree(state.root, toks)


class DDTreeProposer(_DrafterBlock):
    """The best-first `budget` prefixes under the drafter's per-position log-probabilities."""

    def __init__(self, target, drafter, budget: int, block_size: int | None = None):
        super().__init__(target, drafter, block_size)
        check_budget(budget)
        self.budget = budget

    def propose(self, state: DecodeState) -> DraftTree:
        with state.timer.stage("draft"):
            logits = self.draft_logits(state)
        with state.timer.stage("tree"):
            return best_first_tree(state.root, torch.log_softmax(logits, dim=-1), self.budget)


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token after each row: argmax, or one independent sample per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])


def make_proposer(method: str, target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    """The proposer of `method` (ddtree.engine.methods), after the argument checks every engine shares."""
    m = check_method_args(method, has_drafter=drafter is not None, budget=budget, block_size=block_size)
    return m.make_proposer(target, drafter, budget, block_size)


def check_generate_args(temperature: float, max_new_tokens: int, input_ids: torch.Tensor) -> None:
    """The argument checks every engine's generate shares."""
    if temperature < 0:
        raise ConfigError("temperature", f"must be >= 0, got {temperature}", "use 0 for greedy")
    if max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError("input_ids", f"must have shape [1, prompt_len], got {list(input_ids.shape)}",
                          "pass one prompt: input_ids[None] or tokenizer(..., return_tensors='pt').input_ids")


def generate(target: PreTrainedModel, drafter, input_ids: torch.Tensor, *, method: str = "ddtree",
             budget: int | None = 64, temperature: float = 0.0, max_new_tokens: int = 256,
             stop_token_ids: Iterable[int] | None = None, generator: torch.Generator | None = None,
             proposer: Proposer | None = None, block_size: int | None = None,
             sync_timing: bool = True, tree_attention: str = "auto") -> GenerationResult:
    """Generate up to `max_new_tokens` after `input_ids` [1, P] with `method`, losslessly.

    At temperature 0 the output equals plain greedy decoding of `target`; at T > 0 every token
    is a sample of the target's distribution. A custom `proposer` replaces the method's drafter.
    sync_timing: synchronise the device at stage boundaries (honest stage times; costs idle gaps).
    tree_attention: "split" (ddtree.engine.attention, any backend; the target is switched to the tree
    implementation wrapping its backend), "dense" (a 4-D mask over past + tree; eager/sdpa) or "auto"
    (split, but dense for a small mask on a CPU eager/sdpa target without sliding layers: cheaper there).
    """
    check_generate_args(temperature, max_new_tokens, input_ids)
    check_target_supported(model_type(target), method)
    spec = get_method(method)
    if proposer is None:
        if drafter is not None and spec.needs_drafter:
            drafter.check_compatible(target)
        proposer = make_proposer(method, target, drafter, budget, block_size)
    stops = set(stop_token_ids or ())
    dev = input_ids.device
    timer = StageTimer(dev, sync_timing)
    layers = drafter.target_layer_ids if (proposer.needs_features and drafter is not None) else None
    tree_max = max(budget or 1, getattr(proposer, "block_size", 1) or 1) + 1
    session = TargetSession(target, layers, tree_attention=tree_attention,
                            capacity=input_ids.shape[1] + max_new_tokens + tree_max)
    if not isinstance(proposer, ARProposer):
        session.check_method(method)
    if isinstance(proposer, _DrafterBlock):
        proposer.reset(input_ids.shape[1] + max_new_tokens + tree_max)
    else:
        proposer.reset()
    result = GenerationResult(output_ids=[], method=method, prompt_len=input_ids.shape[1], temperature=temperature,
                              budget=budget if spec.reads_budget else None,
                              block_size=getattr(proposer, "block_size", None))

    t0 = time.perf_counter()
    logits, feats = session.prefill(input_ids)
    root = _choose(logits, temperature, generator)
    out = [int(root)]
    result.ttft_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    done = out[0] in stops or len(out) >= max_new_tokens
    if out[0] in stops:
        result.stopped_by = "stop_token"
    while not done:
        state = DecodeState(root=root, start=session.length, prompt_len=input_ids.shape[1], generated=out,
                            new_context=feats, temperature=temperature, generator=generator, timer=timer)
        tree = proposer.propose(state)
        with timer.stage("verify"):
            logits, feats = session.verify(tree)
        with timer.stage("commit"):
            choice = _choose(logits, temperature, generator)
            w = walk(tree, choice)  # the round's one host read
            session.commit(tree, w.path)
            if feats is not None:
                feats = feats[:, w.path]
            new, root = w.tokens, w.next_root
        # stop at (and including) a stop token; never past max_new_tokens
        room = max_new_tokens - len(out)
        for i, t in enumerate(new[:room]):
            if t in stops:
                new, done, result.stopped_by = new[: i + 1], True, "stop_token"
                break
        new = new[:room]
        out.extend(new)
        result.acceptance_lengths.append(len(new))
        done = done or len(out) >= max_new_tokens
    result.decode_s = time.perf_counter() - t1
    result.output_ids = out
    result.stage_seconds = timer.seconds
    return result
