"""Import shims for the names DFlash/DDTree drafter code imports from `modeling_qwen3`.

The authors' drafter module (liranringel/ddtree `model/dflash.py`, z-lab/dflash `dflash/model.py`)
does `from transformers.models.qwen3.modeling_qwen3 import (...)` for ten names. Three of them are
not defined there but merely imported by it (`GradientCheckpointingLayer`, `FlashAttentionKwargs`,
`ALL_ATTENTION_FUNCTIONS`), and one lives in the configuration module (`Qwen3Config`); modeling
files drop such incidental imports when they are regenerated (many 5.x files replaced
`FlashAttentionKwargs` by `TransformersKwargs`). When `modeling_qwen3` is imported, any of those
names it lacks is set from its canonical home, so the authors' import statement keeps working.
On 5.0-5.24 all ten names are present and the shim adds nothing (the report says so).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..core import UPSTREAM, Patch, Patcher

ID = "qwen3-import-shims"
MODULE = "transformers.models.qwen3.modeling_qwen3"

# name -> where it really lives, in order of preference ("module:attribute")
HOMES: dict[str, tuple[str, ...]] = {
    "GradientCheckpointingLayer": ("transformers.modeling_layers:GradientCheckpointingLayer",),
    "FlashAttentionKwargs": (
        "transformers.modeling_flash_attention_utils:FlashAttentionKwargs",
        "transformers.utils:TransformersKwargs",
    ),
    "ALL_ATTENTION_FUNCTIONS": ("transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS",),
    "Qwen3Config": ("transformers.models.qwen3.configuration_qwen3:Qwen3Config",),
}
# names the drafter modules import that are defined in modeling_qwen3 itself (no other home)
DEFINED_THERE = (
    "Qwen3RMSNorm",
    "Qwen3RotaryEmbedding",
    "Qwen3PreTrainedModel",
    "Qwen3MLP",
    "rotate_half",
    "eager_attention_forward",
)


def _lookup(spec: str):
    module_name, attr = spec.split(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        return None


def install(patcher: Patcher, module: ModuleType | None) -> str:
    assert module is not None, "deferred patch: called with the imported module"
    added, unresolved = [], []
    for name, homes in HOMES.items():
        if hasattr(module, name):
            continue
        value = next((v for v in map(_lookup, homes) if v is not None), None)
        if value is None:
            unresolved.append(name)
            continue
        patcher.set_attr(module, name, value)
        added.append(name)
    missing_here = [n for n in DEFINED_THERE if not hasattr(module, n)]
    if unresolved or missing_here:
        raise RuntimeError(
            f"names the drafter imports cannot be provided: {unresolved + missing_here} (renamed in this transformers?)"
        )
    if not added:
        return f"nothing missing: all {len(HOMES) + len(DEFINED_THERE)} names present"
    return "added " + ", ".join(added)


PATCH = Patch(
    id=ID,
    targets=tuple(f"{MODULE}:{name}" for name in HOMES),
    versions={"transformers": ">=5.0"},
    reason="the authors' drafter imports re-exported names from modeling_qwen3 that 5.x files may drop",
    install=install,
    for_engines=frozenset({UPSTREAM}),
    imports=(MODULE,),
)
