"""The GDN class patch: which classes, installing the compat row gdn-tree-forward, and holding it per engine."""

from __future__ import annotations

import importlib
import itertools

from ddtree.engine.families import gdn_classes
from ddtree.engine.gdn.forward import _forward_wrapper

# Verified (tests/test_gdn_tree.py passes) on 5.21.0, 5.21.1, 5.22.0, 5.23.0 and 5.24.0. 5.20 has no
# Cache.get_conv_state; 5.21-5.23 call the cache argument `cache_params`, 5.24 renames it `cache` and
# keeps the old name as an alias until 5.40, where the signature changes again.
VERSIONS = ">=5.21,<5.40"


# (module, qualname) of every GDN forward wrapped; all share one structure. From the family table.
TARGETS: tuple[tuple[str, str], ...] = tuple((path.split(":")[0], path.split(":")[1] + ".forward")
                                             for path in gdn_classes())


def target_classes() -> list[type]:
    """The GDN classes of TARGETS that this transformers install provides."""
    classes = []
    for module_name, qualname in TARGETS:
        class_name = qualname.split(".")[0]
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            classes.append(cls)
    return classes


def install() -> list[str]:
    """Wrap each GDN class's forward through the compat row `gdn-tree-forward` (idempotent; listed by
    `python -m compat`, undone by `uninstall()` or `compat.revert()`). Returns the names of the classes patched."""
    from compat import registry
    from compat.patches import gdn_tree_forward

    entry = registry.apply(patches=(gdn_tree_forward.PATCH,), provided=provided())[0]
    if entry["status"] == "skipped-version":
        from ddtree.errors import ConfigError

        raise ConfigError("method", f"the tree-exact GDN is verified on transformers {VERSIONS} ({entry['detail']})",
                          f"install transformers{VERSIONS}, or use method=ar on this hybrid")
    if entry["status"] not in ("applied", "skipped-absent"):
        raise RuntimeError(f"compat row {gdn_tree_forward.ID}: {entry['status']}: {entry['detail']}")
    return [cls.__name__ for cls in target_classes()] if entry["status"] == "applied" else []


def provided() -> dict[str, object]:
    """What the compat row gdn-tree-forward needs from the engine (for compat.apply(provided=...))."""
    return {"gdn_forward": _forward_wrapper}


def uninstall() -> None:
    """Put back every original forward (idempotent)."""
    from compat import registry
    from compat.patches import gdn_tree_forward

    registry.revert([gdn_tree_forward.ID])


def is_installed() -> bool:
    from compat import registry
    from compat.patches import gdn_tree_forward

    return any(e["id"] == gdn_tree_forward.ID and e["status"] == "applied" for e in registry.report())


# The patch is held by the engines' target bindings: the first hold installs it, the last release (Engine.close(), or
# a binding garbage-collected) restores the classes, unless it was installed before the first hold (by a test, the
# authors' loops or the user: theirs to undo).
_HOLDERS: set[int] = set()
_KEYS = itertools.count()
_OWNED = [False]  # whether the holders installed it (and so uninstall it when the last lets go)


def hold() -> int:
    """Install the patch for one holder until `release(key)` of the key returned (see above)."""
    if not _HOLDERS:
        _OWNED[0] = False
    ensure_installed()
    key = next(_KEYS)
    _HOLDERS.add(key)
    return key


def ensure_installed() -> None:
    """Installed again where something (another holder's owner, compat.revert()) took it away; idempotent."""
    if not is_installed():
        install()
        _OWNED[0] = True


def release(key: int) -> None:
    """One holder lets go; the last one restores the GDN classes' forwards where the holders installed them."""
    _HOLDERS.discard(key)
    if not _HOLDERS and _OWNED[0]:
        _OWNED[0] = False
        uninstall()


def holders() -> int:
    """How many bindings hold the patch now."""
    return len(_HOLDERS)
