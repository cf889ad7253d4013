"""Tree-exact Gated DeltaNet: verify a whole draft tree in one forward, then commit the accepted path exactly.

Upstream GDN layers (qwen3_5, qwen3_5_moe, qwen3_next) ignore the 4-D tree mask and run the flat
token order as one chain, so every node whose flat predecessors are not all its ancestors gets a
wrong conv window and a wrong recurrent state. Inside ``tree_verification(tree)`` (the one
verification context, ddtree.engine.verification) the patched forward computes, for every node, what
its root-to-node path would compute as a plain sequence after the cached prefix, and leaves the cache's
conv/recurrent state untouched; ``commit_linear_states(cache, accepted)`` then moves each GDN layer to
the state after prefix + accepted path. `TargetSession` installs the forward wrapper itself (engine
correctness, not a compat row); it is inert outside a verification.

The per-layer work is `tree_layer`: pure tensor code over the layer's inputs, the round's `TreeMeta`
(conv-window index, decay map and mask: tensors built once per round on the device, shared by every
layer) and the layer's `LayerConsts` (its weights in the layouts the math wants, built once per cache).
It compiles with torch.compile(fullgraph=True); eager, it dispatches 4 fused ops after the input projections
(decays, conv, q/k norm, solve: ddtree.engine.kernels.gdn, one Triton kernel each on CUDA, on the CPU the torch ops
it ran before them) and 1 for the gated output norm (docs/gdn-tree.md counts them).

The math (per value head, q and k l2-normalised, q scaled by dk^-1/2):

    S_i   = exp(g_i) * S_parent(i) + beta_i k_i d_i^T
    d_i   = v_i - k_i^T exp(g_i) S_parent(i)            (delta_i = beta_i d_i)
    o_i   = q_i^T S_i

Unrolled along a path with path-cumulative log decay c_i = sum of g over root..i:

    S_a = exp(c_a) S_0 + sum_{j on path(a)} exp(c_a - c_j + log beta_j) k_j d_j^T

so a node's output and the committed state need only (k_j, d_j) of its ancestors, the log weights
c_a - c_j + log beta_j and c_a, plus S_0 (the cache's state, never overwritten during verification).
Both come out of one small matmul: with s = the path sums of softplus(a + dt) and A = exp(A_log) (g = -A *
softplus), X_i = (s_i, A, 1) and Y_j = (-A, s_j, log beta_j) give X_i . Y_j = c_i - c_j + log beta_j, and the
virtual node j = 0 (Y_0 = (-A, 0, 0)) gives c_i. X . Y (three products, elementwise) plus the ancestor mask
(0 / -inf) and one exp give E = [exp(c_i) | exp(c_i - c_j) beta_j masked]. No float32 matmul rounds the path sums
(hundreds) before that difference: the map's matmul is exact under TF32 and bf16 precision too
(`kernels.gdn.exact_sign_mm`), X . Y and the commit's weights are elementwise. Two ways to get d for every node:

* ``"chunk"``: one chunk holding the whole tree, whose causal masks are ancestor masks:
  (I + (K K^T * E)) d = v - exp(c) (K S_0), strictly lower triangular in flat order (parents first), so a
  node's row touches only its ancestors: each row solves its own path.
* ``"recurrent"``: the recurrence above, one batched step per depth level (every node computed,
  the level's nodes kept: no host-side level lists).

Modules, one job each: `patch` (the classes, the compat row's install, held per engine), `meta` (the round's TreeMeta),
`buffers` (a layer's constants and buffers, and those a cache shares across its layers), `layer` (`tree_layer`, the
per-layer math the eager and the compiled round both run), `forward` (the patched forward: the tree forward, and
the single-token step's entry), `step` (the CPU single-token step), `commit` (the states after the accepted path)
and `slots` (a batched cache's rows: a stream's prefilled state seated in its slot, a free slot zeroed).

A batch of streams (the batched round, ddtree.engine.batch): inside ``tree_verification(batch_tree)`` (a
`BatchTree`, N rows of T padded nodes) a forward of [N, T] tokens over a cache of N rows verifies every stream's
tree from its own row's conv and recurrent state in the same batched ops (TreeMeta then holds a decay map, mask
and conv windows per stream: `TreeMeta.streams` = N); ``commit_linear_states_batch(cache, path, lengths)`` then
moves each row to its own prefix + accepted path (ragged paths, one pass for every stream and like layer).
"""

from __future__ import annotations

from ddtree.engine.gdn.buffers import (
    _MODEL_DTYPE,
    L2NORM_EPS,
    LayerBuffers,
    LayerConsts,
    _buffer_shapes,
    _fill_gates,
    layer_consts,
    new_buffers,
)
from ddtree.engine.gdn.commit import (
    _PENDING_ATTR,
    _path_states,
    commit_linear_states,
    commit_linear_states_batch,
    path_weights,
)
from ddtree.engine.gdn.forward import single_step
from ddtree.engine.gdn.layer import DEFAULT_METHOD, tree_layer
from ddtree.engine.gdn.meta import TreeMeta, meta_tensors, tree_meta
from ddtree.engine.gdn.patch import (
    TARGETS,
    VERSIONS,
    ensure_installed,
    hold,
    holders,
    install,
    is_installed,
    provided,
    release,
    target_classes,
    uninstall,
)
from ddtree.engine.gdn.slots import (
    copy_linear_states,
    ensure_linear_states,
    seat_linear_states,
    zero_linear_states,
)
from ddtree.engine.verification import GDN_METHODS as METHODS
from ddtree.engine.verification import tree_verification

__all__ = ["DEFAULT_METHOD", "L2NORM_EPS", "METHODS", "TARGETS", "VERSIONS", "LayerBuffers", "LayerConsts", "TreeMeta",
           "commit_linear_states", "commit_linear_states_batch", "copy_linear_states", "ensure_installed",
           "ensure_linear_states", "hold", "holders", "install", "is_installed", "layer_consts",
           "meta_tensors", "new_buffers", "path_weights", "provided", "release", "seat_linear_states", "single_step",
           "target_classes",
           "tree_layer", "tree_meta", "tree_verification", "uninstall", "zero_linear_states",
           # what the compiled round (ddtree.engine.compiled) lays out as the eager round does
           "_MODEL_DTYPE", "_PENDING_ATTR", "_buffer_shapes", "_fill_gates", "_path_states"]
