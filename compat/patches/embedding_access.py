"""Embedding access: `target.model.embed_tokens` / `target.lm_head` on wrappers that nest them.

DFlash-style code reads the target's input embeddings as `target.model.embed_tokens` and its head
as `target.lm_head`. Multimodal wrappers nest the text model one level deeper
(`Qwen3_5ForConditionalGeneration.model` is a `Qwen3_5Model` whose `.language_model` owns
`embed_tokens`), so the access raises AttributeError. The fix is a fallback `__getattr__` on those
classes: only when normal lookup fails, `embed_tokens` resolves through `get_input_embeddings()`
and `lm_head` through `get_output_embeddings()` (then the nested language model's). Nothing changes
for attributes that exist, and the fallback never recurses into itself.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from ..core import UPSTREAM, Patch, Patcher, PatchUnavailable, resolve

ID = "embedding-access"

# (module, class, names resolved by the fallback)
CLASSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Model", ("embed_tokens",)),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeModel", ("embed_tokens",)),
    ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel", ("embed_tokens",)),
    ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel", ("embed_tokens",)),
    ("transformers.models.muse_glimmer.modeling_muse_glimmer", "MuseGlimmerModel", ("embed_tokens",)),
    # a wrapper whose head lives on a nested causal LM: target.lm_head -> language_model.lm_head
    (
        "transformers.models.nemotron_h_omni.modeling_nemotron_h_omni",
        "NemotronH_Omni_Reasoning_V3",
        ("lm_head",),
    ),
)

_RESOLVERS = {"embed_tokens": "get_input_embeddings", "lm_head": "get_output_embeddings"}
_resolving = threading.local()


def resolve_nested(instance: Any, name: str) -> Any:
    """The module `name` stands for on `instance`, found through its embedding accessors, or None."""
    accessor = _RESOLVERS[name]
    candidates = [instance]
    nested = instance.__dict__.get("_modules", {}).get("language_model")
    if nested is not None:
        candidates.append(nested)
    for owner in candidates:
        try:
            found = getattr(owner, accessor)()
        except (AttributeError, NotImplementedError):
            found = None
        if found is not None and found is not instance:
            return found
    return None


def make_fallback(names: tuple[str, ...]):
    """A wrapt wrapper for `__getattr__` that resolves `names` when normal lookup fails."""
    wanted = frozenset(names)

    def embedding_fallback(wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        except AttributeError:
            name = args[0] if args else kwargs.get("name")
            if name not in wanted or getattr(_resolving, "active", False):
                raise
            _resolving.active = True  # the accessors probe `getattr(self, name)`; they must see it missing
            try:
                found = resolve_nested(instance, name)
            finally:
                _resolving.active = False
            if found is None:
                raise
            return found

    return embedding_fallback


def install(patcher: Patcher, module: ModuleType | None) -> str:
    done, absent = [], []
    for module_name, class_name, names in CLASSES:
        try:
            _, _, cls = resolve(module_name, class_name)
        except PatchUnavailable:
            absent.append(class_name)
            continue
        patcher.wrap(cls, "__getattr__", make_fallback(names))
        done.append(f"{class_name}.{'/'.join(names)}")
    if not done:
        raise PatchUnavailable(f"none of the wrapper classes exist here: {absent}")
    detail = "fallback on " + ", ".join(done)
    return detail + (f" (absent here: {', '.join(absent)})" if absent else "")


PATCH = Patch(
    id=ID,
    targets=tuple(f"{m}:{c}.__getattr__" for m, c, _ in CLASSES),
    versions={"transformers": ">=5.0"},
    reason="multimodal wrappers nest the text model: target.model.embed_tokens raises AttributeError",
    install=install,
    for_engines=frozenset({UPSTREAM}),
)
