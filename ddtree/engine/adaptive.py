"""`budget="auto"` with many streams: every round, the draft that maximises the batch's committed tokens per second.

`LoadBudget.choose(streams)` weighs, for the round's live streams, each option: no draft (AR: the target's one token
a stream), DFlash's chain (block_size - 1 drafted tokens) and a DDTree tree of each candidate budget B. Its rate is

    rate(option) = streams x tau(option) / (seconds(rows, option) + its joins' seconds where prompts wait)

tau from the acceptance estimate (`AcceptanceEstimate`: the rank model of ddtree.engine.rank_model, kept online by
depth from the ranks each round's one host read carries), seconds from a `RoundCost`: measured on the machine
(`MeasuredCost`, calibrated in the first rounds) or the project's cost model for a stated GPU (`RooflineCost.stated`,
docs/gpu.md). AR is always an option, so the choice is never slower than plain decoding by the model's own estimate.
`LoadBudget.observe(...)` feeds the round's outcome back; `history` keeps one `RoundRecord` a round for the
diagnosis. docs/concurrency.md ("The budget rule") states the formulas.

The controller is host arithmetic: it launches nothing and reads nothing from the device. `target_ranks` is the one
device helper: the ranks `observe` takes, computed in a few batched ops where the round's walk is, so the round's one
host read carries them.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from ddtree.engine.diagnostics import RANK_CAP
from ddtree.engine.rank_model import chain_tau, predict_taus

KINDS = ("ar", "chain", "tree")
# the first rounds, where the rule's model is refitted after every round (then every `refit_every`)
WARM = 32
# the committed tokens the band's mean join cost counts as in an option's own (LoadBudget.join_cost): a join is a
# lump (a prompt's prefill), few at low loads, where the cost a token is the same for every option (at one stream each
# output's end brings one prefill, whatever ran); at 16 streams and more an option's own rounds outweigh it in a few
# dozen rounds
JOIN_PRIOR = 512.0


@dataclass(frozen=True)
class Choice:
    """One round's draft for every stream. kind: "ar" (no draft), "chain" (DFlash's chain of block_size - 1 drafted
    tokens) or "tree" (a DDTree tree); nodes: drafted tokens a stream besides its root (0 for AR, block_size - 1 for a
    chain, the budget B for a tree). The target verifies `tokens` = nodes + 1 a stream."""

    kind: str
    nodes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Choice.kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.nodes < 0 or (self.kind == "ar") != (self.nodes == 0):
            raise ValueError(f"Choice({self.kind!r}, {self.nodes}): AR drafts 0 nodes, a chain or a tree at least 1")

    @property
    def tokens(self) -> int:
        """Tokens the target verifies a stream (the root and the drafted nodes)."""
        return self.nodes + 1

    @property
    def drafted(self) -> bool:
        return self.kind != "ar"

    @property
    def budget(self) -> int | None:
        """The DDTree node budget (a tree), else None."""
        return self.nodes if self.kind == "tree" else None

    @property
    def label(self) -> str:
        """"ar", "chain", "ddtree:B"."""
        return f"ddtree:{self.nodes}" if self.kind == "tree" else self.kind


AR = Choice("ar", 0)


# ----- acceptance ------------------------------------------------------------------------------------------------

class AcceptanceEstimate:
    """p_d(r | state) of the rank model (ddtree.engine.rank_model), kept online: exponentially weighted counts of the
    target token's drafter rank r (RANK_CAP = beyond) at each depth d = 1 … depth, given the path above was accepted,
    state 0 while that path stayed on the drafter's top-1 chain and 1 off it.

    Before data, a prior: top-1 acceptance `prior` at every depth, the rest of each row halving rank by rank (the
    remainder "beyond"); it counts as `prior_weight` observations a depth, so data replace it within a few rounds. Off
    the chain, a depth's row shrinks toward the same depth's main-chain row (independence) with the same weight.
    Counts decay by 2^(-1/halflife) a round (`halflife` in rounds; 0: no decay). A round's ranks are queued and
    counted, decay included, when the counts are next read (`counts`, `tables`): a round's host work is an append."""

    def __init__(self, depth: int, *, prior: float = 0.7, prior_weight: float = 4.0, halflife: float = 64.0):
        if depth < 1:
            raise ValueError(f"AcceptanceEstimate: depth must be >= 1 (block_size - 1), not {depth}")
        if not 0.0 < prior < 1.0:
            raise ValueError(f"AcceptanceEstimate: prior (top-1 acceptance) must be in (0, 1), not {prior}")
        self.depth = depth
        self.prior_weight = float(prior_weight)
        self.decay = 0.5 ** (1.0 / halflife) if halflife > 0 else 1.0
        row = [prior] + [(1 - prior) * 0.5 ** r for r in range(1, RANK_CAP)]
        row.append(max(0.0, 1.0 - sum(row)))
        self.prior = np.asarray(row)
        self._counts = np.zeros((2, depth, RANK_CAP + 1))  # [state, depth, rank], as of the last flush
        self._observed = 0
        self._queued: list[tuple[np.ndarray, int]] = []  # (ranks [streams, depths], rounds decayed before them)
        self._rounds = 0  # decay_round calls since the last flush

    @property
    def counts(self) -> np.ndarray:
        """[state, depth, rank]: the exponentially weighted counts."""
        self._flush()
        return self._counts

    @property
    def observed(self) -> int:
        """Rank observations so far (undecayed)."""
        self._flush()
        return self._observed

    def decay_round(self) -> None:
        self._rounds += 1

    def add(self, *streams: Sequence[int]) -> None:
        """Each stream's ranks along its accepted path and at the first rejected depth (depths 1, 2, …)."""
        if streams:
            self.add_rows(_padded(streams, self.depth))

    def add_rows(self, ranks) -> None:
        """The same for many streams at once: ranks [streams, depths] (an array; -1 past a stream's last depth)."""
        self._queued.append((np.asarray(ranks, dtype=np.int64)[:, : self.depth], self._rounds))
        if len(self._queued) >= 256:  # (bounded: a reader that never reads)
            self._flush()

    def _flush(self) -> None:
        """Counts the queued rounds: rows queued after a decay rounds of the A since the last flush weigh
        decay^(A - a); the counts before them decay^A."""
        if not self._queued and not self._rounds:
            return
        self._counts *= self.decay ** self._rounds
        if self._queued:
            width = max(r.shape[1] for r, _ in self._queued)
            r = np.full((sum(len(r) for r, _ in self._queued), width), -1, dtype=np.int64)
            w = np.empty(len(r))
            at = 0
            for rows, a in self._queued:
                r[at: at + len(rows), : rows.shape[1]] = rows
                w[at: at + len(rows)] = self.decay ** (self._rounds - a)
                at += len(rows)
            seen = r >= 0
            r = np.minimum(r, RANK_CAP)
            off = np.cumsum(r != 0, axis=1) - (r != 0)  # ranks != 0 above each depth: the path left the top-1 chain
            state = (off > 0).astype(np.int64)
            depth = np.broadcast_to(np.arange(width), r.shape)
            idx = ((state * self.depth + depth) * (RANK_CAP + 1) + r)[seen]
            weights = np.broadcast_to(w[:, None], r.shape)[seen]
            self._counts += np.bincount(idx, weights, minlength=self._counts.size).reshape(self._counts.shape)
            self._observed += int(idx.size)
        self._queued, self._rounds = [], 0

    def tables(self) -> tuple[list[list[float]], list[list[float]]]:
        """(main, off): p_d(r) per depth, ranks 0 … RANK_CAP - 1 then the mass beyond (rank_model's layout)."""
        w = self.prior_weight
        main = (self.counts[0] + w * self.prior) / (self.counts[0].sum(1, keepdims=True) + w)
        off = (self.counts[1] + w * main) / (self.counts[1].sum(1, keepdims=True) + w)
        return main.tolist(), off.tolist()

    def taus(self, max_budget: int) -> tuple[float, list[float]]:
        """(a chain's tau over every depth, [tau of the best tree of 0 … max_budget nodes])."""
        main, off = self.tables()
        return chain_tau(main), predict_taus(main, off, max_budget)


