"""The authors' stage timer on CPU-only torch.

The DDTree authors' `dflash.py` times every stage with `cuda_time()`, which calls
`torch.cuda.synchronize()`: on a torch without CUDA that raises (AssertionError "Torch not compiled
with CUDA enabled"), so their `dflash_generate` / `ddtree_generate` cannot run at all. Where CUDA is
unavailable, `cuda_time()` returns `time.perf_counter()` without the synchronize. `ddtree.py` copies
the function with `from dflash import cuda_time`; both bindings are patched and both restored.
The modules are the private copies `compat.upstream` imports (never on sys.path under their own names).
"""

from __future__ import annotations

import time
from types import ModuleType

from ..core import UPSTREAM, UPSTREAM_PACKAGE, Patch, Patcher, PatchUnavailable

ID = "upstream-cuda-timer"
MODULES = (f"{UPSTREAM_PACKAGE}.dflash", f"{UPSTREAM_PACKAGE}.ddtree")


def cpu_timer(wrapped, instance, args, kwargs):
    return time.perf_counter()


def cuda_unavailable() -> bool:
    import torch

    return not torch.cuda.is_available()


def install(patcher: Patcher, module: ModuleType | None) -> str:
    assert module is not None, "deferred patch: called with the imported module"
    if not callable(getattr(module, "cuda_time", None)):
        raise PatchUnavailable(f"{module.__name__} has no cuda_time()")
    patcher.wrap(module, "cuda_time", cpu_timer)
    return "cuda_time() -> time.perf_counter()"


PATCH = Patch(
    id=ID,
    targets=tuple(f"{m}:cuda_time" for m in MODULES),
    versions={"torch": ">=2.0"},
    reason="the authors' cuda_time() calls torch.cuda.synchronize(), which raises on CPU-only torch",
    install=install,
    for_engines=frozenset({UPSTREAM}),
    condition=cuda_unavailable,
    condition_doc="torch.cuda.is_available() is False",
    imports=MODULES,
)
