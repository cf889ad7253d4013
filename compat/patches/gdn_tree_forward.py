"""The engine's tree-exact Gated DeltaNet: every GDN class's forward, wrapped.

Inside the engine's `gdn.tree_verification(...)` (or `gdn.single_step()`) the wrapped forward computes each
tree node against its own ancestors; outside those contexts it calls the original forward unchanged. The
classes are the GDN classes of `ddtree.engine.families` (a test keeps this list and that table equal).

The wrapper is engine code, which compat may not import: the row `needs` it, and `ddtree.engine.gdn.install()`
(run by every engine bound to a hybrid target) hands it over as `provided={"gdn_forward": ...}`. The engine
applies this row whatever compat.only / compat.skip say (a hybrid's tree verification is wrong without it);
`compat.revert()` takes it away, and the next engine bound to a hybrid applies it again.
"""

from __future__ import annotations

from types import ModuleType

from ..core import Patch, Patcher, PatchUnavailable, resolve

ID = "gdn-tree-forward"
# "module:Class.forward" of every GDN class (ddtree.engine.families.gdn_classes)
TARGETS = (
    "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5GatedDeltaNet.forward",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeGatedDeltaNet.forward",
    "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextGatedDeltaNet.forward",
)
# the range the tree-exact GDN is verified on (tests/test_gdn_tree.py): 5.20 has no Cache.get_conv_state,
# 5.40 changes the forward's signature again
VERSIONS = ">=5.21,<5.40"


def install(patcher: Patcher, module: ModuleType | None) -> str:
    wrapper = patcher.provided["gdn_forward"]
    done = []
    for target in TARGETS:
        module_name, qualname = target.split(":")
        try:
            _, _, owner = resolve(module_name, qualname.rsplit(".", 1)[0])
        except PatchUnavailable:
            continue  # a family this transformers does not ship
        patcher.wrap(owner, "forward", wrapper)
        done.append(owner.__name__)
    if not done:
        raise PatchUnavailable("no GDN class exists in this transformers")
    return "wrapped " + ", ".join(done)


PATCH = Patch(
    id=ID,
    targets=TARGETS,
    versions={"transformers": VERSIONS},
    reason="GDN layers ignore the tree mask: verify each draft-tree node against its ancestors' conv window "
    "and recurrent state (inert outside the engine's tree_verification context)",
    install=install,
    needs=("gdn_forward",),
)
