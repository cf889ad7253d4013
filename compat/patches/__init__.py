"""One module per patch; each exposes `PATCH` (a `compat.registry.Patch`) and the functions it installs.

Patch modules import transformers/torch inside their install functions, never at import time, so
`python -m compat` and the table itself stay cheap to load.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..registry import PatchUnavailable

# Private package name under which ddtree.upstream.loader imports the DDTree authors' modules.
UPSTREAM_PACKAGE = "_ddtree_upstream"


def resolve(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value) for "module:Qual.name"; PatchUnavailable when absent."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as exc:
        raise PatchUnavailable(f"{module} cannot be imported here ({exc})") from None
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise PatchUnavailable(f"{module}:{qualname} does not exist here")
    if not hasattr(owner, name):
        raise PatchUnavailable(f"{module}:{qualname} does not exist here")
    return owner, name, getattr(owner, name)


def rebind_partials(
    patcher: Any, module: Any, names: tuple[str, ...], original: Any, replacement: Any
) -> list[str]:
    """Point module-level `functools.partial`s built over `original` at `replacement` (restored on revert).

    transformers caches `partial(_process_flash_attention_kwargs, supports_mapping=...)` when a flash
    kernel is first loaded; a partial made before apply() would otherwise keep the unpatched function.
    """
    import functools

    rebound = []
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, functools.partial) and value.func is original:
            patcher.set_attr(module, name, functools.partial(replacement, *value.args, **value.keywords))
            rebound.append(name)
    return rebound