def _padded(streams: Sequence[Sequence[int]], depth: int) -> np.ndarray:
    """Per-stream rank lists as one [streams, depth] array, -1 past each list's end."""
    out = np.full((len(streams), depth), -1, dtype=np.int64)
    for i, ranks in enumerate(streams):
        n = min(len(ranks), depth)
        if n:
            out[i, :n] = ranks[:n]
    return out


def target_ranks(logits: torch.Tensor, tree_tokens: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor,
                 next_root: torch.Tensor) -> torch.Tensor:
    """On the device, long [N, L]: per stream, the drafter rank of the target's token (0 = the drafter's top-1 in
    its row; ties rank by the tokens strictly above) at depths 1 … min(a + 1, L), a = lengths - 1 accepted draft
    tokens: the accepted path's tokens, then the target's token after them (the first rejected depth); -1 past.

    logits: the round's drafter rows [N, L, V] (row d drafts depth d + 1, any monotone transform of the
    log-probabilities); tree_tokens [N, T]; path [N, K] flat node indices root first, padded with the last node;
    lengths [N] nodes on each path, root included; next_root [N] (ddtree.engine.batch_tree.BatchWalk's fields). A few
    ops for the whole batch and no host read: read the result with the walk's."""
    n, L, _ = logits.shape
    d = torch.arange(L, device=logits.device)[None, :]  # depth d + 1
    col = (d + 1).clamp(max=path.shape[1] - 1).expand(n, L)
    toks = tree_tokens.gather(1, path.to(logits.device).gather(1, col))
    a = (lengths.to(logits.device) - 1)[:, None]
    toks = torch.where(d < a, toks, next_root.to(logits.device)[:, None])
    own = logits.gather(2, toks[:, :, None])
    rank = (logits > own).sum(-1)
    return torch.where(d <= a, rank, torch.full_like(rank, -1))


def smaller_tree_accepts(scores: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor,
                         budgets: Sequence[int]) -> torch.Tensor:
    """On the device, long [N, len(budgets)]: per stream, the draft tokens the round's walk would have accepted with
    the best-first tree of each of `budgets` nodes (each at most the round's budget) built from the same drafter rows.

    Best-first trees are nested (a tree of B' nodes is the first B' pops of the search that built this one), and
    siblings are distinct, so the smaller tree's accepted path is the longest prefix of this round's accepted path
    that lies in it: the path nodes to depth j whose pop order (their place in descending score, the flat order's
    earlier first among equal scores: the shallower) is at most B'. scores float32 [N, T] (the tree's cumulative
    draft log-probabilities, the root's 0 first: BatchTree.scores); path [N, K] flat node indices root first (padded
    with its last node), lengths [N] nodes on each path, root included (BatchWalk's). No host read."""
    n, T = scores.shape
    dev = scores.device
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    pop = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=dev).expand(n, T))
    top = torch.cummax(pop.gather(1, path.to(dev)), dim=1).values[:, 1:]  # [N, K - 1]: the latest pop to depth j
    on = torch.arange(1, path.shape[1], device=dev)[None, :] < lengths.to(dev)[:, None]
    limit = torch.tensor(list(budgets), dtype=top.dtype, device=dev)
    return ((top[:, :, None] <= limit) & on[:, :, None]).sum(1)


# ----- cost ------------------------------------------------------------------------------------------------------

class RoundCost:
    """Seconds of one batched round as a function of its batch rows (the slots it computes; LoadBudget passes them
    as `streams`) and the round's draft. `observe` takes the measured seconds of a round (a stated model ignores
    them); `measured`: whether it learns from them, so a controller first measures every option (`rounds`: the
    measured rounds of a draft shape)."""

    measured = False
    source = "given"

    def seconds(self, streams: int, choice: Choice) -> float:
        raise NotImplementedError

    def observe(self, streams: int, choice: Choice, seconds: float, switch: bool = False) -> None:
        return None

    def rounds(self, choice: Choice) -> int:
        return 0

    def settled(self, streams: int, choice: Choice) -> bool:
        """Whether the cost of `choice` at `streams` rows is known as well as it will be (a stated model: always)."""
        return True

    def describe(self) -> dict[str, Any]:
        return {"source": self.source}

    @staticmethod
    def stated(structure: str = "qwen3_6_27b", gpu: str = "h200", **kw) -> RooflineCost:
        """The project's cost model for a stated structure and GPU (`RooflineCost.stated`)."""
        return RooflineCost.stated(structure, gpu, **kw)


@dataclass(frozen=True)
class Structure:
    """A real model's dims as the cost model counts them (`real_dims` in bench/bench_launches.py, of
    bench/configs/<name>.json): params read a round (all but the input embeddings), the lm_head's, a 5-layer DFlash
    drafter's, the attention and GDN layers, a KV row's bytes per attention layer (K and V, bf16), one GDN layer's
    state bytes (fp32 recurrent + bf16 conv), the drafter's KV row, sliding layers and window."""

    params: int
    head: int
    drafter: int
    attn_layers: int
    gdn_layers: int
    kv_row: int
    gdn_state: int
    drafter_layers: int = 5
    drafter_kv_row: int = 4096
    drafter_sliding: int = 4
    drafter_window: int = 2048


STRUCTURES = {
    "qwen3_6_27b": Structure(params=25_624_600_064, head=1_271_398_400, drafter=1_835_072_000, attn_layers=16,
                             gdn_layers=48, kv_row=4096, gdn_state=3_227_648),
    "qwen3_8b": Structure(params=7_568_405_504, head=622_329_856, drafter=1_048_626_432, attn_layers=36,
                          gdn_layers=0, kv_row=4096, gdn_state=0),
}
# bytes/s, dense bf16 FLOP/s, the fraction of it a GEMM reaches (docs/gpu.md; the H100 SXM's as bench_launches --tp)
GPUS = {"h200": (4.8e12, 989e12, 0.7), "h100": (3.35e12, 989e12, 0.7)}


