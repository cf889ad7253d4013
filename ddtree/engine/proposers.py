"""The proposers: what each method drafts in a round (AR the root alone, DFlash a chain, DDTree a
best-first tree), and the per-round state and stage timer they share with the generate loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ddtree.engine.checks import check_block_size, check_budget
from ddtree.engine.result import STAGES
from ddtree.engine.tree import DraftTree, best_first_tree, chain_tree, root_tree


class StageTimer:
    """Seconds per stage. On the CPU: wall seconds (perf_counter). On CUDA: by default a pair of CUDA events per
    stage, recorded at its boundaries and read once by `finish()` after the generation, so timing adds no host
    sync to a round (a stage's time is then the device timeline between its boundaries: its kernels, or the gaps
    while the host launches them). sync=True instead synchronises at every boundary and takes wall seconds (8 host
    syncs a round: the old, intrusive attribution)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        cuda = device.type == "cuda"
        self._sync = sync and cuda
        self._stream = torch.cuda.current_stream(device) if cuda and not sync else None
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def finish(self) -> dict[str, float]:
        """The seconds per stage, the recorded events resolved (one wait for the last of them)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self.seconds[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return self.seconds

    def stage(self, name: str) -> _Stage:
        """`with timer.stage(name):` adds the block's wall seconds to `name`."""
        return _Stage(self, name)

    def move(self, source: str, dest: str, seconds: float) -> None:
        """Book `seconds` timed inside stage `source` under `dest` instead (work of that kind done there)."""
        self.seconds[source] -= seconds
        self.seconds[dest] += seconds


class _Stage:
    """One timed block of a StageTimer (a plain context manager: a generator-based one costs ~3x more a round)."""

    __slots__ = ("timer", "name", "t")

    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        timer = self.timer
        if timer._stream is not None:
            self.t = torch.cuda.Event(enable_timing=True)
            self.t.record(timer._stream)
            return
        if timer._sync:
            torch.cuda.synchronize()
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        timer = self.timer
        if timer._stream is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(timer._stream)
            timer._events.append((self.name, self.t, end))
            return
        if timer._sync:
            torch.cuda.synchronize()
        timer.seconds[self.name] += time.perf_counter() - self.t


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


class DrafterBlock:
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
        self.last_logits: torch.Tensor | None = None  # the latest round's [L, V] (ddtree.engine.diagnostics reads it)

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
        self.last_logits = self.lm_head(hidden[0, 1:]).float().to(dev)
        return self.last_logits


class DFlashProposer(DrafterBlock):
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


class DDTreeProposer(DrafterBlock):
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
