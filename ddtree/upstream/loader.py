"""Import the DDTree authors' code (`ddtree.py`, `dflash.py`, `model/`) from a checkout, without copying it.

    up = load_upstream("/path/to/ddtree-checkout")      # applies the compat patches first
    up.ddtree_generate(model=drafter, target=target, input_ids=..., ...)

Their modules import each other by top-level names (`from model import ...`, `from dflash import
...`) that would clash with ours (our package is `ddtree`) and with z-lab's `dflash` package. They
are imported as submodules of a private package (`_ddtree_upstream.ddtree`, `_ddtree_upstream.dflash`,
`_ddtree_upstream.model`), whose path is the checkout; the bare names `model` and `dflash` point at
those modules only while the import runs. Optional dependencies their files import at top level but
ddtree never calls (`datasets` for their benchmark datasets, `loguru` for logging) are stubbed during
the import when they are not installed. No bytecode is written into the checkout.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from compat import registry
from compat.core import UPSTREAM
from compat.patches import UPSTREAM_PACKAGE
from ddtree.errors import ConfigError

AUTHORS_REPO = "https://github.com/liranringel/ddtree"
REQUIRED = ("ddtree.py", "dflash.py", "model/__init__.py")
FIX = (
    f"set upstream.path to a checkout of the DDTree authors' repository ({AUTHORS_REPO}); "
    "the directory must contain ddtree.py, dflash.py and model/ (a package with __init__.py)"
)


class UpstreamError(ConfigError):
    """upstream.path does not hold the authors' code, or their code cannot be imported here: the user fixes it."""


@dataclass(frozen=True)
class Upstream:
    """The authors' modules, imported from `path`, and what was done to make them import."""

    path: Path
    ddtree: ModuleType
    dflash: ModuleType
    model: ModuleType
    stubs: tuple[str, ...] = ()
    patches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ddtree_generate(self):
        return self.ddtree.ddtree_generate

    @property
    def dflash_generate(self):
        return self.dflash.dflash_generate

    @property
    def DFlashDraftModel(self):  # noqa: N802 - the authors' class name
        return self.model.DFlashDraftModel


def check_path(path: str | Path | None) -> Path:
    """The checkout directory, resolved; UpstreamError naming upstream.path when it is not one."""
    if path is None or str(path).strip() == "":
        raise UpstreamError("upstream.path", "not set", FIX)
    root = Path(path).expanduser()
    if not root.exists():
        raise UpstreamError("upstream.path", f"{str(root)!r} does not exist", FIX)
    if not root.is_dir():
        raise UpstreamError("upstream.path", f"{str(root)!r} is not a directory", FIX)
    missing = [name for name in REQUIRED if not (root / name).is_file()]
    if missing:
        raise UpstreamError("upstream.path", f"{str(root)!r} lacks {', '.join(missing)}", FIX)
    return root.resolve()


def load_upstream(
    path: str | Path | None,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] | None = None,
    patch: bool = True,
) -> Upstream:
    """Apply the compat patches (unless patch=False), then import the authors' modules from `path`.

    Loading the same path again returns the modules already imported; another path replaces them.
    """
    root = check_path(path)
    loaded = sys.modules.get(UPSTREAM_PACKAGE)
    cached = getattr(loaded, "__upstream__", None)
    if isinstance(cached, Upstream) and cached.path == root and _intact(cached):
        if patch:
            apply_patches(only, skip)
        return cached
    purge()
    entries = apply_patches(only, skip) if patch else []

    package = ModuleType(UPSTREAM_PACKAGE)
    package.__path__ = [str(root)]
    package.__package__ = UPSTREAM_PACKAGE
    package.__doc__ = f"The DDTree authors' code, imported from {root} by ddtree.upstream.loader."
    sys.modules[UPSTREAM_PACKAGE] = package
    stubs = tuple(name for name in _STUBS if not _installed(name))
    try:
        with _no_bytecode(), _temporary_modules({name: _STUBS[name]() for name in stubs}):
            model = importlib.import_module(f"{UPSTREAM_PACKAGE}.model")
            with _temporary_modules({"model": model}):
                dflash = importlib.import_module(f"{UPSTREAM_PACKAGE}.dflash")
                with _temporary_modules({"dflash": dflash}):
                    ddtree = importlib.import_module(f"{UPSTREAM_PACKAGE}.ddtree")
    except Exception as exc:
        purge()
        raise UpstreamError(
            "upstream.path", f"importing the authors' code from {str(root)!r} failed: {type(exc).__name__}: {exc}",
            "check that the checkout is the DDTree authors' repository and that `python -m compat` shows no "
            "failed patch"
        ) from exc
    if patch:
        entries = registry.report()
    upstream = Upstream(root, ddtree, dflash, model, stubs, entries)
    package.__upstream__ = upstream
    return upstream


def apply_patches(only: Iterable[str] | None, skip: Iterable[str] | None) -> list[dict[str, Any]]:
    """The compat rows for the authors' code, with the engine's tree-exact GDN their GDN row needs."""
    from ddtree.engine import gdn  # torch + transformers: only once their code is really loaded

    return registry.apply(only, skip, engine=UPSTREAM, provided={"gdn": gdn, **gdn.provided()})


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def purge() -> list[str]:
    """Forget the imported authors' modules (sys.modules entries under the private package)."""
    names = [n for n in sys.modules if n == UPSTREAM_PACKAGE or n.startswith(UPSTREAM_PACKAGE + ".")]
    for name in names:
        del sys.modules[name]
    return names


def _intact(upstream: Upstream) -> bool:
    return all(sys.modules.get(m.__name__) is m for m in (upstream.ddtree, upstream.dflash, upstream.model))


@contextlib.contextmanager
def _temporary_modules(modules: dict[str, ModuleType]) -> Iterator[None]:
    """Make `modules` importable under the given names for the duration, then restore sys.modules."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


@contextlib.contextmanager
def _no_bytecode() -> Iterator[None]:
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous


def _unavailable(package: str, use: str):
    def call(*args, **kwargs):
        raise UpstreamError(
            "upstream", f"the authors' {use} needs the `{package}` package, which is not installed",
            f"ddtree supplies prompts and logging itself; pip install {package} to call it directly"
        )

    return call


def _datasets_stub() -> ModuleType:
    stub = ModuleType("datasets")
    stub.__doc__ = (
        "ddtree.upstream.loader stub: `datasets` is not installed (the authors' dataset loader is unused)."
    )
    for name in ("load_dataset", "Features", "Sequence", "Value"):
        setattr(stub, name, _unavailable("datasets", "load_and_process_dataset"))
    return stub


class _LoguruLogger:
    """The few loguru calls the authors make, sent to the stdlib logger `ddtree.upstream`."""

    _log = logging.getLogger("ddtree.upstream")
    _levels = {"trace": 5, "success": logging.INFO, "critical": logging.CRITICAL}

    def __getattr__(self, level: str):
        number = self._levels.get(level, getattr(logging, level.upper(), logging.INFO))
        return lambda message, *args, **kwargs: self._log.log(number, str(message))


def _loguru_stub() -> ModuleType:
    stub = ModuleType("loguru")
    stub.__doc__ = (
        "ddtree.upstream.loader stub: `loguru` is not installed; messages go to logging 'ddtree.upstream'."
    )
    stub.logger = _LoguruLogger()
    return stub


_STUBS = {"datasets": _datasets_stub, "loguru": _loguru_stub}
