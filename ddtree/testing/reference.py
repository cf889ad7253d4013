"""Independent references and scripted proposers shared by engine tests."""

from __future__ import annotations

import copy
import heapq
import math
import random

import numpy as np
import torch
from transformers import DynamicCache

from ddtree.engine.proposers import Proposer
from ddtree.engine.tree import DraftTree, tree_from_parents


def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Plain HF greedy decoding: the reference every method must reproduce at T = 0."""
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         pad_token_id=0, eos_token_id=None)
    return out[0, input_ids.shape[1]:].tolist()


@torch.no_grad()
def sequential_path_logits(model, prefix_ids: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """Each node's logits by running its root-to-node path as a plain sequence after the prefix."""
    cache = DynamicCache(config=model.config)
    model(prefix_ids, cache=cache, use_cache=True)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    rows = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        c = copy.deepcopy(cache)
        ids = torch.tensor([path[::-1]], device=prefix_ids.device)
        pos = torch.arange(prefix_ids.shape[1], prefix_ids.shape[1] + len(path), device=ids.device)[None]
        rows.append(model(ids, position_ids=pos, cache=c, use_cache=True).logits[0, -1])
    return torch.stack(rows)


def best_first_reference(root: int, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The best-first draft tree, slowly and obviously: a Python heap. The definition every build reproduces exactly.

    - A value is read as a log-probability: NaN counts as -inf, a positive value as 0.
    - Position d's ranks (it drafts depth d + 1): its values from the largest, equal values by token id.
    - A node's score: the float32 sum of its path's values, root to node, left to right.
    - The nodes in order: score descending, then the shallower, then the parent earlier in this order, then the
      lower rank. A child never precedes its parent nor a sibling its elder, so the first `budget` nodes (fewer where
      fewer prefixes exist) form a tree: a heap popping the best candidate and pushing its next sibling and first
      child yields them in this order.
    - Flat layout: the root (score 0), then depth by depth, each depth in that order.
    """
    rows = [[float("-inf") if math.isnan(x) else min(x, 0.0) for x in row]
            for row in logprobs.detach().float().cpu().tolist()]  # Python floats hold float32 values exactly
    ranked = [sorted(range(len(row)), key=lambda t, row=row: (-row[t], t)) for row in rows]
    L, V = len(rows), len(rows[0])

    def value(d: int, r: int) -> np.float32:
        return np.float32(rows[d][ranked[d][r]])

    heap = [(-value(0, 0), 1, -1, 0)]  # (minus the score, depth, the parent's pop index (-1: the root), rank)
    popped = []  # (depth, parent pop index, rank, score)
    while heap and len(popped) < budget:
        neg, d, parent, r = heapq.heappop(heap)
        score = -neg
        popped.append((d, parent, r, score))
        base = popped[parent][3] if parent >= 0 else np.float32(0)
        if r + 1 < V:  # the next sibling
            heapq.heappush(heap, (-(base + value(d - 1, r + 1)), d, parent, r + 1))
        if d < L:  # the first child
            heapq.heappush(heap, (-(score + value(d, 0)), d + 1, len(popped) - 1, 0))
    layout = sorted(range(len(popped)), key=lambda v: (popped[v][0], v))
    flat = {v: i + 1 for i, v in enumerate(layout)}
    tokens, parents, depths, scores = [int(root)], [-1], [0], [0.0]
    for v in layout:
        d, parent, r, score = popped[v]
        tokens.append(ranked[d - 1][r])
        parents.append(flat[parent] if parent >= 0 else 0)
        depths.append(d)
        scores.append(float(score))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores, dtype=torch.float32), depth_bound=max(depths))


def walk_reference(tree: DraftTree, choice: torch.Tensor) -> tuple[list[int], list[int]]:
    """(path, tokens) of the walk, obviously: from the root, the child carrying the target's choice, while there is one.

    tokens: the accepted draft tokens, then the target's choice after the path's end."""
    tokens, parents, want = tree.tokens.tolist(), tree.parents.tolist(), choice.tolist()
    path = [0]
    while kids := [i for i in range(len(tokens)) if parents[i] == path[-1] and tokens[i] == want[path[-1]]]:
        assert len(kids) == 1, "siblings carry distinct tokens"
        path.append(kids[0])
    return path, [tokens[i] for i in path[1:]] + [want[path[-1]]]


def rejection_reference(drafted: list[int], p_rows: list[list[float]], q_rows: list[list[float]],
                        rng: random.Random) -> list[int]:
    """Speculative sampling of a sampled chain, slowly and obviously (Leviathan et al. 2023; Chen et al. 2023): the
    round's new tokens. drafted[i] was drawn from q_rows[i]; p_rows[i] is the target's distribution after the chain's
    first i drafts (len(drafted) + 1 rows). Accept drafted[i] with probability min(1, p(x) / q(x)); at the first
    rejection draw from max(0, p - q) normalised and stop; after the whole chain draw one more from the last p."""
    out = []
    for x, p, q in zip(drafted, p_rows, q_rows, strict=False):
        if rng.random() < p[x] / q[x]:
            out.append(x)
            continue
        residual = [max(0.0, a - b) for a, b in zip(p, q, strict=True)]
        return out + rng.choices(range(len(p)), weights=residual)
    return out + rng.choices(range(len(p_rows[-1])), weights=p_rows[len(drafted)])


def tree_paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    scores = tree.scores.tolist() if tree.scores is not None else [0.0] * len(tokens)
    res = {}
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        res[tuple(path[::-1])] = scores[i]
    return res


def eagle_tree_reference(logits_after, k: int, steps: int, budget: int) -> dict[tuple[int, ...], float]:
    """The EAGLE(-2) tree, slowly: every frontier node's children are the top-k of `logits_after(path)` (the head or
    drafter recomputed from scratch along the node's own path), the next frontier the k best children by cumulative
    log-probability, the kept nodes the `budget` best of all. Returns path -> cumulative score (as `tree_paths`)."""
    nodes, frontier = [((), 0.0)], [0]  # (path tokens, cumulative score); the root first
    for _ in range(steps):
        cands = []
        for i in frontier:
            path, score = nodes[i]
            vals, idx = torch.log_softmax(logits_after(list(path)), -1).topk(k)
            for v, t in zip(vals.tolist(), idx.tolist(), strict=True):
                nodes.append(((*path, t), score + v))
                cands.append(len(nodes) - 1)
        frontier = sorted(cands, key=lambda i: -nodes[i][1])[:k]
    best = sorted(range(1, len(nodes)), key=lambda i: -nodes[i][1])[:budget]
    return {nodes[i][0]: nodes[i][1] for i in best}


def random_tree(n: int, vocab: int, rng: random.Random, max_children: int = 3, root: int = 0) -> DraftTree:
    """A random branching tree with shuffled flat order (parents still first)."""
    nodes = [(-1, root, 0)]  # (parent, token, depth)
    while len(nodes) < n:
        p = rng.randrange(len(nodes))
        used = {t for (q, t, _) in nodes if q == p}
        if len(used) >= min(max_children, vocab):
            continue
        t = rng.choice([x for x in range(vocab) if x not in used])
        nodes.append((p, t, nodes[p][2] + 1))
    # reorder by depth with random ties, remapping parents
    order = sorted(range(n), key=lambda i: (nodes[i][2], rng.random() if i else -1))
    where = {old: new for new, old in enumerate(order)}
    toks = [nodes[i][1] for i in order]
    pars = [where[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order]
    return tree_from_parents(toks, pars)


class ScriptedProposer(Proposer):
    """Knows the true continuation; hides it on a non-first sibling among decoys, at random depths.

    Exercises deep acceptance and non-contiguous KV compaction without a trained drafter.
    """

    def __init__(self, reference: list[int], vocab: int, seed: int = 0, depth: int = 6, decoys: int = 2,
                 miss_rate: float = 0.25):
        self.reference, self.vocab, self.depth, self.decoys = reference, vocab, depth, decoys
        self.miss_rate = miss_rate
        self.rng = random.Random(seed)
        self.max_nodes = 1 + depth * (1 + 2 * decoys)  # the root; per true token: it, its decoys and their children

    def propose(self, state) -> DraftTree:
        rng = self.rng
        pos = len(state.generated)
        truth = self.reference[pos: pos + rng.randint(0, self.depth)]
        if truth and rng.random() < self.miss_rate:  # a wrong token somewhere on the true path
            k = rng.randrange(len(truth))
            truth = truth[:k] + [(truth[k] + 1) % self.vocab]
        nodes = [(-1, int(state.root), 0)]
        cur = 0
        for tok in truth:
            kids = []
            for _ in range(self.decoys):
                d = rng.randrange(self.vocab)
                if d != tok and d not in [k for k, _ in kids]:
                    kids.append((d, False))
            kids.insert(rng.randint(1, len(kids)) if kids else 0, (tok, True))
            nxt = cur
            for t, true in kids:
                nodes.append((cur, t, nodes[cur][2] + 1))
                if true:
                    nxt = len(nodes) - 1
                elif rng.random() < 0.5:  # a decoy grandchild
                    nodes.append((len(nodes) - 1, rng.randrange(self.vocab), nodes[cur][2] + 2))
            cur = nxt
        n = len(nodes)
        order = sorted(range(n), key=lambda i: (nodes[i][2], rng.random() if i else -1))
        where = {old: new for new, old in enumerate(order)}
        toks = [nodes[i][1] for i in order]
        pars = [where[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order]
        return tree_from_parents(toks, pars, device=state.root.device)
