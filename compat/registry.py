"""The patch registry: the table of every patch row, applied and reverted as a unit.

`PATCHES` is a plain tuple built at import from the rows in `compat.patches` (which import only
`compat.core`). `apply()` evaluates the table and installs what is in range, selected, and written
for the engine applying it; `revert()` undoes everything, restoring the original objects
(identity, not just equality). Wrappers act only while their patch is applied: a copy of a wrapper
made while patched (a `from x import f` in code imported meanwhile) calls straight through to the
original after revert.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from ddtree.errors import ConfigError

from .core import (
    APPLIED,
    ENGINES,
    FAILED,
    PENDING,
    SKIPPED_ABSENT,
    SKIPPED_CONDITION,
    SKIPPED_CONFIG,
    SKIPPED_ENGINE,
    STATUSES,
    Patch,
    Patcher,
    PatchUnavailable,
    VersionLookup,
    gate,
    installed_version,
)
from .patches import (
    cache_crop,
    cache_kwarg,
    embedding_access,
    flash_s_aux,
    gdn_tree_forward,
    hybrid_cache,
    qwen3_import_shims,
    sliding_window,
    upstream_gdn_tree,
    upstream_mask_filter,
    upstream_timer,
)

__all__ = ["PATCHES", "STATUSES", "apply", "as_tags", "failures", "report", "revert"]

# In application order: wrappers of one target nest in this order.
PATCHES: tuple[Patch, ...] = (
    cache_kwarg.PATCH,
    hybrid_cache.PATCH,
    cache_crop.PATCH,
    embedding_access.PATCH,
    flash_s_aux.PATCH,
    sliding_window.PATCH,
    qwen3_import_shims.PATCH,
    gdn_tree_forward.PATCH,  # the engine's own row: ddtree.engine.gdn.install() provides its wrapper
    upstream_mask_filter.PATCH,  # recompiles their generate functions: before any wrapper of them
    upstream_timer.PATCH,
    upstream_gdn_tree.PATCH,
)


@dataclass
class _State:
    status: str
    detail: str
    patcher: Patcher | None = None
    modules: dict[str, ModuleType] = field(default_factory=dict)  # deferred patches: module patched, by name
    alive: list[bool] = field(default_factory=lambda: [True])  # post-import hooks check this; revert clears it
    provided: Mapping[str, Any] = field(default_factory=dict)  # the providers apply() was given


_STATE: dict[str, _State] = {}  # what apply() did, by patch id; revert() empties it
_LOCK = threading.RLock()


# --------------------------------------------------------------------------- apply / revert / report


def apply(
    only: Iterable[str] | None = None,
    skip: Iterable[str] | None = None,
    *,
    engine: str | None = None,
    provided: Mapping[str, Any] | None = None,
    version_of: VersionLookup | None = None,
    patches: Iterable[Patch] | None = None,
) -> list[dict[str, Any]]:
    """Install every patch of the table that is in range, selected, for `engine` and whose condition holds.

    engine: "native" or "upstream" applies only the rows written for that engine's code; None applies
    every row (`python -m compat`). provided: providers the rows' `needs` name (e.g. {"gdn": ...}).
    Idempotent: a patch already applied (or pending) is left alone, so calling apply() again with a
    wider selection only adds patches; use revert() to take some away. `version_of` replaces the
    installed-version lookup (tests); `patches` replaces the table (tests).
    Returns the report for the table, in table order. Unknown ids or engine: ConfigError.
    """
    rows = tuple(PATCHES if patches is None else patches)
    known = {p.id for p in rows}
    only_set = None if only is None else set(only)
    skip_set = set(skip or ())
    for setting, ids in (("compat.only", only_set or set()), ("compat.skip", skip_set)):
        unknown = sorted(ids - known)
        if unknown:
            raise ConfigError(setting, f"unknown patch id(s) {unknown}",
                              f"known ids: {sorted(known)} (python -m compat lists them)")
    if engine is not None and engine not in ENGINES:
        raise ConfigError("engine", f"unknown engine {engine!r}", f"use one of {list(ENGINES)}")
    lookup = version_of or installed_version
    given = dict(provided or {})
    with _LOCK:
        for patch in rows:
            state = _STATE.get(patch.id)
            if state is not None and state.status in (APPLIED, PENDING):
                if not _stale(state):
                    continue
                _drop(patch.id)
            _STATE[patch.id] = _evaluate(patch, only_set, skip_set, engine, given, lookup)
        return report(rows)


def _evaluate(patch: Patch, only: set[str] | None, skip: set[str], engine: str | None,
              provided: Mapping[str, Any], lookup: VersionLookup) -> _State:
    """The state of one row after this apply(): installed, deferred, or why not."""
    if (only is not None and patch.id not in only) or patch.id in skip:
        return _State(SKIPPED_CONFIG, "left out by compat.only / compat.skip")
    if engine is not None and engine not in patch.for_engines:
        return _State(SKIPPED_ENGINE, f"for engine={'/'.join(sorted(patch.for_engines))}, not {engine}")
    ruled_out = gate(patch, lookup)
    if ruled_out is not None:
        return _State(*ruled_out)
    missing = [name for name in patch.needs if name not in provided]
    if missing:
        return _State(SKIPPED_ABSENT, f"needs {', '.join(missing)} from the caller of apply() (ddtree.upstream "
                      "and ddtree.engine.gdn.install() provide them)")
    if patch.condition is not None:
        try:
            holds = bool(patch.condition())
        except Exception as exc:  # noqa: BLE001 - reported
            return _State(FAILED, f"condition raised {type(exc).__name__}: {exc}")
        if not holds:
            return _State(SKIPPED_CONDITION, f"condition false: {patch.condition_doc}")
    needed = {name: provided[name] for name in patch.needs}
    if patch.imports:
        return _defer(patch, needed)  # may have installed already (its modules were imported)
    return _install(patch, None, _State(APPLIED, "", provided=needed))


def revert(ids: Iterable[str] | None = None) -> list[str]:
    """Undo every installed patch (or those of `ids`), newest first, restoring the original objects.
    Returns the ids undone."""
    with _LOCK:
        undone = []
        for patch_id in reversed(list(_STATE)):
            if ids is not None and patch_id not in ids:
                continue
            if _STATE[patch_id].status in (APPLIED, PENDING):
                undone.append(patch_id)
            _drop(patch_id)
        return undone


def report(patches: Iterable[Patch] | None = None) -> list[dict[str, Any]]:
    """The status of each patch evaluated since the last revert, in table order."""
    rows = tuple(PATCHES if patches is None else patches)
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
    patcher = state.patcher or Patcher(patch.id, active=functools.partial(_is_live, patch.id),
                                       provided=state.provided)
    try:
        detail = patch.install(patcher, module)
    except PatchUnavailable as exc:
        patcher.undo()
        return _State(SKIPPED_ABSENT, str(exc), alive=state.alive, provided=state.provided)
    except Exception as exc:  # noqa: BLE001 - a failing patch is reported, the rest still apply
        patcher.undo()
        return _State(FAILED, f"{type(exc).__name__}: {exc}", alive=state.alive, provided=state.provided)
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


def _defer(patch: Patch, provided: Mapping[str, Any]) -> _State:
    state = _State(PENDING, f"waits for import of {', '.join(patch.imports)}", provided=provided)
    _STATE[patch.id] = state  # before the hooks: a hook on a module imported already runs at once
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
    return _STATE[patch.id]  # a hook that ran at once may have replaced the state (failed, absent)


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