class RooflineCost(RoundCost):
    """The cost model of docs/gpu.md at N streams (every constant stated):

        bytes   = 2 (params + [drafted] (drafter + head))                         the weights, read once a round
                  + N (attention KV rows at `context` + 2 x GDN states + [drafted] the drafter's KV rows)
        FLOPs   = N (2 params x tokens + [drafted] 2 (drafter + head) x block_size)
        round   = max(bytes / bandwidth, FLOPs / (peak x mfu), host_s) + syncs x sync_s

    host_s: the compiled round's host time (68 ops x 6 us + 4 graph calls x 30 us, docs/gpu.md), below the device
    time; so a round is bandwidth-bound until N x tokens reaches about 160-170 on Qwen3.6-27B / H200 (`knee`), then
    compute-bound."""

    source = "cost model"

    def __init__(self, dims: Structure, *, bandwidth: float, peak_flops: float, mfu: float, block_size: int = 16,
                 context: int = 1024, host_s: float = 68 * 6e-6 + 4 * 30e-6, syncs: int = 1, sync_s: float = 20e-6,
                 name: str = "custom"):
        self.dims, self.bandwidth, self.peak_flops, self.mfu = dims, bandwidth, peak_flops, mfu
        self.block_size, self.context, self.host_s, self.syncs, self.sync_s = block_size, context, host_s, syncs, sync_s
        self.name = name

    @classmethod
    def stated(cls, structure: str = "qwen3_6_27b", gpu: str = "h200", **kw) -> RooflineCost:
        """The cost model for one of STRUCTURES on one of GPUS; kw: block_size, context, host_s, syncs, sync_s."""
        if structure not in STRUCTURES:
            raise ValueError(f"RooflineCost.stated: structure {structure!r} unknown; one of {', '.join(STRUCTURES)}")
        if gpu not in GPUS:
            raise ValueError(f"RooflineCost.stated: gpu {gpu!r} unknown; one of {', '.join(GPUS)}")
        bw, peak, mfu = GPUS[gpu]
        return cls(STRUCTURES[structure], bandwidth=bw, peak_flops=peak, mfu=mfu, name=f"{structure} on {gpu}", **kw)

    def bytes(self, streams: int, choice: Choice) -> float:
        d = self.dims
        weights = 2 * (d.params + (d.drafter + d.head if choice.drafted else 0))
        state = d.attn_layers * self.context * d.kv_row + 2 * d.gdn_layers * d.gdn_state
        if choice.drafted:
            state += sum(min(self.context, d.drafter_window) if i < d.drafter_sliding else self.context
                         for i in range(d.drafter_layers)) * d.drafter_kv_row
        return weights + streams * state

    def flops(self, streams: int, choice: Choice) -> float:
        d = self.dims
        drafter = 2 * (d.drafter + d.head) * self.block_size if choice.drafted else 0
        return streams * (2 * d.params * choice.tokens + drafter)

    def seconds(self, streams: int, choice: Choice) -> float:
        device = max(self.bytes(streams, choice) / self.bandwidth,
                     self.flops(streams, choice) / (self.peak_flops * self.mfu))
        return max(device, self.host_s) + self.syncs * self.sync_s

    def knee(self, streams: int = 1) -> float:
        """Verified tokens of all streams together where a drafted round turns compute-bound."""
        d = self.dims
        probe = Choice("chain", 1)
        drafter = streams * 2 * (d.drafter + d.head) * self.block_size
        return (self.bytes(streams, probe) / self.bandwidth * self.peak_flops * self.mfu - drafter) / (2 * d.params)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "model": self.name, "bandwidth": self.bandwidth, "peak_flops": self.peak_flops,
                "mfu": self.mfu, "context": self.context, "block_size": self.block_size, "host_s": self.host_s,
                "knee_tokens": self.knee()}


