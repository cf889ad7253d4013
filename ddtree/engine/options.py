"""An engine's options, resolved once when the Engine is built and passed to what it builds.

What used to steer the engine process-wide (a module global for the CPU-only branches, environment variables read
deep in the code) is one frozen `EngineOptions`: `EngineOptions.resolve` takes an Engine's keyword arguments,
falling back to the options in scope (a `ddtree.engine.host.device_path()` block) and then to the environment. It is
the one place the environment is read. The Engine passes what it resolved on, explicitly: to its target binding
(`TargetBinding(options=...)`: the CPU-only branches, the allocator, verification's flex compile, the GDN commit),
its compiled round (through the binding), its proposer (`DraftSettings.options`) and its fused ops' checks
(`ddtree.engine.kernels.KernelChecks`, one per engine). A piece built on its own (a `TargetSession` without a
binding, a test) resolves its options once when built.

`scoped(options)` / `current()` remain for the code the engine does not call itself: transformers' model forward
calls the patched Gated DeltaNet forward (ddtree.engine.gdn.step: the `gdn_step` branch) with its own arguments,
so a session enters its binding's options around each target call and that code reads `current()`. Outside any
scope `current()` is the library's defaults (`EngineOptions()`): it never reads the environment. Like the
verification context (`ddtree.engine.verification`), the scope lives in a ContextVar for the duration of a `with`
block only: nothing here is process-global.

The environment variables, each the fallback of one field (read by `resolve` only):
  DDTREE_DEVICE_PATH      device_path: 1/all turns every CPU-only branch off (a CPU run takes a CUDA run's code),
                          or a comma list of HOST_BRANCHES names
  DDTREE_KERNELS          kernels: auto | strict | composite (ddtree.engine.kernels)
  DDTREE_FLEX_COMPILE     flex_compile: 0/1 (unset: compiled flex attention on CUDA only)
  DDTREE_COMPILE          auto_compile: 0/false/off keeps compile=auto eager on CUDA too
  DDTREE_COMPILE_BACKEND  compile_backend: torch.compile's backend for the compiled round (unset: inductor)
  DDTREE_HOST_MALLOC      tune_host_allocator: 1 tunes glibc's malloc on a CPU target (ddtree.engine.host)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# The engine takes one code path on every device, except where a branch below measured a gain on the CPU toy pair
# (docs/gpu.md lists each with its gain); `device_path` turns them off, so a CPU run takes a CUDA run's code.
HOST_BRANCHES = {
    "host_tree": "the best-first tree built on the host (C extension, heap) and walked on its host arrays",
    "dense_attention": "a dense tree mask for small trees, and the chain prefill of short prompts on a hybrid",
    "lazy_head": "a greedy round's head (and last layer) only for the rows the walk reads",
    "gdn_step": "one cached token through a GDN layer as a K-tap dot product and one fused update",
}
KERNEL_SETTINGS = ("auto", "strict", "composite")
_NO = ("", "0", "false", "no", "off")
_YES = ("1", "true", "yes", "on")


def parse_branches(value: str | bool | Iterable[str], setting: str = "DDTREE_DEVICE_PATH") -> frozenset[str]:
    """The CPU-only branches turned off by `value`: a word (1/all: every one; 0/'': none), a comma list of names,
    a bool, or an iterable of names."""
    if isinstance(value, bool):
        return frozenset(HOST_BRANCHES) if value else frozenset()
    if not isinstance(value, str):
        value = ",".join(value)
    value = value.strip().lower()
    if value in _NO:
        return frozenset()
    if value in (*_YES, "all"):
        return frozenset(HOST_BRANCHES)
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = names - set(HOST_BRANCHES)
    if unknown:
        raise ValueError(f"{setting}: unknown branch {sorted(unknown)}; known: {sorted(HOST_BRANCHES)}")
    return names


def check_kernels(value: str, setting: str = "DDTREE_KERNELS") -> str:
    value = value or "auto"
    if value not in KERNEL_SETTINGS:
        raise ValueError(f"{setting}={value!r}: use one of {', '.join(KERNEL_SETTINGS)}")
    return value


@dataclass(frozen=True)
class EngineOptions:
    """device_path: the CPU-only branches (HOST_BRANCHES) turned off. kernels: the fused ops' setting (auto: the
    Triton kernel where it passed its check; strict: a failing kernel raises; composite: never a kernel).
    flex_compile: compiled flex attention (None: on CUDA only). auto_compile: compile=auto compiles on CUDA.
    compile_backend: torch.compile's backend for the compiled round (None: inductor). tune_host_allocator: set
    glibc's malloc thresholds on a CPU target (process-wide once set: ddtree.engine.host). host_malloc_off: the
    environment says DDTREE_HOST_MALLOC=0, which overrides a setting that asks (read here, with the rest)."""

    device_path: frozenset[str] = frozenset()
    kernels: str = "auto"
    flex_compile: bool | None = None
    auto_compile: bool = True
    compile_backend: str | None = None
    tune_host_allocator: bool = False
    host_malloc_off: bool = False

    @classmethod
    def _from_env(cls) -> EngineOptions:
        """The options the environment sets (each variable's default where it is unset): `resolve`'s fallback."""
        env = os.environ.get
        flex = env("DDTREE_FLEX_COMPILE")
        return cls(device_path=parse_branches(env("DDTREE_DEVICE_PATH", "")),
                   kernels=check_kernels(env("DDTREE_KERNELS", "auto")),
                   flex_compile=None if flex is None else flex.strip().lower() not in _NO,
                   auto_compile=env("DDTREE_COMPILE", "").strip().lower() not in _NO[1:],
                   compile_backend=env("DDTREE_COMPILE_BACKEND") or None,
                   tune_host_allocator=env("DDTREE_HOST_MALLOC", "").strip().lower() in _YES,
                   host_malloc_off=env("DDTREE_HOST_MALLOC", "1").strip().lower() in _NO[1:])

    @classmethod
    def resolve(cls, *, base: EngineOptions | None = None, device_path: bool | str | Iterable[str] | None = None,
                kernels: str | None = None, flex_compile: bool | None = None, auto_compile: bool | None = None,
                compile_backend: str | None = None, tune_host_allocator: bool | None = None) -> EngineOptions:
        """An engine's options: each argument given, else `base`'s (options resolved before), else the options in
        scope (a `device_path()` block's), else the environment's (read here, the one place)."""
        if base is None:
            scope = _SCOPED.get()
            base = scope if scope is not None else cls._from_env()
        given = {"kernels": None if kernels is None else check_kernels(kernels, "kernels"),
                 "device_path": None if device_path is None else parse_branches(device_path, "device_path"),
                 "flex_compile": flex_compile, "auto_compile": auto_compile, "compile_backend": compile_backend,
                 "tune_host_allocator": tune_host_allocator}
        return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


_DEFAULTS = EngineOptions()
_SCOPED: contextvars.ContextVar[EngineOptions | None] = contextvars.ContextVar("ddtree_engine_options", default=None)


def current() -> EngineOptions:
    """The options in scope (an engine's call, a `device_path()` block), else the library's defaults: for code that
    transformers' own forward calls (the module docstring says which). Never reads the environment."""
    found = _SCOPED.get()
    return found if found is not None else _DEFAULTS


@contextlib.contextmanager
def scoped(options: EngineOptions) -> Iterator[EngineOptions]:
    """Inside: `current()` is `options`."""
    token = _SCOPED.set(options)
    try:
        yield options
    finally:
        _SCOPED.reset(token)


__all__ = ["EngineOptions", "HOST_BRANCHES", "KERNEL_SETTINGS", "current", "parse_branches", "scoped"]
