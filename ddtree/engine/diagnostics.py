"""Per-round records for the diagnosis (`python -m ddtree.diagnose`): where the target's tokens sat in the drafter's
distributions, and how often the drafter's top-1 agreed with the target on and off its own top-1 chain.

What a round adds (DFlash, DDTree and any proposer exposing `last_logits`, the drafter's [L, V] logits of the round,
or the rows its `record_logits` gives; row d drafts depth d + 1):

* `vocab`: the drafter's vocabulary size (the ranks past RANK_CAP spread over it in the model);
* `depth`: the accepted depth a (draft tokens the target accepted, before any stop or max_new_tokens cut);
* `ranks`, `probs`: at each depth 1 … min(a + 1, L) along the accepted path and one position past it, the rank of
  the target's token in the drafter's row (0 = the drafter's top-1; RANK_CAP = beyond the top RANK_CAP) and the
  drafter's probability of it (in PROB_SCALE-ths);
* `costs`: the same tokens' drafter cost (minus the log-probability), in COST_SCALE-ths of a nat (the tree replay
  compares it with the rows below);
* `rows`: each of the L rows' costs at the SKETCH ranks (its best-first order: a few points of each sorted row), in
  COST_SCALE-ths of a nat: a DFlash row does not depend on the path, so a DDTree tree of any budget is rebuilt from them;
* `tail`: per row, the costs of its mean logit (about rank V / 2) and of its last rank (V - 1), in COST_SCALE-ths of a
  nat: where a flat row goes past the sketch;
* at temperature T > 0, `tcosts`: the path's tokens' costs under the drafter's distribution at T (what a DFlash chain
  sampling at T draws them with), and `temperature`;
* `scores` (only where not "marginal"): what the rows score: "pair", a DFlash2 selector's log-softmax over each
  position's candidates given the target's previous token (its chain and pair trees: the proposer's `record_logits`,
  ddtree.engine.selector.path_pair_rows), where the marginal rows are the drafter's per-position distributions;
* `tree`: the largest verified tree's nodes besides the root (the budget run; None for a chain);
* `need`: for a round whose tree carries its best-first scores (DDTree), for each accepted node, the smallest budget
  whose best-first tree holds it (its place in the best-first order, 1-based); None for a chain;
* branching trees whose every node's target choice was computed (not a CPU's lazy head, which computes the walked
  rows only), summed over the generation in `nodes`: per depth, for every verified node, whether its path left the
  drafter's top-1 chain above it (off-path), whether it is the drafter's top-1 at its own depth, and whether the
  target agreed (its token is the target's choice after its parent).

Cost, on every device: a round adds 15 small kernels (16 for a tree: the path's ranks and costs, the rows' top-16
and ends; a tree's scores are kept as they are, its `need` worked out in `finish`), about 22 more for the node
table, and no host read; `finish()` reads everything once per generation (one transfer). Nothing here changes what is
decoded.
"""

from __future__ import annotations

import numpy as np
import torch

