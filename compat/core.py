"""The pieces every patch is made of: `Patch` (one table row), `Patcher` (changes it can undo), version gates.

Imports nothing of the package (and torch/transformers never at import time): `compat.registry`
imports this and the patch rows, the rows import only this, so there is no import circle.

Each `Patch` names what it replaces (`targets`), the installed package versions it is for
(`versions`, PEP 440 specifiers), the engines it serves (`for_engines`), an optional runtime
`condition`, a one-line `reason`, and an `install(patcher, module)` function that makes every change
through a `Patcher`, which records how to undo it.

Statuses (stable; they go to MLflow tags and summary.json):

* ``applied``           installed in this process.
* ``pending``           in range; waits for a module that is not imported yet (post-import hook).
* ``skipped-version``   an installed package is outside the patch's specifier.
* ``skipped-absent``    a package the patch is for is not installed, its target does not exist, or a
                        provider it needs (`needs`) was not given to apply().
* ``skipped-config``    left out by ``only=`` / ``skip=``.
* ``skipped-engine``    written for another engine than the one applying (``for_engines``).
* ``skipped-condition`` its runtime condition is false (e.g. a CUDA machine for a CPU-only fix).
* ``failed``            installing raised; the detail holds the error and nothing of it stays installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any

import wrapt
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

APPLIED = "applied"
PENDING = "pending"
SKIPPED_VERSION = "skipped-version"
SKIPPED_ABSENT = "skipped-absent"
SKIPPED_CONFIG = "skipped-config"
SKIPPED_ENGINE = "skipped-engine"
SKIPPED_CONDITION = "skipped-condition"
FAILED = "failed"
STATUSES = (APPLIED, PENDING, SKIPPED_VERSION, SKIPPED_ABSENT, SKIPPED_CONFIG, SKIPPED_ENGINE, SKIPPED_CONDITION,
            FAILED)

NATIVE = "native"  # ddtree's own engine
UPSTREAM = "upstream"  # the DDTree authors' code, written for transformers 4.x
ENGINES = (NATIVE, UPSTREAM)

# Private package name under which ddtree.upstream.loader imports the DDTree authors' modules.
UPSTREAM_PACKAGE = "_ddtree_upstream"

VersionLookup = Callable[[str], "str | None"]
InstallFn = Callable[["Patcher", "ModuleType | None"], "str | None"]

_MISSING = object()


class PatchUnavailable(Exception):
    """Raised by an install function when its target does not exist here (reported as skipped-absent).

    Never reaches a user: the registry turns it into a status.
    """


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Patch:
    """One row of the table. `targets` are "module:qualname" strings of every object replaced.

    for_engines: the engines whose code needs this row (apply(engine=...) skips the others).
    needs: names of providers the caller must hand to apply(provided=...), read as `patcher.provided[name]`
    (how a row reaches code compat may not import, e.g. the engine's tree-exact GDN).
    """

    id: str
    targets: tuple[str, ...]
    versions: Mapping[str, str]
    reason: str
    install: InstallFn
    for_engines: frozenset[str] = frozenset(ENGINES)
    condition: Callable[[], bool] | None = None
    condition_doc: str = ""
    imports: tuple[str, ...] = ()  # install once each of these modules is imported (post-import hook)
    needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.for_engines) - set(ENGINES)
        if not self.for_engines or unknown:
            raise ValueError(f"patch {self.id}: for_engines must be a non-empty subset of {ENGINES}, got "
                             f"{sorted(self.for_engines)}")

    @property
    def target(self) -> str:
        return ", ".join(self.targets)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "target": self.target,
            "targets": list(self.targets),
            "versions": dict(self.versions),
            "engines": sorted(self.for_engines),
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

    def __init__(self, patch_id: str, active: Callable[[], bool] | None = None,
                 provided: Mapping[str, Any] | None = None):
        self.patch_id = patch_id
        self.provided: Mapping[str, Any] = provided or {}
        self._undo: list[Callable[[], None]] = []
        self._live = [True]
        # Wrappers call through to the original whenever this is false. Copies of a wrapper that
        # escaped revert (`from x import f` while patched) then behave like the original again.
        self.active = active or (lambda: self._live[0])

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> Any:
        """Wrap `owner.name` with a wrapt-style wrapper `wrapper(wrapped, instance, args, kwargs)`.

        A module's plain function gets a plain function in its place (`functools.wraps`: signature, name and
        `__wrapped__` kept), which torch.compile traces like any Python function; a wrapt proxy there is a function
        to dynamo's guards but not to their C checks ("FuncDefaultsGuardAccessor: Not a function"), so a graph that
        calls one (the DFlash drafter's attention function) fails to compile. Methods and other attributes get a
        wrapt proxy (it binds `instance`).
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

        if isinstance(owner, ModuleType) and type(current) is FunctionType:
            proxy = _plain_wrapper(current, gated)
            setattr(owner, name, proxy)
        else:
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


def _plain_wrapper(original: FunctionType, gated: Callable) -> FunctionType:
    """A plain function calling `gated(original, None, args, kwargs)`, dressed as `original`."""

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return gated(original, None, args, kwargs)

    return patched


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
    patcher: Patcher, module: Any, names: tuple[str, ...], original: Any, replacement: Any
) -> list[str]:
    """Point module-level `functools.partial`s built over `original` at `replacement` (restored on revert).

    transformers caches `partial(_process_flash_attention_kwargs, supports_mapping=...)` when a flash
    kernel is first loaded; a partial made before apply() would otherwise keep the unpatched function.
    """
    rebound = []
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, functools.partial) and value.func is original:
            patcher.set_attr(module, name, functools.partial(replacement, *value.args, **value.keywords))
            rebound.append(name)
    return rebound