class MeasuredCost(RoundCost):
    """Round seconds calibrated on the machine from the rounds themselves.

    Each (streams, tokens a stream, drafted) keeps the median of its last `window` measured rounds, each divided by
    the machine's drift when it ran: the machine's speed moves (on the toy's CPU by 10-30 % within seconds), and the
    options are measured at different times, the one chosen all along and the others in a few exploration rounds,
    so their raw medians compare a fast moment with a slow one (DDTree-8 at one stream measured at 0.80x DDTree-16's
    cost where it runs at 0.91x, and the rule ran it). The drift is the log of round seconds over the key's median,
    followed at `drift_rate` a round (steady rounds of keys measured 3 times or more); a prediction is the
    reference-speed cost times the drift now, so options compare at one speed. Left out: the
    run's first `warmup` rounds (allocator growth, first kernels) and the first `shape_warmup` rounds of each draft
    shape (0 by default: an eager round's first run at a shape costs what the next do, and it is the one that says a
    new shape is dear; 1 where each new shape compiles). The fit, weighted by observations:

        seconds = a + e [drafted] + c N + f [drafted] N + b max(0, N x tokens - k)

    flat in the verified tokens up to a knee k (bandwidth-bound), then linear (compute-bound): k is searched among 0
    and the measured N x tokens, then between the best one's neighbours, by the least weighted squared error with
    b >= 0 (k = 0: linear throughout, as on a CPU). A small ridge keeps the columns the data do not yet separate
    (one stream count so far) at zero. The fit is redone after new rounds: every round for the first WARM (32)
    fits and whenever a round lands on a (streams, shape) not measured before, else every `refit_every` rounds (host
    time).

    Where the data leave the knee open (knees within `tolerance` of the least error), the fit takes the shallowest
    slope b among them: far past the measured rounds a bigger draft looks cheap rather than dear, so it gets chosen
    and its round measures it (the controller's rounds at a new load do the rest: LoadBudget). A prediction is never
    below a round measured at the same stream count with no more tokens (and no draft where it drafts none): a round
    does not get cheaper with more work, which caps that optimism where the machine has already said otherwise (a
    draft measured at least twice: one round may be an outlier). At a (streams, shape) measured twice or more the
    prediction is its own median; measured once, the lower of that round and the fit (an outlier does not rule an
    option out: it runs again and its median settles it). Either way never above a draft's with more tokens measured
    twice at the same stream count (and a draft where it drafts one): an option not run for a while must not look
    dearer than a bigger one running now, or the rule's refresh (LoadBudget) never runs it again to see."""

    measured = True
    source = "measured"
    settle_rounds = 3  # steady rounds that settle a key's cost (`settled`): a median robust to one outlier

    def __init__(self, *, window: int = 8, warmup: int = 1, shape_warmup: int = 0, refit_every: int = 32,
                 tolerance: float = 0.25, drift_rate: float = 0.5):
        self.window, self.warmup, self.shape_warmup, self.drift_rate = window, warmup, shape_warmup, drift_rate
        self._drift = 0.0  # log of the machine's speed now against its reference (observe)
        self.refit_every, self.tolerance = refit_every, tolerance
        self._rounds = 0  # rounds observed, warm-ups included
        self._runs: dict[tuple[int, int, bool], deque] = {}
        self._steady: set[tuple[int, int, bool]] = set()  # keys with a steady round (observe's switch)
        self._median: dict[tuple[int, int, bool], float] = {}
        self._by_streams: dict[int, dict[tuple[int, bool], float]] = {}  # streams -> shape -> median
        self._seen: dict[tuple[int, bool], int] = {}  # rounds per draft shape (tokens, drafted), warm-ups included
        self._measured: dict[tuple[int, bool], int] = {}  # the same past the warm-ups
        self._coef: np.ndarray | None = None
        self._knee = 0.0
        self._floor = 0.0
        self._new = 0  # measured rounds since the last fit
        self._new_key = False  # a (streams, shape) first measured since the last fit
        self._fits = 0

    def observe(self, streams: int, choice: Choice, seconds: float, switch: bool = False) -> None:
        """A measured round (seconds <= 0 or not finite: not measured). switch: the round's draft differs from the
        round before it (a round of a new shape after others costs more on a CPU: its buffers are new); a key keeps
        such rounds only until a round of the same draft after its like (a steady round) arrives, then only those."""
        shape = (choice.tokens, choice.drafted)
        self._seen[shape] = self._seen.get(shape, 0) + 1
        self._rounds += 1
        warm = self._rounds <= self.warmup or self._seen[shape] <= self.shape_warmup
        if warm or not math.isfinite(seconds) or seconds <= 0:
            return
        key = (int(streams), choice.tokens, choice.drafted)
        self._new_key = self._new_key or key not in self._runs
        runs = self._runs.setdefault(key, deque(maxlen=self.window))
        if switch and key in self._steady:
            return  # a steady round measured it: the switch's extra is not the option's cost
        if not switch and key not in self._steady:
            self._steady.add(key)
            runs.clear()  # (the switch rounds it had until now)
        if not switch and len(runs) >= 3:  # the machine's speed now, against this key's median
            self._drift += self.drift_rate * (math.log(seconds) - self._drift - math.log(self._median[key]))
        runs.append(float(seconds) * math.exp(-self._drift))  # (at the machine's reference speed)
        self._measured[shape] = self._measured.get(shape, 0) + 1
        self._median[key] = statistics.median(runs)
        self._by_streams.setdefault(key[0], {})[key[1:]] = self._median[key]
        self._new += 1

    def rounds(self, choice: Choice) -> int:
        return self._measured.get((choice.tokens, choice.drafted), 0)

    def settled(self, streams: int, choice: Choice) -> bool:
        """Measured at these rows by `settle_rounds` (3) steady rounds or more (a round after its like: a switch
        round, and a key's first rounds, cost more on a CPU, by up to a quarter on the toy; the median of 3 outlives
        one slow moment of the machine, that of 2 does not)."""
        key = (int(streams), choice.tokens, choice.drafted)
        return key in self._steady and len(self._runs[key]) >= self.settle_rounds

    def _refit(self) -> None:
        stale = self._new and (self._fits < WARM or self._new >= self.refit_every or self._new_key)
        if self._coef is None or stale:
            self._fit()

    def _fit(self) -> None:
        keys = list(self._runs)
        S = np.array([k[0] for k in keys], dtype=np.float64)
        T = np.array([k[1] for k in keys], dtype=np.float64)
        D = np.array([float(k[2]) for k in keys])
        y = np.array([self._median[k] for k in keys])
        w = np.array([len(self._runs[k]) for k in keys], dtype=np.float64)
        work = S * T
        base = np.stack([np.ones_like(S), D, S, D * S], 1)  # [n, 4]
        ridge = np.diag([0.0, 1.0, 1.0, 1.0, 1.0])[None] * 1e-9

        def solve(knees: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            X = np.concatenate([np.broadcast_to(base, (len(knees), *base.shape)),
                                np.maximum(0.0, work[None, :] - knees[:, None])[:, :, None]], 2)  # [K, n, 5]
            XtW = X.transpose(0, 2, 1) * w[None, None, :]
            A = XtW @ X
            A = A + ridge * (np.trace(A, axis1=1, axis2=2) / A.shape[1])[:, None, None]
            coef = np.linalg.solve(A, (XtW @ y)[:, :, None])[:, :, 0]  # [K, 5]
            err = (((X @ coef[:, :, None])[:, :, 0] - y[None]) ** 2 * w[None]).sum(1)
            err[coef[:, 4] < 0] = np.inf  # a cost falling with the tokens is no roofline
            return coef, err

        grid = np.unique(np.concatenate([[0.0], work]))
        coef, err = solve(grid)
        if np.isfinite(err).any():
            tol = 1e-18 * float((w * y * y).sum())  # exact data: rounding
            i = int(np.argmin(err))  # refined between its neighbours (a knee lies between measured points)
            fine = np.linspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 33)
            c2, e2 = solve(fine)
            grid, coef, err = np.concatenate([grid, fine]), np.concatenate([coef, c2]), np.concatenate([err, e2])
            ok = np.flatnonzero(err <= err.min() * (1 + self.tolerance) + tol)
            i = int(ok[np.argmin(coef[ok, 4])])  # the shallowest slope the data allow
            self._coef, self._knee = coef[i], float(grid[i])
        else:  # every knee gave a falling slope: flat in the tokens
            coef, _ = solve(np.array([float(work.max())]))
            self._coef, self._knee = coef[0], float(work.max())
        self._floor = min(self._median.values())
        self._new, self._new_key = 0, False
        self._fits += 1

    def seconds(self, streams: int, choice: Choice) -> float:
        if not self._runs:
            raise RuntimeError("MeasuredCost.seconds before any measured round")
        self._refit()
        a, e, c, f, b = self._coef
        dr = float(choice.drafted)
        s = a + e * dr + c * streams + f * dr * streams + b * max(0.0, streams * choice.tokens - self._knee)
        return self._reference(int(streams), choice, s) * math.exp(self._drift)

    def _reference(self, streams: int, choice: Choice, s: float) -> float:
        """The round's seconds at the machine's reference speed (`s`: the fit's)."""
        key = (streams, choice.tokens, choice.drafted)
        runs = self._runs.get(key)
        # a round's cost does not fall with more work: never above a draft's with more tokens at this load, measured
        # at least twice (one round may be an outlier: a first shape, the machine's hiccup), nor below one's with
        # no more tokens (and no draft where this drafts none)
        shapes = [(t, dr2) for (t, dr2) in self._by_streams.get(key[0], {})
                  if len(self._runs[(key[0], t, dr2)]) >= 2 and (t, dr2) != key[1:]]
        above = min((self._median[(key[0], t, dr2)] for (t, dr2) in shapes
                     if t >= choice.tokens and (dr2 or not choice.drafted)), default=math.inf)
        if runs is not None and len(runs) >= 2:  # measured at this load: its own median
            return min(self._median[key], above)
        # nor below a cheaper one's, nor below half the fastest round
        below = [self._median[(key[0], t, dr2)] for (t, dr2) in shapes
                 if t <= choice.tokens and (choice.drafted or not dr2)]
        fit = min(max(float(s), 0.5 * self._floor, *below), above)
        return fit if runs is None else min(self._median[key], fit)  # one round: no dearer than the fit says

    def describe(self) -> dict[str, Any]:
        if self._runs:
            self._refit()
        coef = None if self._coef is None else dict(zip(("a", "drafted", "stream", "drafted_stream", "token"),
                                                        map(float, self._coef), strict=True))
        return {"source": self.source, "coef": coef, "knee_tokens": self._knee, "drift": math.exp(self._drift),
                "shapes": sorted({(t, dr) for (_, t, dr) in self._runs})}


