"""The patch registry: a declarative table of version-gated monkeypatches, applied and reverted as a unit.

Each `Patch` names what it replaces (`targets`), the installed package versions it is for
(`versions`, PEP 440 specifiers), an optional runtime `condition`, a one-line `reason`, and an
`install(patcher, module)` function that makes every change through a `Patcher`, which records how
to undo it. `apply()` evaluates the table and installs what is in range; `revert()` undoes
everything, restoring the original objects (identity, not just equality).

Statuses (stable; they go to MLflow tags and summary.json):

* ``applied``           installed in this process.
* ``pending``           in range; waits for a module that is not imported yet (post-import hook).
* ``skipped-version``   an installed package is outside the patch's specifier.
* ``skipped-absent``    a package the patch is for is not installed, or its target does not exist.
* ``skipped-config``    left out by ``only=`` / ``skip=``.
* ``skipped-condition`` its runtime condition is false (e.g. a CUDA machine for a CPU-only fix).
* ``failed``            installing raised; the detail holds the error and nothing of it stays installed.

Wrappers act only while their patch is applied: a copy of a wrapper made while patched (a
`from x import f` in code imported meanwhile) calls straight through to the original after revert.

The record of what is applied (`_STATE`) is the one piece of global mutable state the project allows.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

APPLIED = "applied"
PENDING = "pending"
SKIPPED_VERSION = "skipped-version"
SKIPPED_ABSENT = "skipped-absent"
SKIPPED_CONFIG = "skipped-config"
SKIPPED_CONDITION = "skipped-condition"
FAILED = "failed"
STATUSES = (APPLIED, PENDING, SKIPPED_VERSION, SKIPPED_ABSENT, SKIPPED_CONFIG, SKIPPED_CONDITION, FAILED)

VersionLookup = Callable[[str], "str | None"]
InstallFn = Callable[["Patcher", "ModuleType | None"], "str | None"]

_MISSING = object()


class PatchUnavailable(Exception):
    """Raised by an install function when its target does not exist here (reported as skipped-absent)."""


class CompatConfigError(ValueError):
    """A user-fixable mistake in the compat settings (e.g. an unknown patch id in `compat.only`)."""


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Patch:
    """One row of the table. `targets` are "module:qualname" strings of every object replaced."""

    id: str
    targets: tuple[str, ...]
    versions: Mapping[str, str]
    reason: str
    install: InstallFn
    condition: Callable[[], bool] | None = None
    condition_doc: str = ""
    imports: tuple[str, ...] = ()  # install once each of these modules is imported (post-import hook)

    @property
    def target(self) -> str:
        return ", ".join(self.targets)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "target": self.target,
            "targets": list(self.targets),
            "versions": dict(self.versions),
            "condition": self.condition_doc,
            "reason": self.reason,
        }


def gate(patch: Patch, version_of: VersionLookup = installed_version) -> tuple[str, str] | None:
    """(status, detail) when the installed versions rule `patch` out, None when it is in range."""
    for dist, spec in patch.versions.items():
        found = version_of(dist)
        if found is None:
            return SKIPPED_ABSENT, f"{dist} is not installed"
        try:
            in_range = SpecifierSet(spec).contains(Version(found), prereleases=True)
        except (InvalidSpecifier, InvalidVersion) as exc:
            return FAILED, f"bad version data for {dist} ({found!r} vs {spec!r}): {exc}"
        if not in_range:
            return SKIPPED_VERSION, f"{dist} {found} is outside {spec}"
    return None


class Patcher:
    """Makes a patch's changes and remembers how to undo each one, so revert restores the originals."""

    def __init__(self, patch_id: str, active: Callable[[], bool] | None = None):
        self.patch_id = patch_id
        self._undo: list[Callable[[], None]] = []
        self._live = [True]
        # Wrappers call through to the original whenever this is false. Copies of a wrapper that
        # escaped revert (`from x import f` while patched) then behave like the original again.
        self.active = active or (lambda: self._live[0])

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> Any:
        """Wrap `owner.name` with a wrapt wrapper `wrapper(wrapped, instance, args, kwargs)`.

        When `owner.name` is already this patch's wrapper (a `from x import f` copy of a patched `f`),
        it is left as is and revert sets it back to the original function.
        """
        current = getattr(owner, name)
        if getattr(current, "_self_compat_patch", None) == self.patch_id:
            original = current.__wrapped__
            self._undo.append(lambda: setattr(owner, name, original))
            return current
        own = vars(owner).get(name, _MISSING)
        active = self.active

        def gated(wrapped, instance, args, kwargs):
            if active():
                return wrapper(wrapped, instance, args, kwargs)
            return wrapped(*args, **kwargs)

        proxy = wrapt.wrap_function_wrapper(owner, name, gated)
        proxy._self_compat_patch = self.patch_id
        self._undo.append(functools.partial(_restore_attr, owner, name, own))
        return proxy

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name = value`; revert restores the old value, or removes the name if it had none."""
        own = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)
        self._undo.append(functools.partial(_restore_attr, owner, name, own))

    def set_item(self, mapping: Any, key: Any, value: Any) -> None:
        """Set `mapping[key] = value`; revert restores the old entry, or deletes the key."""
        old = mapping.get(key, _MISSING)
        mapping[key] = value
        self._undo.append(functools.partial(_restore_item, mapping, key, old))

    def on_revert(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def undo(self) -> None:
        self._live[0] = False
        while self._undo:
            self._undo.pop()()


def _restore_attr(owner: Any, name: str, own: Any) -> None:
    if own is _MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, own)


def _restore_item(mapping: Any, key: Any, old: Any) -> None:
    if old is _MISSING:
        mapping.pop(key, None)
    else:
        mapping[key] = old


@dataclass
class _State:
    status: str
    detail: str
    patcher: Patcher | None = None
    modules: dict[str, ModuleType] = field(default_factory=dict)  # deferred patches: module patched, by name
    alive: list[bool] = field(
        default_factory=lambda: [True]
    )  # post-import hooks check this; revert clears it


_STATE: dict[str, _State] = {}
_LOCK = threading.RLock()


# --------------------------------------------------------------------------- the table


@functools.cache
def table() -> tuple[Patch, ...]:
    """The patches, in application order (wrappers of one target nest in this order)."""
    from .patches import (
        cache_crop,
        cache_kwarg,
        embedding_access,
        flash_s_aux,
        hybrid_cache,
        qwen3_import_shims,
        sliding_window,
        upstream_gdn_tree,
        upstream_timer,
    )

    rows = [
        cache_kwarg.PATCH,
        hybrid_cache.PATCH,
        cache_crop.PATCH,
        embedding_access.PATCH,
        flash_s_aux.PATCH,
        sliding_window.PATCH,
        qwen3_import_shims.PATCH,
        upstream_timer.PATCH,
        upstream_gdn_tree.PATCH,
    ]
    gdn = external_patch("gdn-tree-verify", "compat.gdn_tree")
    if gdn is not None:
        rows.append(gdn)
    return tuple(rows)


def external_patch(patch_id: str, module_name: str) -> Patch | None:
    """A table row for a patch module exposing install() / uninstall() / VERSIONS / REASON, if it exists.

    The module is imported here, once, when the table is first built; an import error becomes a row
    that fails at apply time (so a broken patch module shows in the report instead of breaking compat).
    """
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        mod = importlib.import_module(module_name)
        versions = {"transformers": str(mod.VERSIONS)}
        reason = str(mod.REASON)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        error = f"{module_name} could not be loaded: {type(exc).__name__}: {exc}"

        def broken(patcher: Patcher, module: ModuleType | None) -> str:
            raise RuntimeError(error)

        return Patch(patch_id, (module_name,), {}, error, broken)

    def install(patcher: Patcher, module: ModuleType | None) -> str | None:
        owner = getattr(mod, "is_installed", None)
        already = bool(owner and owner())
        result = mod.install()
        if not already:  # installed by someone else first (e.g. the engine): theirs to undo
            patcher.on_revert(mod.uninstall)
        if isinstance(result, (list, tuple)):
            return "patched " + ", ".join(map(str, result)) if result else "nothing to patch here"
        return result if isinstance(result, str) else None

    targets = tuple(
        t if isinstance(t, str) else ":".join(map(str, t))
        for t in getattr(mod, "TARGETS", (f"{module_name}:install",))
    )
    return Patch(patch_id, targets, versions, reason, install)


def by_id(patches: Iterable[Patch] | None = None) -> dict[str, Patch]:
    return {p.id: p for p in (table() if patches is None else patches)}


# --------------------------------------------------------------------------- apply / revert / report


def apply(
    only: Iterable[str] | None = None,
    skip: Iterable[str] | None = None,
    *,
    version_of: VersionLookup | None = None,
    patches: Iterable[Patch] | None = None,
) -> list[dict[str, Any]]:
    """Install every patch of the table that is in range, selected and whose condition holds.

    Idempotent: a patch already applied (or pending) is left alone, so calling apply() again with a
    wider selection only adds patches; use revert() to take some away. `version_of` replaces the
    installed-version lookup (tests); `patches` replaces the table (tests).
    Returns the report for the table, in table order.
    """
    rows = tuple(table() if patches is None else patches)
    known = {p.id for p in rows}
    only_set = None if only is None else set(only)
    skip_set = set(skip or ())
    for setting, ids in (("compat.only", only_set or set()), ("compat.skip", skip_set)):
        unknown = sorted(ids - known)
        if unknown:
            raise CompatConfigError(
                f"{setting}: unknown patch id(s) {unknown} — known ids: {sorted(known)} (python -m compat lists them)"
            )
    lookup = version_of or installed_version
    with _LOCK:
        for patch in rows:
            state = _STATE.get(patch.id)
            if state is not None and state.status in (APPLIED, PENDING):
                if not _stale(state):
                    continue
                _drop(patch.id)
            if (only_set is not None and patch.id not in only_set) or patch.id in skip_set:
                _STATE[patch.id] = _State(SKIPPED_CONFIG, "left out by compat.only / compat.skip")
                continue
            ruled_out = gate(patch, lookup)
            if ruled_out is not None:
                _STATE[patch.id] = _State(*ruled_out)
                continue
            if patch.condition is not None:
                try:
                    holds = bool(patch.condition())
                except Exception as exc:  # noqa: BLE001 - reported
                    _STATE[patch.id] = _State(FAILED, f"condition raised {type(exc).__name__}: {exc}")
                    continue
                if not holds:
                    _STATE[patch.id] = _State(SKIPPED_CONDITION, f"condition false: {patch.condition_doc}")
                    continue
            if patch.imports:
                _defer(patch)
            else:
                _STATE[patch.id] = _install(patch, None, _State(APPLIED, ""))
        return report(rows)


def revert() -> list[str]:
    """Undo every installed patch, newest first, restoring the original objects. Returns the ids undone."""
    with _LOCK:
        undone = []
        for patch_id in reversed(list(_STATE)):
            if _STATE[patch_id].status in (APPLIED, PENDING):
                undone.append(patch_id)
            _drop(patch_id)
        return undone


def report(patches: Iterable[Patch] | None = None) -> list[dict[str, Any]]:
    """The status of each patch evaluated since the last revert, in table order."""
    rows = tuple(table() if patches is None else patches)
    with _LOCK:
        out = []
        for patch in rows:
            state = _STATE.get(patch.id)
            if state is None:
                continue
            out.append({**patch.describe(), "status": state.status, "detail": state.detail})
        return out


def as_tags(entries: Iterable[Mapping[str, Any]], prefix: str = "compat.") -> dict[str, str]:
    """MLflow-style tags from a report: {"compat.<id>": "<status>"}."""
    return {f"{prefix}{e['id']}": str(e["status"]) for e in entries}


def failures(entries: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in entries if e["status"] == FAILED]


# --------------------------------------------------------------------------- internals


def _install(patch: Patch, module: ModuleType | None, state: _State) -> _State:
    patcher = state.patcher or Patcher(patch.id, active=functools.partial(_is_live, patch.id))
    try:
        detail = patch.install(patcher, module)
    except PatchUnavailable as exc:
        patcher.undo()
        return _State(SKIPPED_ABSENT, str(exc), alive=state.alive)
    except Exception as exc:  # noqa: BLE001 - a failing patch is reported, the rest still apply
        patcher.undo()
        return _State(FAILED, f"{type(exc).__name__}: {exc}", alive=state.alive)
    state.patcher = patcher
    state.status = APPLIED
    parts = [state.detail] if state.detail else []
    if module is not None:
        state.modules[module.__name__] = module
        parts.append(f"{module.__name__}: {detail or 'patched'}")
    elif detail:
        parts.append(detail)
    state.detail = "; ".join(parts)
    return state


def _defer(patch: Patch) -> None:
    state = _State(PENDING, f"waits for import of {', '.join(patch.imports)}")
    _STATE[patch.id] = state
    alive = state.alive

    def hook(module: ModuleType) -> None:
        with _LOCK:
            if not alive[0] or _STATE.get(patch.id) is not state:
                return  # reverted since the hook was registered
            if state.status not in (APPLIED, PENDING):
                return  # an earlier module of this patch failed
            if state.status == PENDING:
                state.detail = ""
            _STATE[patch.id] = _install(patch, module, state)

    for name in patch.imports:
        wrapt.register_post_import_hook(hook, name)


def _is_live(patch_id: str) -> bool:
    """Whether `patch_id` is installed now (its wrappers act) — checked on every wrapped call."""
    state = _STATE.get(patch_id)
    return state is not None and state.status in (APPLIED, PENDING)


def _stale(state: _State) -> bool:
    """A deferred patch whose module was removed or re-imported since it was patched."""
    return any(sys.modules.get(name) is not mod for name, mod in state.modules.items())


def _drop(patch_id: str) -> None:
    state = _STATE.pop(patch_id, None)
    if state is None:
        return
    state.alive[0] = False
    if state.patcher is not None:
        state.patcher.undo()
