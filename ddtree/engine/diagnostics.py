"""Per-round records for the diagnosis (`python -m ddtree.diagnose`): where the target's tokens sat in the drafter's
distributions, and how often the drafter's top-1 agreed with the target on and off its own top-1 chain.

What a round adds (DFlash, DDTree and any proposer exposing `last_logits`, the drafter's [L, V] logits of the round;
row d drafts depth d + 1):

* `vocab`: the drafter's vocabulary size (the ranks past RANK_CAP spread over it in the model);
* `depth`: the accepted depth a (draft tokens the target accepted, before any stop or max_new_tokens cut);
* `ranks`, `probs`: at each depth 1 … min(a + 1, L) along the accepted path and one position past it, the rank of
  the target's token in the drafter's row (0 = the drafter's top-1; RANK_CAP = beyond the top RANK_CAP) and the
  drafter's probability of it (in PROB_SCALE-ths);
* branching trees whose every node's target choice was computed (not a CPU's lazy head, which computes the walked
  rows only), summed over the generation in `nodes`: per depth, for every verified node, whether its path left the
  drafter's top-1 chain above it (off-path), whether it is the drafter's top-1 at its own depth, and whether the
  target agreed (its token is the target's choice after its parent).

Cost, on every device: a round adds 8 small kernels (the path's ranks) and about 22 more for the node table, and no
host read; `finish()` reads everything once per generation (one transfer). Nothing here changes what is decoded.
"""

from __future__ import annotations

import math

import torch

RANK_CAP = 32  # ranks 0 … RANK_CAP - 1 are kept; RANK_CAP means "beyond"
PROB_SCALE = 1000  # probabilities are stored as integers in thousandths
FORMAT = 1  # the record's layout version
# `nodes` table columns: index = off_path * 4 + top1 * 2 + agreed (per depth row); counts of verified nodes
NODE_COLUMNS = 8


class RoundRecorder:
    """Collects one generation's per-round diagnosis on the device; `finish()` returns it as plain lists."""

    def __init__(self) -> None:
        self._depths: list[int] = []
        self._lengths: list[int] = []
        self._ranks: list[torch.Tensor] = []  # per round: [m, 2] float (rank, log-prob)
        self._nodes: torch.Tensor | None = None  # [L + 1, NODE_COLUMNS] float counts
        self._vocab = 0

    @torch.inference_mode()
    def round(self, logits: torch.Tensor, tree, path: torch.Tensor, accepted: int, next_root: torch.Tensor,
              choice: torch.Tensor | None) -> None:
        """One round: the drafter's `logits` [L, V], the verified `tree`, the accepted `path` (flat indices, on the
        device), its accepted depth, the target's token after it, and the target's choice after every node (None
        where the round did not compute it: a CPU's lazy head; the node table then skips the round)."""
        L = logits.shape[0]
        self._vocab = logits.shape[1]
        m = min(accepted + 1, L)
        self._depths.append(accepted)
        self._lengths.append(m)
        if m > 0:
            toks = torch.cat([tree.tokens[path[1:]], next_root.reshape(1).to(tree.tokens.device)])[:m]
            rows = logits[:m]
            own = rows.gather(1, toks.to(rows.device)[:, None])  # [m, 1] the target's token's logit
            rank = (rows > own).sum(1)
            logp = own[:, 0] - rows.logsumexp(1)
            self._ranks.append(torch.stack([rank.float(), logp], 1))
        if not tree.is_chain and choice is not None:
            self._count_nodes(logits, tree, choice)

    def _count_nodes(self, logits: torch.Tensor, tree, choice: torch.Tensor) -> None:
        L = logits.shape[0]
        dev = tree.tokens.device
        chosen = choice.to(dev)
        depth = tree.depths
        top1 = logits.argmax(-1).to(dev)  # [L]
        is_top1 = (tree.tokens == top1[(depth - 1).clamp(min=0)]) | (depth == 0)
        aidx = tree.ancestor_index()  # [n, bound + 1], column 0 the node itself, the root past the top
        on_chain_above = is_top1[aidx[:, 1:]].all(1) if aidx.shape[1] > 1 else torch.ones_like(is_top1)
        parent = tree.parents.clamp(min=0)
        agreed = tree.tokens == chosen[parent]
        valid = depth > 0
        key = depth.clamp(max=L) * NODE_COLUMNS + (~on_chain_above).long() * 4 + is_top1.long() * 2 + agreed.long()
        if self._nodes is None or self._nodes.device != dev:
            self._nodes = torch.zeros((L + 1) * NODE_COLUMNS, device=dev)
        self._nodes.index_add_(0, key, valid.float())

    def finish(self) -> dict:
        """The generation's record, read from the device in one transfer: see the module docstring for the fields."""
        parts = [t.reshape(-1) for t in self._ranks]
        if self._nodes is not None:
            parts.append(self._nodes.to(parts[0].device) if parts else self._nodes)
        flat = torch.cat(parts).tolist() if parts else []
        n_ranks = 2 * sum(self._lengths)
        rows, nodes = flat[:n_ranks], flat[n_ranks:]
        ranks, probs, i = [], [], 0
        for m in self._lengths:
            seg = rows[i: i + 2 * m]
            i += 2 * m
            ranks.append([min(int(r), RANK_CAP) for r in seg[0::2]])
            probs.append([round(PROB_SCALE * math.exp(lp)) for lp in seg[1::2]])
        out = {"format": FORMAT, "rank_cap": RANK_CAP, "prob_scale": PROB_SCALE, "vocab": self._vocab,
               "depth": self._depths, "ranks": ranks, "probs": probs}
        if self._nodes is not None:
            out["nodes"] = [[round(v) for v in nodes[j: j + NODE_COLUMNS]] for j in range(0, len(nodes), NODE_COLUMNS)]
        return out