RANK_CAP = 32  # ranks 0 … RANK_CAP - 1 are kept; RANK_CAP means "beyond"
PROB_SCALE = 1000  # probabilities are stored as integers in thousandths
COST_SCALE = 1000  # costs (minus log-probabilities) are stored as integers in thousandths of a nat
# the ranks of each row whose costs are kept (a sketch of the sorted row; the replay interpolates in log rank)
SKETCH = (0, 1, 2, 3, 5, 7, 11, 15)
FORMAT = 2  # the record's layout version (2: costs, rows, tail, need, tree; tcosts at T > 0)
# `nodes` table columns: index = off_path * 4 + top1 * 2 + agreed (per depth row); counts of verified nodes
NODE_COLUMNS = 8


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on `device` (and in `dtype`), without dispatching a no-op cast where it is there already."""
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device, dtype) if dtype is not None else t.to(device)


class RoundRecorder:
    """Collects one generation's per-round diagnosis on the device; `finish()` returns it as plain lists."""

    def __init__(self, temperature: float = 0.0, scores: str = "marginal") -> None:
        """temperature > 0: also record the path's tokens' costs under the drafter's tempered distribution (`tcosts`:
        what a DFlash chain sampling at that temperature draws them with). scores: what the rows score ("pair": a
        DFlash2 selector's pair scores given the target's path, ddtree.engine.selector; the record says so)."""
        self._temperature = float(temperature)
        self._scores = scores
        self._depths: list[int] = []
        self._parts: list[torch.Tensor] = []  # per round, flat: [m, 2] (rank, cost), [L, S] row costs, tree scores, path
        self._shape: list[tuple[int, ...]] = []  # per round: m, L, sketch points, tree scores kept (0: none), depth
        self._nodes: torch.Tensor | None = None  # [L + 1, NODE_COLUMNS] float counts
        self._vocab = 0
        self._tree = 0  # the largest verified tree's nodes (the budget run), 0 for chains

    @torch.inference_mode()
    def round(self, logits: torch.Tensor, tree, path: torch.Tensor, accepted: int, next_root: torch.Tensor,
              choice: torch.Tensor | None, top1: torch.Tensor | None = None) -> None:
        """One round: the drafter's `logits` [L, V], the verified `tree`, the accepted `path` (flat indices, on the
        device), its accepted depth, the target's token after it, and the target's choice after every node (None
        where the round did not compute it: a CPU's lazy head; the node table then skips the round). top1: per node,
        whether it is the drafter's choice after its parent, where that depends on the parent (a DFlash2 selector's
        pair scores: ddtree.engine.selector); None: the drafter's top-1 at the node's depth."""
        L, V = logits.shape
        self._vocab = V
        m = min(accepted + 1, L)
        self._depths.append(accepted)
        toks = torch.cat([tree.tokens[path[1:]], _on(next_root.reshape(1), tree.tokens.device)])[:m]
        lp = torch.log_softmax(logits, 1)  # [L, V] (one op; cheaper than logsumexp and a subtraction on a CPU)
        rows = lp[:m]
        index = _on(toks, rows.device)[:, None]
        own = rows.gather(1, index)  # [m, 1] the target's token's log-probability
        rank = (rows > own).sum(1, keepdim=True)
        k = min(SKETCH[-1] + 1, V)
        # [L, k + 2]: each row's top k log-probabilities (`finish` keeps the SKETCH ranks of them), then, past them
        # (where a flat row goes on), its mean (about rank V / 2) and its last rank's; costs are their negatives
        pts = torch.cat([lp.topk(k, dim=1).values, lp.mean(1, keepdim=True), lp.amin(1, keepdim=True)], 1)
        parts = [torch.cat([rank.float(), own.neg()], 1).reshape(-1), pts.neg().reshape(-1)]
        if self._temperature > 0:  # minus the drafter's tempered log-probability of the path's tokens
            hot = logits[:m] / self._temperature
            parts.append((hot.logsumexp(1, keepdim=True) - hot.gather(1, index)).reshape(-1))
        n_tree = 0
        if tree.scores is not None and not tree.is_chain:  # DDTree: its scores place the accepted nodes (in finish)
            n_tree = tree.scores.shape[0]
            parts += [_on(tree.scores, logits.device, torch.float32), _on(path[1:accepted + 1], logits.device, torch.float32)]
        self._parts.append(torch.cat(parts))
        self._shape.append((m, L, k, n_tree, accepted))
        if not tree.is_chain:
            self._tree = max(self._tree, len(tree) - 1)
        if not tree.is_chain and choice is not None:
            self._count_nodes(logits, tree, choice, top1)

    def _count_nodes(self, logits: torch.Tensor, tree, choice: torch.Tensor, given: torch.Tensor | None) -> None:
        L = logits.shape[0]
        dev = tree.tokens.device
        chosen = _on(choice, dev)
        depth = tree.depths
        if given is not None:
            is_top1 = _on(given, dev)
        else:
            # the drafter's top-1 at each node's depth: row d - 1 for depth d >= 1; the root (depth 0) reads its own
            # token, so it counts as a top-1 (as the chain above every node starts there)
            top1 = torch.cat([tree.tokens[:1], _on(logits.argmax(-1), dev)])  # [L + 1]
            is_top1 = tree.tokens == top1[depth]
        aidx = tree.ancestor_index()  # [n, bound + 1], column 0 the node itself, the root past the top
        on_chain_above = is_top1[aidx[:, 1:]].all(1) if aidx.shape[1] > 1 else torch.ones_like(is_top1)
        agreed = tree.tokens == chosen[tree.parents.clamp(min=0)]
        # column off_path * 4 + top1 * 2 + agreed of the depth's row, in place on one integer tensor
        key = torch.add(agreed, depth.clamp(max=L), alpha=NODE_COLUMNS)
        key.add_(is_top1, alpha=2).add_(on_chain_above.logical_not(), alpha=4)
        if self._nodes is None or self._nodes.device != dev:
            self._nodes = torch.zeros((L + 1) * NODE_COLUMNS, device=dev)
        self._nodes.index_add_(0, key, depth.clamp(max=1).to(self._nodes.dtype))  # the root (depth 0) adds nothing

    def finish(self) -> dict:
        """The generation's record, read from the device in one transfer: see the module docstring for the fields."""
        parts = list(self._parts)
        if self._nodes is not None:
            parts.append(self._nodes.to(parts[0].device) if parts else self._nodes)
        flat = np.asarray(torch.cat(parts).tolist() if parts else [], dtype=np.float64)  # the one transfer
        whole = flat.astype(np.int64).tolist()  # ranks and counts
        milli = np.rint(COST_SCALE * flat).astype(np.int64).tolist()  # costs
        permille = np.rint(PROB_SCALE * np.exp(-np.clip(flat, 0.0, None))).astype(np.int64).tolist()  # probabilities
        sketch = [r for r in SKETCH if r < min(SKETCH[-1] + 1, self._vocab)]  # of the top-k kept a round
        ranks, probs, costs, starts, tcosts, need, i = [], [], [], [], [], [], 0
        for m, L, s, n_tree, a in self._shape:
            ranks.append([min(r, RANK_CAP) for r in whole[i: i + 2 * m: 2]])
            probs.append(permille[i + 1: i + 2 * m: 2])
            costs.append(milli[i + 1: i + 2 * m: 2])
            i += 2 * m
            starts.append(i)  # the round's [L, s + 2] block: its top-s costs, then its mean's and last rank's
            i += (s + 2) * L
            if self._temperature > 0:
                tcosts.append(milli[i: i + m])
                i += m
            if not n_tree:
                need.append(None)
                continue
            scores, idx = flat[i: i + n_tree], whole[i + n_tree: i + n_tree + a]
            i += n_tree + a
            # a node's place in the best-first order (1-based, the root ahead of every node): by score, equal scores
            # in the flat layout's order (depth-major, best first within a depth)
            place = np.empty(n_tree, dtype=np.int64)
            place[np.argsort(-scores, kind="stable")] = np.arange(n_tree)
            need.append(place[idx].tolist())
        nodes = flat[i:].tolist()
        rows, tails = [], []
        if self._shape:  # every round's block at once: L and s are the generation's
            _, L, s, _, _ = self._shape[0]
            block = np.asarray(starts)[:, None] + np.arange(0, (s + 2) * L, s + 2)[None, :]  # [rounds, L]
            cost = np.rint(COST_SCALE * flat).astype(np.int64)
            rows = cost[block[:, :, None] + np.asarray(sketch)].tolist()
            tails = cost[block[:, :, None] + np.array([s, s + 1])].tolist()
        out = {"format": FORMAT, "rank_cap": RANK_CAP, "prob_scale": PROB_SCALE, "cost_scale": COST_SCALE,
               "sketch": sketch, "vocab": self._vocab, "tree": self._tree or None,
               "depth": self._depths, "ranks": ranks, "probs": probs, "costs": costs, "rows": rows, "tail": tails,
               "need": need}
        if self._temperature > 0:
            out.update(temperature=self._temperature, tcosts=tcosts)
        if self._scores != "marginal":
            out["scores"] = self._scores
        if self._nodes is not None:
            out["nodes"] = [[round(v) for v in nodes[j: j + NODE_COLUMNS]] for j in range(0, len(nodes), NODE_COLUMNS)]
        return out
