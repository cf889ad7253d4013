"""Draft trees of many streams at once (the batched round, ddtree.engine.batch): one padded tensor per field,
a row per stream, so a round's ops do not grow with the number of streams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchTree", "BatchWalk"]


@dataclass
class BatchTree:
    """N streams' trees, padded to T nodes. Row i is stream i's tree in DraftTree's flat order (node 0 the root,
    parents[i, j] < j). A padding node (valid False) is a child of the root at depth 1 holding token 0: every
    forward treats it as a node, the walk never accepts it.

    tokens, parents (root: -1), depths: long [N, T]; valid: bool [N, T] (the first sizes[i] nodes of row i);
    sizes: long [N]; ancestors: bool [N, T, T] (ancestors[i, a, b]: b is a or an ancestor of a; padding: self and
    the root); is_chain: every row a chain (the first sizes[i] nodes in order); depth_bound: host int, an upper
    bound on every depth."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    sizes: torch.Tensor
    ancestors: torch.Tensor
    is_chain: bool = False
    depth_bound: int = 0

    @property
    def streams(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass
class BatchWalk:
    """The accepted paths of one batched round, read from the device once for every stream.

    path: long [N, K] flat node indices root first, padded with the path's last node; lengths: long [N] nodes on
    each path (root included: tokens committed = lengths); next_root: long [N] the target's token after each path's
    end; tokens: host lists, per stream the accepted draft tokens then the bonus token."""

    path: torch.Tensor
    lengths: torch.Tensor
    next_root: torch.Tensor
    tokens: list[list[int]]
