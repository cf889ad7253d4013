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


def _block_positions(batch):
    """(b, j, t, anchor, previous true token, label) of every labelled position of a BlockBatch, in order."""
    B, n, L = batch.labels.shape
    ids = batch.block_ids.view(B, n, batch.block_size)
    for b in range(B):
        for j in range(n):
            for t in range(L):
                y = int(batch.labels[b, j, t])
                if y < 0:
                    continue
                prev = int(ids[b, j, 0]) if t == 0 else int(batch.labels[b, j, t - 1])
                yield b, j, t, int(ids[b, j, 0]), prev, y


def _row_scores(drafter: DFlash2Drafter, head: torch.Tensor, row: torch.Tensor, a: int, cands: list[int]
                ) -> tuple[list[float], list[float]]:
    """Float64 logits of one drafter row (every token) and S(a, c) for each candidate c, token by token."""
    sel = drafter.candidate_selector
    row = row.detach()
    logits = (head.double() @ row.double()).tolist()
    wh = sel.hidden_projection.weight.detach().double() @ row.double()
    P, Q = sel.predecessor_codebook.detach().double(), sel.successor_codebook.detach().double()
    scores = [logits[c] + float((P[a] * wh * Q[c]).sum()) for c in cands]
    return logits, scores


def _lse(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def selector_loss_reference(drafter: DFlash2Drafter, head: torch.Tensor, hidden: torch.Tensor, batch, decay: float,
                            *, rule: str = "public", alpha: float = 1.0, inject_gold: bool = True) -> float:
    """The selector's term as the published DFlash2 recipes define it, one position at a time in float64: the label's
    k-way cross-entropy among the top-k of the row's logits (the label in place of the k-th where missing, with
    inject_gold; else the position adds nothing), scored S_t(previous true token, .), weighted exp(-t / decay) for
    the t-th drafted position, over the sum of the weights of every labelled position (rule public) or of the
    positions scored (rule ours), times alpha. A drafter without multiplier or soft cap (the logits are the head's)."""
    k, bs = drafter.config.selector_top_k, batch.block_size
    num = den = scored_den = 0.0
    for b, j, t, _, prev, y in _block_positions(batch):
        w = math.exp(-t / decay)
        row = hidden[b, j * bs + t + 1]
        logits = (head.double() @ row.double()).tolist()
        cands = sorted(range(len(logits)), key=lambda v: (-logits[v], v))[:k]
        den += w
        if y not in cands:
            if not inject_gold:
                continue
            cands[-1] = y
        _, scores = _row_scores(drafter, head, row, prev, cands)
        num += w * (_lse(scores) - scores[cands.index(y)])
        scored_den += w
    return alpha * num / (scored_den if rule == "ours" else den)


def selector_metrics_reference(drafter: DFlash2Drafter, head: torch.Tensor, hidden: torch.Tensor, batch
                               ) -> dict[str, float]:
    """The recipes' DFlash2 metrics, position by position in float64 on the strict top-k (see
    ddtree.train.objective.selector_metrics): recall, mass, unary top-1 accuracy, teacher-forced selector accuracy,
    the self-conditioned walk's accuracy where it reached and its accepted length, the top-k oracle's length."""
    k, bs = drafter.config.selector_top_k, batch.block_size
    n_pos = recall = mass = unary = tf = 0.0
    walks: dict[tuple[int, int], dict] = {}
    for b, j, t, anchor, prev, y in _block_positions(batch):
        row = hidden[b, j * bs + t + 1]
        logits = (head.double() @ row.double()).tolist()
        cands = sorted(range(len(logits)), key=lambda v: (-logits[v], v))[:k]
        lse = _lse(logits)
        n_pos += 1
        recall += y in cands
        mass += sum(math.exp(logits[c] - lse) for c in cands)
        unary += cands[0] == y
        _, s = _row_scores(drafter, head, row, prev, cands)
        tf += cands[max(range(k), key=lambda i: (s[i], -i))] == y
        if t == 0:
            walks[b, j] = {"prev": anchor, "alive": True, "oracle": True, "len": 0, "olen": 0, "reached": 0, "hit": 0}
        w = walks.get((b, j))
        if w is None:
            continue
        _, s = _row_scores(drafter, head, row, w["prev"], cands)
        choice = cands[max(range(k), key=lambda i: (s[i], -i))]
        if w["alive"]:
            w["reached"] += 1
            w["alive"] = choice == y
            w["hit"] += w["alive"]
            w["len"] += w["alive"]
        w["oracle"] = w["oracle"] and y in cands
        w["olen"] += w["oracle"]
        w["prev"] = choice
    blocks = list(walks.values())
    return {"unary_recall": recall / n_pos, "unary_mass": mass / n_pos, "unary_acc": unary / n_pos,
            "selector_acc_tf": tf / n_pos,
            "path_acc": sum(w["hit"] for w in blocks) / max(1, sum(w["reached"] for w in blocks)),
            "path_tau": 1 + sum(w["len"] for w in blocks) / len(blocks),
            "oracle_tau": 1 + sum(w["olen"] for w in blocks) / len(blocks)}
