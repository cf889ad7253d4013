"""The one tree-verification context: what a target forward over a draft tree needs, set once per verification.

`TargetSession.verify` enters `tree_verification(...)` around the target call; the tree attention
(`ddtree.engine.attention`) and the tree-exact Gated DeltaNet (`ddtree.engine.gdn`) read the same
`TreeVerification` through `active()`. It holds the round's tree and, built once per device on first
use and shared by every layer, the metadata each needs: the attention's masks and block lists (`memo`),
the GDN's conv-window index and decay maps (`ddtree.engine.gdn.TreeMeta`). Nothing here is process-global:
the context lives in a ContextVar for the duration of the `with` block only (while torch.compile traces a graph that
enters one, in `_TRACED`, which dynamo traces and a ContextVar it does not: the compiled batched round).

Which parts are active:
* attention: when `past` (the committed length) is given; the split/flex tree attention then builds its own
  masks. Without it the attention backends run as plain backends (a dense 4-D mask or a causal chain).
* GDN: always, for a forward of `len(tree)` tokens through the installed GDN wrapper; `step=True` instead
  marks one cached token (AR) for the GDN's single-step path.

One tree or a batch of them: `draft` is the engine's DraftTree (one stream, batch 1) or a `BatchTree` (N streams,
the batched round, ddtree.engine.batch: a forward of [N, T] tokens, row i stream i's tree over its own cache row).
`streams` tells them apart: 0 for a DraftTree, N for a BatchTree. The tree-exact GDN reads both (one batched pass,
`ddtree.engine.gdn`); the attention consumers read only a DraftTree (the batched round passes its own 4-D mask).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ddtree.engine.batch_tree import BatchTree
from ddtree.engine.tree import DraftTree

GDN_METHODS = ("chunk", "recurrent")


@dataclass
class TreeVerification:
    """One tree under verification.

    draft: the engine's DraftTree (its tensors stay where they are: no host read), or a BatchTree of N streams.
    past: committed length (absolute position of the root) when the tree attention is active, else None.
    gdn_method: "chunk" (ancestor-masked single chunk) or "recurrent" (one step per depth).
    host_parents: the parents as a host list when the tree was given as one (the GDN commit checks paths with it).
    step: a single cached token (no tree): the GDN's one-step path.
    streams: 0 for a DraftTree (or none), N for a BatchTree of N streams.
    """

    draft: DraftTree | BatchTree | None
    past: int | None = None
    gdn_method: str = "chunk"
    flex_compile: bool = True
    host_parents: list[int] | None = None
    step: bool = False
    streams: int = 0
    _memo: dict = field(default_factory=dict, repr=False)

    # ---- the tree
    @property
    def n(self) -> int:
        """Nodes of the tree ([root] + nodes); of a BatchTree, its padded width T."""
        return self.draft.tokens.shape[1] if self.streams else len(self.draft)

    size = n

    @property
    def depths(self) -> torch.Tensor:
        return self.draft.depths

    @property
    def depth_bound(self) -> int:
        bound = self.draft.depth_bound
        if self.streams:  # (a BatchTree's 0 may mean "not given": a host read, except for roots alone)
            return bound if bound or self.n == 1 else int(self.draft.depths.max())
        return bound if bound is not None else int(self.draft.depths.max())

    @property
    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: j is i or an ancestor of i ([N, T, T] for a BatchTree)."""
        if self.streams:
            return self.draft.ancestors
        return self.memo("ancestors", lambda: self.draft.ancestor_matrix())

    # ---- which consumers are active
    @property
    def attention(self) -> bool:  # (not for a BatchTree: the batched round passes its own 4-D mask)
        return self.past is not None and self.draft is not None and not self.step and not self.streams

    @property
    def gdn(self) -> bool:
        return self.draft is not None and not self.step

    def memo(self, key, build: Callable):
        """Built once per verification, shared by every layer (masks, block lists, GDN metadata)."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = build()
        return found


_ACTIVE: contextvars.ContextVar[TreeVerification | None] = contextvars.ContextVar("ddtree_tree_verification",
                                                                                  default=None)


def _draft_of(tree: DraftTree | BatchTree | torch.Tensor | Sequence[int]) -> tuple[DraftTree | BatchTree,
                                                                                  list[int] | None]:
    """The DraftTree of `tree`; a parents list (tests, the authors' loops) is validated on the host first. A
    BatchTree is taken as it is (its shapes checked: no host read)."""
    if isinstance(tree, DraftTree):
        return tree, None
    if isinstance(tree, BatchTree):
        shape = tuple(tree.tokens.shape)
        if (len(shape) != 2 or not all(tuple(t.shape) == shape for t in (tree.parents, tree.depths, tree.valid))
                or tuple(tree.ancestors.shape) != (*shape, shape[1])):
            raise ValueError(f"tree_verification(BatchTree): tokens, parents, depths and valid must be [N, T] and "
                             f"ancestors [N, T, T]; got tokens {shape}, ancestors {tuple(tree.ancestors.shape)}")
        return tree, None
    if isinstance(tree, torch.Tensor) and tree.ndim != 1:
        raise ValueError("tree_verification(parents): a non-empty 1-D LongTensor of parent indices is required")
    plist = [int(p) for p in (tree.tolist() if isinstance(tree, torch.Tensor) else tree)]
    if not plist or plist[0] != -1 or any(not 0 <= p < i for i, p in enumerate(plist) if i > 0):
        raise ValueError("tree_verification(parents): parents[0] must be -1 (the root) and "
                         "0 <= parents[i] < i for every other node (parents precede children)")
    depth = [0] * len(plist)
    for i in range(1, len(plist)):
        depth[i] = depth[plist[i]] + 1
    n = len(plist)
    draft = DraftTree(tokens=torch.zeros(n, dtype=torch.long), parents=torch.tensor(plist, dtype=torch.long),
                      depths=torch.tensor(depth, dtype=torch.long), is_chain=plist == list(range(-1, n - 1)),
                      depth_bound=max(depth))
    return draft, plist


@contextlib.contextmanager
def tree_verification(tree: DraftTree | BatchTree | torch.Tensor | Sequence[int] | None, past: int | None = None, *,
                      method: str = "chunk", flex_compile: bool | None = None,
                      step: bool = False) -> Iterator[TreeVerification]:
    """While active, a target forward of len(tree) tokens is the flat tree [root] + nodes.

    tree: the engine's DraftTree, or the parents (parents[i] the flat index of node i's parent, -1 for the root
    at index 0; validated on the host), or a BatchTree of N streams (a forward of [N, T] tokens: each stream's
    tree over its own row of the cache; the GDN's `commit_linear_states_batch` commits it). past: the committed length; given, the tree attention is active too.
    method: the GDN's "chunk" or "recurrent". step: one cached token (tree None): the GDN's single-step path.
    flex_compile: compiled flex attention (the engine's `flex_compile` option, passed by its session); None: on CUDA
    only (on the CPU the eager reference: a compile costs minutes there).
    """
    if method not in GDN_METHODS:
        raise ValueError(f"tree_verification(method={method!r}): expected one of {GDN_METHODS}")
    if step:
        ctx = TreeVerification(None, step=True)
    else:
        draft, host_parents = _draft_of(tree)
        compile_flex = draft.tokens.device.type == "cuda" if flex_compile is None else flex_compile
        ctx = TreeVerification(draft, past, method, compile_flex, host_parents,
                               streams=draft.tokens.shape[0] if isinstance(draft, BatchTree) else 0)
    if torch.compiler.is_compiling():  # (a compiled round: dynamo traces no ContextVar; `_TRACED` holds it)
        _TRACED.append(ctx)
        try:
            yield ctx
        finally:
            _TRACED.pop()
        return
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


# the verification a compiled graph's trace is inside (torch.compile traces no ContextVar: the compiled batched round,
# ddtree.engine.batch.CompiledRound, enters its verification inside the graph); empty outside a trace
_TRACED: list[TreeVerification] = []


def active() -> TreeVerification | None:
    """The verification in progress (None outside one)."""
    if torch.compiler.is_compiling():
        return _TRACED[-1] if _TRACED else None
    return _ACTIVE.get()


__all__ = ["GDN_METHODS", "TreeVerification", "active", "tree_verification"]
