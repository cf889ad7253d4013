"""Random-weight DFlash2 checkpoints in the public layout for tests, and from-scratch references of what the
selector computes (written from the format's formulas, independently of ddtree.engine.selector)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from ddtree.engine.drafter.dflash2 import DFlash2Drafter


def save_random_dflash2(target, directory: str | Path, *, block_size: int = 8, top_k: int = 4, rank: int = 8,
                        seed: int = 0, **kwargs) -> Path:
    """A random DFlash2 drafter for `target` saved as published: config.json (architectures DFlash2DraftModel, the
    DFlash2 keys in dflash_config, `is_causal: false` as z-lab's configs declare) and model.safetensors."""
    drafter = DFlash2Drafter.random_for_target(target.config, block_size=block_size, selector_top_k=top_k,
                                               selector_rank=rank, seed=seed, **kwargs)
    drafter.config.is_causal = False
    drafter.save_pretrained(directory)
    return Path(directory)


def conv_reference(x: torch.Tensor, base: torch.Tensor, proj: torch.Tensor, source: torch.Tensor, side: int,
                   group: int) -> torch.Tensor:
    """out_t[c] = sum_o (base[side, o, c] + dyn_t[side, o, c // group]) * x_{t-o}[c] with x before the block = 0,
    dyn_t = (proj @ source_t) viewed [2, taps, H / group]: one row, one channel at a time. x, source [q, H]."""
    q, h = x.shape
    taps = base.shape[1]
    out = torch.zeros_like(x)
    for t in range(q):
        dyn = (proj @ source[t]).view(2, taps, h // group)
        for c in range(h):
            out[t, c] = sum((base[side, o, c] + dyn[side, o, c // group]) * x[t - o, c]
                            for o in range(taps) if t - o >= 0)
    return out


def pair_score(drafter: DFlash2Drafter, logits: torch.Tensor, hidden: torch.Tensor, t: int, a: int, b: int) -> float:
    """S_t(a, b) = logit_t(b) + sum_r P[a, r] (W h_t)_r Q[b, r], in float64."""
    sel = drafter.candidate_selector
    wh = sel.hidden_projection.weight.double() @ hidden[t].double()
    return float(logits[t, b]) + float((sel.predecessor_codebook[a].double() * wh * sel.successor_codebook[b].double()).sum())


def pair_logprob(drafter: DFlash2Drafter, logits: torch.Tensor, hidden: torch.Tensor, t: int, a: int, b: int) -> float:
    """log p_t(b | a): exp S_t(a, b) over the sum of exp S_t(a, c) for the candidates c and exp logit_t(v) for every
    other token v, in float64, token by token."""
    cands = candidates_of(logits, drafter.config.selector_top_k)[t]
    terms = [pair_score(drafter, logits, hidden, t, a, c) for c in cands]
    terms += [float(logits[t, v]) for v in range(logits.shape[1]) if v not in cands]
    m = max(terms)
    return pair_score(drafter, logits, hidden, t, a, b) - m - math.log(sum(math.exp(s - m) for s in terms))


def candidates_of(logits: torch.Tensor, k: int) -> list[list[int]]:
    """Each position's k best tokens (ties: the lower id)."""
    return [sorted(range(logits.shape[1]), key=lambda v: (-float(row[v]), v))[:k] for row in logits]


def walk_reference(drafter: DFlash2Drafter, logits: torch.Tensor, hidden: torch.Tensor, anchor: int) -> list[int]:
    """The selector's greedy walk: at each position the candidate of highest S_t(prev, .)."""
    cands, prev, out = candidates_of(logits, drafter.config.selector_top_k), anchor, []
    for t, cs in enumerate(cands):
        prev = max(cs, key=lambda b: pair_score(drafter, logits, hidden, t, prev, b))
        out.append(prev)
    return out


def pair_paths_reference(drafter: DFlash2Drafter, logits: torch.Tensor, hidden: torch.Tensor, anchor: int,
                         budget: int) -> set[tuple[int, ...]]:
    """The `budget` best token paths (every prefix of every candidate path enumerated) under the sum of pair
    log-probabilities: the node set a best-first pair tree must select."""
    cands = candidates_of(logits, drafter.config.selector_top_k)

    def logp(t: int, a: int, b: int) -> float:
        return pair_logprob(drafter, logits, hidden, t, a, b)

    scored = {}
    for depth in range(1, len(cands) + 1):
        for path in itertools.product(*cands[:depth]):
            prev = scored[path[:-1]] if depth > 1 else 0.0
            scored[path] = prev + logp(depth - 1, path[-2] if depth > 1 else anchor, path[-1])
    ranked = sorted(scored, key=lambda p: (-scored[p], len(p)))
    return set(ranked[:budget])