# ----- the controller --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    """One option's prediction at a stream count: tau a stream (corrected), round seconds, and the seconds of the
    joins a round of it brings where prompts wait (`LoadBudget.join_cost`: the prefills of the prompts that take the
    slots its streams free)."""

    choice: Choice
    tau: float
    seconds: float
    joins: float = 0.0

    def rate(self, streams: int) -> float:
        """The batch's committed tokens per second (its joins' seconds counted)."""
        return streams * self.tau / (self.seconds + self.joins)


def predictions(streams: int, taus: Mapping[Choice, float], cost: RoundCost, rows: int | None = None
                ) -> list[Prediction]:
    """Each option's prediction at `streams` live streams from its tau a stream and the cost of a round over `rows`
    batch rows (the slots the round computes, live or free; None: `streams`)."""
    return [Prediction(c, float(t), cost.seconds(rows or streams, c)) for c, t in taus.items()]


def best(streams: int, preds: Sequence[Prediction]) -> Prediction:
    """The rule: the most committed tokens per second of the batch (equal rates: the fewer verified tokens)."""
    return max(preds, key=lambda p: (p.rate(streams), -p.choice.tokens))


@dataclass
class RoundRecord:
    """One round for the diagnosis: what was chosen for how many streams and the prediction it was chosen by, and,
    once observed, what happened. explore: None (the model's best), "calibration" (a measured cost's first rounds,
    each option in turn: no prediction yet), "load" (a measured cost: an option near the best not yet run at this
    load) or "refresh" (a periodic round of another option near the best, keeping it measured)."""

    round: int
    streams: int
    choice: Choice
    predicted_tau: float | None
    predicted_seconds: float | None  # the round's
    predicted_tok_s: float | None  # the round's (as `tok_s`: its joins not counted)
    explore: str | None = None
    seconds: float | None = None  # measured
    tokens: int | None = None  # committed this round, all streams
    predicted_join_s: float | None = None  # the joins' seconds the rule counted for it (0: no prompt waited)
    model_taus: dict | None = field(default=None, repr=False)  # the rank model's taus when chosen (the corrections')

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens is not None and self.seconds else None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model_taus"}
        out.update(choice=self.choice.label, kind=self.choice.kind, nodes=self.choice.nodes, tok_s=self.tok_s)
        return out


class LoadBudget:
    """Chooses each round's draft for the whole batch (module docstring).

    candidates: DDTree node budgets (e.g. 8, 16, 32, 64; empty: the chain and AR only). block_size: the drafter's (a
    chain drafts block_size - 1 tokens, the deepest a tree goes). chain: whether the chain is an option (AR always
    is). cost: a RoundCost (default MeasuredCost). prior, prior_weight, halflife: AcceptanceEstimate's (halflife 0:
    no decay). refit_every: the taus are recomputed from the estimate after every drafted round for the first WARM
    (32) of them, then every refit_every (host time: the rank model's best-first search is ~1 ms at budget 64).

    Rounds that explore (RoundRecord.explore); refresh rounds, and load rounds but one a load, never run an option the
    model puts below AR:
    * calibration (a measured cost): first, each round the option with the fewest tokens that has no measured round
      and could still win by the bound in `_calibration`: at most 1 + options rounds (the run's warm-up, then one
      each), fewer where a cheap option's measured rate rules bigger ones out;
    * load (a measured cost): at a load band not seen before and at least the highest one run so far (stream counts
      25 % apart; the tail of a batch, where streams end one by one, is predicted from the fit, not explored), one
      round of each option near the best that has not run there, so the fit is measured where the choice is made,
      and where no drafted round has run there, of the best drafted option (even below AR: the fit's extrapolation
      from other loads must not rule drafting out unmeasured);
    * refresh: every `refresh_every` rounds (0: never), one round of the near option measured least recently (a
      smaller tree is measured by a bigger one's rounds: the refresh goes to the bigger trees, the chain, AR);
    near: a predicted rate within `refresh_within` of the best's and not below AR's; for a refresh, also an option
    measured too little to rule out (`_young`) within `young_within` (0.5) of the best's.
    A load or refresh exploration runs two rounds in a row: the first is a switch, which a CPU pays for new buffers
    (MeasuredCost.observe's switch), the second measures the option's steady cost.
    An evaluation keeps the current choice at an unchanged load unless another's predicted rate beats it by more than
    `stay_within` (5 %: no switch for what may be the measurements' noise) or the same option has beaten it at each
    of the last `persist` (4) evaluations there (an advantage that persists is not noise), and a draft is chosen over
    AR only where its predicted rate beats AR's by more than that too (the floor the rule must not fall below: a
    draft's tau and cost are estimates, AR's tau is 1; on the toy at 32 streams AR and DDTree-4/8 were predicted
    within 1 % of each other, and the drafts' calls ran at 0.89x AR's).
    Between those, a choice already run at this load holds for up to `hold` rounds while the load (its band and the
    rows) stays: the rule's host arithmetic runs once in `hold` rounds (1: every round).

    An option's tau (`tau`) is the rank model's prediction now times the option's correction: its own rounds'
    committed tokens over what the model predicted for them when they were chosen (exponentially weighted,
    `correction_halflife` of its rounds), the ratio 1 counted as `correction_weight` streams; a tree's shrunk toward
    the trees' common correction (`correction`, `tree_weight`). The rank model reads the trees' rounds only (`ranked`:
    a chain's rounds, which start after the chain's own misses, would move it with the option that runs). It assumes
    a tree holds the most likely rank paths, and a round starts where the previous one missed; the correction takes up
    what that misses, a bias of the model's per option, while the model itself follows the text's difficulty for every
    option at once (a hard stretch lowers them all; it does not make the option that ran through it look worse than
    one last measured on easy text). A DDTree round corrects every smaller tree option too, from what each would have
    accepted on the round's own drafter rows (`smaller_tree_accepts`, observe's `others`), so a tree run at a load
    teaches the smaller ones without running them.

    Where prompts wait (choose's `queued`), an option's rate counts its joins: every stream a round ends takes a
    prompt, whose prefill the batch waits for. `join_cost` is what they took a committed token under that option at
    the load (`joined` charges each join to the option whose round freed the slots; observe's `queued` counts the
    tokens), so a draft that ends many streams at once, joined in one larger forward, is credited for it."""

    def __init__(self, candidates: Sequence[int], *, block_size: int, chain: bool = True, cost: RoundCost | None = None,
                 prior: float = 0.7, prior_weight: float = 4.0, halflife: float = 64.0, refresh_every: int = 32,
                 refresh_within: float = 0.85, refit_every: int = 32, correction_weight: float = 8.0,
                 correction_halflife: float = 128.0, hold: int = 4, stay_within: float = 0.05, persist: int = 4,
                 young_within: float = 0.5, tree_weight: float = 32.0):
        if block_size < 2:
            raise ValueError(f"LoadBudget: block_size must be >= 2 (the drafter's block), not {block_size}")
        bad = [b for b in candidates if int(b) < 1]
        if bad:
            raise ValueError(f"LoadBudget: candidate budgets must be >= 1 node, not {bad}")
        self.block_size = block_size
        self.options: list[Choice] = [Choice("tree", b) for b in sorted({int(b) for b in candidates}, reverse=True)]
        if chain:
            self.options.append(Choice("chain", block_size - 1))
        self.options.append(AR)
        self.cost = cost if cost is not None else MeasuredCost()
        self.acceptance = AcceptanceEstimate(block_size - 1, prior=prior, prior_weight=prior_weight, halflife=halflife)
        self.refresh_every, self.refresh_within, self.prior_weight = refresh_every, refresh_within, prior_weight
        self.history: list[RoundRecord] = []
        self.correction_weight, self.hold, self.stay_within = correction_weight, max(1, int(hold)), stay_within
        self.persist, self.young_within, self.tree_weight = max(1, int(persist)), young_within, tree_weight
        # (load key, option, evaluations in a row it came out ahead of the current choice there, within stay_within)
        self._ahead: tuple[tuple | None, Choice | None, int] = (None, None, 0)
        self._last: Choice | None = None  # the last observed round's choice (a switch: the next one differs)
        # (load key, the last evaluation's choice there): kept unless another beats it clearly
        self._current: tuple[tuple[int, int] | None, Choice | None] = (None, None)
        self._again: tuple[tuple[int, int], Prediction, str] | None = None  # an exploration's second round
        self._correction_decay = 0.5 ** (1.0 / correction_halflife) if correction_halflife > 0 else 1.0
        # option -> decayed [tokens committed, tokens the rank model predicted for them when chosen]
        self._ratio = {c: [0.0, 0.0] for c in self.options}
        self._trees_ratio = [0.0, 0.0]  # the same over every tree round (its own option's tokens)
        self._held: tuple[tuple[int, int], int, Prediction] | None = None  # (load key, round, the best) of the last
        # evaluation
        self._last_run = {c: -1 for c in self.options}  # the last round that measured each option (ran it, or a
        # bigger tree's that measured its tau: observe's others)
        self.refit_every = refit_every
        self._taus: dict[Choice, float] | None = None
        self._stale = 0  # drafted rounds observed since the taus were computed
        self._drafted = 0  # drafted rounds observed
        self._pending: RoundRecord | None = None
        self._tried: set[tuple[int, Choice]] = set()  # (load band, option) run at least once
        self._top_band = 0  # the highest load band a round has run at
        self._calibrating = cost is None or self.cost.measured  # until the calibration has nothing left to measure
        # (load band, option) -> decayed [seconds its joins took, tokens its rounds committed while prompts waited]
        self._joins: dict[tuple[int, Choice], list[float]] = {}
        self._join_decay = 0.5 ** (1.0 / 64)
        # the options whose rounds feed the rank model their ranks: the trees where there are any (`observe`)
        self._feeds = {c for c in self.options if c.kind == "tree"} or {c for c in self.options if c.drafted}

    def ranked(self, choice: Choice) -> bool:
        """Whether a round of `choice` feeds the rank model its drafter ranks (`observe`): a tree's, or, where no tree
        is an option, the chain's. A chain's rounds run the chain's own dynamics (each starts right after a chain's
        miss) and leave its rank statistics elsewhere than a tree's rounds do: fed by them, the model moved with
        whichever option ran, and every other option's correction, learnt against the model as it was, went stale
        (on the toy at one stream the chain, at 0.86x DDTree-16's rate, then held 545-931 of ~1,300 rounds in 2 of
        7 engines). A chain's rounds still teach the chain's own correction."""
        return choice in self._feeds

    def smaller_trees(self, choice: Choice) -> list[Choice]:
        """The tree options a round of `choice` also measures (`observe`'s others): trees of fewer nodes."""
        return [c for c in self.options if c.kind == "tree" and choice.kind == "tree" and c.nodes < choice.nodes]

    # the model
    def raw_taus(self) -> dict[Choice, float]:
        """Each option's tau from the acceptance estimate alone (AR: 1)."""
        stale = self._stale and (self._drafted <= WARM or self._stale >= self.refit_every)
        if self._taus is None or stale:
            self._stale = 0
            trees = [c.nodes for c in self.options if c.kind == "tree"]
            chain, full = self.acceptance.taus(max(trees, default=1))
            self._taus = {c: (1.0 if c.kind == "ar" else chain if c.kind == "chain" else full[c.nodes])
                          for c in self.options}
        return self._taus

    def tau(self, choice: Choice) -> float:
        """The option's tau: the rank model's prediction times the option's correction (AR: 1), a tree's at least
        every smaller tree's (`taus`)."""
        return self.taus()[choice]

    def taus(self) -> dict[Choice, float]:
        """Every option's tau (`tau`). Best-first trees from the same drafter rows are nested, so a tree's walk
        accepts at least what a smaller one's accepts: a tree's tau is at least every smaller tree's (a correction
        learnt on a tree that ran must not put a bigger one that has not run below it)."""
        out, floor = {}, 0.0
        for c in sorted(self.options, key=lambda c: (c.kind != "tree", c.nodes)):
            t = 1.0 if c.kind == "ar" else self.raw_taus()[c] * self.correction(c)
            if c.kind == "tree":
                t = floor = max(t, floor)
            out[c] = t
        return {c: out[c] for c in self.options}  # (in the options' order: AR last)

    def correction(self, choice: Choice) -> float:
        """The option's committed tokens over the rank model's predictions for its rounds (AR: 1). The chain's: the
        ratio 1 counted as `correction_weight` streams at the model's current tau. A tree's: shrunk toward the trees'
        common correction (every tree round's own tokens, the ratio 1 counted as `correction_weight` streams), that
        counted as `tree_weight` (32) streams: the trees share most of the model's bias (on the toy at one stream
        DDTree-8/16/32 ran at 1.06-1.07), and a few dozen rounds of one tree say little of its own part (a round's
        tokens vary by half their mean: on a simulated machine whose rank model is exact, DDTree-16's correction from
        its own rounds alone stood at 0.91, and the rule ran DDTree-8 and the chain at 0.87 of DDTree-16's rate)."""
        if choice.kind == "ar":
            return 1.0
        got, predicted = self._ratio[choice]
        prior = self.correction_weight * self.raw_taus()[choice]
        if choice.kind != "tree":
            return (got + prior) / (predicted + prior)
        g, q = self._trees_ratio  # the trees' common correction, then this tree's own toward it
        common = (g + prior) / (q + prior)
        prior = self.tree_weight * self.raw_taus()[choice]
        return (got + common * prior) / (predicted + prior)

    def predict(self, streams: int, rows: int | None = None, queued: bool = False) -> list[Prediction]:
        """Every option's prediction at `streams` live streams in a round over `rows` batch rows (None: `streams`;
        a measured cost: once calibrated); queued: prompts wait for slots (a round's joins counted)."""
        preds = predictions(streams, self.taus(), self.cost, rows)
        if not queued:
            return preds
        band = self._band(max(int(rows or streams), streams))
        joins = self.join_costs(band)
        return [Prediction(p.choice, p.tau, p.seconds, joins[p.choice] * streams * p.tau) for p in preds]

    def join_cost(self, band: int, choice: Choice) -> float:
        """Join seconds a committed token brings at a load band, for an option's rounds (`join_costs`)."""
        return self.join_costs(band)[choice]

    def join_costs(self, band: int) -> dict[Choice, float]:
        """Every option's join seconds a committed token at a load band: what its joins took over what its rounds
        committed while prompts waited (each stream that ends takes a prompt's prefill; rounds that commit more
        tokens end more streams at once, which join in fewer, larger forwards), the band's mean over every option
        counted as JOIN_PRIOR tokens (0 where the band has no join yet)."""
        here = [v for (b, _), v in self._joins.items() if b == band]
        tokens = sum(v[1] for v in here)
        pooled = sum(v[0] for v in here) / tokens if tokens else 0.0
        out = {}
        for c in self.options:
            secs, toks = self._joins.get((band, c), (0.0, 0.0))
            out[c] = (secs + JOIN_PRIOR * pooled) / (toks + JOIN_PRIOR) if tokens else 0.0
        return out

    def joined(self, choice: Choice, seconds: float, *, rows: int) -> None:
        """Prompts joined for `seconds` (their prefills: the target's, or the drafter's read of them), charged to
        `choice` at the load of `rows` batch rows: the option whose round freed their slots (or, for the drafter's
        read, the drafted option that read them)."""
        acc = self._joins.setdefault((self._band(max(1, int(rows))), choice), [0.0, 0.0])
        acc[0] += float(seconds)

    def choose(self, streams: int, rows: int | None = None, queued: bool = False) -> Choice:
        """The draft for this round's `streams` live streams (host arithmetic); appends its record to `history`.
        rows: the batch rows the round computes (its slots, free ones included: the cost's load; None: `streams`).
        queued: prompts wait for slots (the streams this round ends are refilled: its joins are counted)."""
        if streams < 1:
            raise ValueError(f"LoadBudget.choose: streams must be >= 1, not {streams}")
        rows = max(int(rows or streams), streams)
        n = len(self.history)
        explore, pred = None, None
        key = (self._band(streams), rows, queued)
        refresh = bool(self.refresh_every and n and n % self.refresh_every == 0)
        todo = self._calibration(streams, rows)
        held = self._held
        again, self._again = self._again, None
        if todo:
            pick, explore = todo[0], "calibration"
        elif again is not None and again[0] == key:  # an exploration's second round: its first was a switch
            pred, explore = again[1], again[2]
            pick = pred.choice
        elif held is not None and held[0] == key and n - held[1] < self.hold and not refresh:
            pred = held[2]  # the last evaluation's best, at this load
            pick = pred.choice
        else:
            preds = self.predict(streams, rows, queued)
            pred = self._settle(key, streams, preds)
            self._current = (key, pred.choice)
            self._held = (key, n, pred)
            explored = self._explore(streams, rows, preds, pred, refresh)
            if explored is not None:
                pred, explore = explored
            if explore is not None or (self._band(rows), pred.choice) not in self._tried:
                self._held = None  # (an exploring round, or a choice not yet run at this load: evaluated again)
            if explore is not None:  # run twice: a round after its like measures the option's steady cost
                self._again = (key, pred, explore)
            pick = pred.choice
        rec = RoundRecord(n, int(streams), pick, None if pred is None else pred.tau,
                          None if pred is None else pred.seconds,
                          None if pred is None else streams * pred.tau / pred.seconds, explore,
                          predicted_join_s=None if pred is None else pred.joins,
                          model_taus=self.raw_taus() if pick.drafted else None)
        self.history.append(rec)
        self._pending = rec
        return pick

    def _settle(self, key: tuple, streams: int, preds: list[Prediction]) -> Prediction:
        """An evaluation's choice at `key` (its load): the best predicted rate, but the current choice while the best
        is within `stay_within` of it (unless the same option has come out ahead at every one of the last `persist`
        evaluations there: noise does not persist), and AR unless a draft beats it by more than `stay_within` (a
        draft's tau and cost are estimates, AR's tau is 1)."""
        pred = best(streams, preds)
        # (the current choice at this load; at another load the choice is made afresh)
        cur = next((p for p in preds if p.choice == self._current[1]), None) if self._current[0] == key else None
        if cur is not None and pred.rate(streams) <= (1 + self.stay_within) * cur.rate(streams):
            ahead = pred.choice != cur.choice and pred.rate(streams) > cur.rate(streams)
            count = self._ahead[2] + 1 if ahead and self._ahead[:2] == (key, pred.choice) else int(ahead)
            self._ahead = (key, pred.choice, count) if ahead else (None, None, 0)
            if not ahead or count < self.persist:
                pred = cur
        plain = preds[-1]  # AR (last)
        if pred.choice.drafted and pred.rate(streams) <= (1 + self.stay_within) * plain.rate(streams):
            pred = plain
        return pred

    def _explore(self, streams: int, rows: int, preds: list[Prediction], pred: Prediction,
                 refresh: bool) -> tuple[Prediction, str] | None:
        """A load or refresh exploration round instead of the evaluation's choice `pred` (the class docstring), as
        (its prediction, "load" or "refresh"), or None."""
        floor = max(self.refresh_within * pred.rate(streams), preds[-1].rate(streams))  # never below AR (last)
        near = sorted((p for p in preds if p.choice != pred.choice and p.rate(streams) >= floor),
                      key=lambda p: -p.rate(streams))
        band = self._band(rows)
        # a load above every one measured so far (a run's tail, where streams end, is not explored again)
        if self.cost.measured and band >= self._top_band:
            # (AR, the floor the rule must never fall below, is cheap to measure: always among them)
            ar = [p for p in preds if p.choice == AR and p.choice != pred.choice and p not in near]
            # (and, where no drafted round has run at this load, the best drafted option: the fit's extrapolation
            # from other loads does not rule drafting out before one round here measures it)
            probe = ([max((p for p in preds if p.choice.drafted), key=lambda p: p.rate(streams))]
                     if not any((band, c) in self._tried for c in self.options if c.drafted)
                     and any(c.drafted for c in self.options) else [])
            fresh = [p for p in near + ar + probe if (band, p.choice) not in self._tried]
            if fresh:
                return fresh[0], "load"
        if not refresh:
            return None
        # (an option measured little is refreshed from further below: one or two rounds, a switch's among them, can
        # price it a quarter too dear on a CPU, and then it would never run again to say otherwise)
        young = [p for p in preds if p.choice != pred.choice and p not in near and self._young(p.choice, rows)
                 and p.rate(streams) >= max(self.young_within * pred.rate(streams), preds[-1].rate(streams))]
        if not near and not young:
            return None
        return min(near + young, key=lambda p: (self._last_run[p.choice], -p.choice.tokens)), "refresh"

    def _young(self, choice: Choice, rows: int) -> bool:
        """Measured too little to rule out: its cost at these rows not settled (RoundCost.settled), or, a draft, its
        correction from fewer than correction_weight streams' rounds (decayed)."""
        if not self.cost.settled(rows, choice):
            return True
        return choice.drafted and self._ratio[choice][1] < self.correction_weight * self.raw_taus()[choice]

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def _band(streams: int) -> int:
        """The load band of a stream count (bands 25 % apart: 1, 2, 3, 4, 5, 6-7, 8-9, …)."""
        return round(math.log(streams) / math.log(1.25))

    def _calibration(self, streams: int, rows: int) -> list[Choice]:
        """The options a measured cost still has to measure at this load, fewest tokens first: those without a
        measured round, less those that cannot win. A round's cost does not fall with more verified tokens, nor from
        drafting, so an option costs at least what any measured option with no more tokens (and no draft where it
        drafts none) costs; one whose rate at that cost is below the best measured rate is left out."""
        if not self._calibrating:
            return []
        todo = [c for c in self.options if self.cost.rounds(c) < 1]
        done = [c for c in self.options if self.cost.rounds(c) >= 1]
        if todo and done:
            taus = {p.choice: p.tau for p in self.predict(streams, rows)}
            secs = {c: self.cost.seconds(rows, c) for c in done}
            top = max(streams * taus[c] / secs[c] for c in done)
            keep = []
            for c in todo:
                floor = max((secs[m] for m in done if m.tokens <= c.tokens and (c.drafted or not m.drafted)), default=0)
                if not floor or streams * taus[c] / floor >= top:
                    keep.append(c)
            todo = keep
        self._calibrating = bool(todo)
        return sorted(todo, key=lambda c: c.tokens)

    def observe(self, choice: Choice, *, streams: int, seconds: float, accepted: Sequence[int],
                ranks: Sequence[Sequence[int]] | None = None, rows: int | None = None,
                others: Mapping[Choice, Sequence[float]] | None = None, queued: bool = False) -> None:
        """The round's outcome: its wall `seconds` (of a round over `rows` batch rows: None, `streams`; 0: not
        measured, as a drafted round after AR rounds, which reads the rows they queued: a switch's cost), per stream
        the tokens it kept (the bonus token included; a stream's output cut at its stop token or its max_new_tokens
        keeps only those: the rate the rule weighs is of the outputs) and
        per stream the drafter ranks of the target's tokens at each depth along the accepted path and at the first
        rejected depth (lists, or one array [streams, depths] with -1 past each stream's last depth, as the round's
        host read gives them; None for AR rounds; a drafted round without them still updates its option's correction, so
        a loop that cannot carry the ranks gets each option's measured tau on the prior's shape).
        others: for a DDTree round, the smaller tree options -> per stream the tokens each would have kept from this
        round's drafter rows (`smaller_tree_accepts`: the bonus token included, cut as the outputs were); their
        corrections learn from the round as their own rounds would, without running. (Not the chain: its rounds start
        after its own misses, harder positions than a tree's rounds start at; on the toy, the chain read off DDTree-16
        rounds' ranks kept 5.0 tokens a round where DFlash's own rounds keep 4.2, while DDTree-4 read off the same
        rounds kept 3.22 against its own 3.21.)
        queued: prompts waited when the round ran (its tokens count in its option's `join_cost`)."""
        if choice not in self._ratio:
            raise ValueError(f"LoadBudget.observe: {choice} is not one of this controller's options")
        if len(accepted) != streams:
            raise ValueError(f"LoadBudget.observe: {len(accepted)} accepted counts for {streams} streams")
        if ranks is not None and len(ranks) != streams:
            raise ValueError(f"LoadBudget.observe: {len(ranks)} rank lists for {streams} streams")
        rec = self._pending if self._pending is not None and self._pending.choice == choice else None
        self._pending = None
        self._last_run[choice] = rec.round if rec is not None else len(self.history) - 1
        for option in others or {}:  # (its tau measured by this round too: a refresh goes to the options it did not
            # measure, the bigger trees, which a smaller one's rounds cannot)
            self._last_run[option] = self._last_run[choice]
        rows = max(int(rows or streams), streams)
        if seconds > 0 or not self.cost.measured:  # (0: a round not measured, e.g. a switch: tried again)
            self._tried.add((self._band(rows), choice))
        self._top_band = max(self._top_band, self._band(rows))
        self.cost.observe(rows, choice, seconds, switch=choice != self._last)
        self._last = choice
        if rec is not None:
            rec.seconds, rec.tokens = float(seconds), int(sum(accepted))
        if queued:  # (its joins, `joined`, are over the tokens of its rounds that ran while prompts waited)
            acc = self._joins.setdefault((self._band(rows), choice), [0.0, 0.0])
            acc[0] *= self._join_decay
            acc[1] = acc[1] * self._join_decay + float(sum(accepted))
        if not choice.drafted:
            return
        # the correction: tokens committed over the model's tau for them when chosen (exponentially weighted over
        # this option's own rounds; a tree's round also over every tree's: the trees' common correction)
        taus = rec.model_taus if rec is not None and rec.model_taus is not None else self.raw_taus()
        d = self._correction_decay
        sums = [(self._ratio[o], kept, taus[o]) for o, kept in ((choice, accepted), *(others or {}).items())]
        if choice.kind == "tree":
            sums.append((self._trees_ratio, accepted, taus[choice]))
        for acc, kept, tau in sums:
            acc[0] = acc[0] * d + float(sum(kept))
            acc[1] = acc[1] * d + streams * tau
        if ranks is not None and self.ranked(choice):
            self.acceptance.decay_round()
            if hasattr(ranks, "shape"):  # an array [streams, depths], -1 past each stream's last depth
                self.acceptance.add_rows(ranks)
            else:
                self.acceptance.add(*ranks)
            self._stale += 1
            self._drafted += 1

    def summary(self, since: int = 0) -> dict[str, Any]:
        """For the diagnosis, against the load: per stream count, the rounds, the choices made (label -> rounds) and
        the mean predicted and measured tokens/s of its rounds (exploration rounds included) from round `since` on
        (a call's own, where the controller outlives calls); the model's current taus, corrections and cost."""
        loads: dict[int, dict[str, Any]] = {}
        history = self.history[since:]
        for r in history:
            row = loads.setdefault(r.streams, {"rounds": 0, "choices": {}, "_p": [], "_m": []})
            row["rounds"] += 1
            row["choices"][r.choice.label] = row["choices"].get(r.choice.label, 0) + 1
            if r.predicted_tok_s is not None:
                row["_p"].append(r.predicted_tok_s)
            if r.tok_s is not None:
                row["_m"].append(r.tok_s)
        for row in loads.values():
            p, m = row.pop("_p"), row.pop("_m")
            row["predicted_tok_s"] = sum(p) / len(p) if p else None
            row["measured_tok_s"] = sum(m) / len(m) if m else None
        return {"rounds": len(history), "loads": {k: loads[k] for k in sorted(loads)},
                "explore": {k: sum(r.explore == k for r in history) for k in ("calibration", "load", "refresh")},
                "tau": {c.label: t for c, t in self.raw_taus().items()},
                "correction": {c.label: self.correction(c) for c in self.options},
                "cost": self.cost.describe()}
