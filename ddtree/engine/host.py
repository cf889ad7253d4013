"""Host allocator settings for CPU targets: keep freed tensor memory in the heap instead of returning it per op.

glibc's malloc serves a large block (above a threshold that adapts between 128 KiB and 32 MiB) from fresh
`mmap`ed pages, and gives the top of the heap back to the kernel once more than the trim threshold is free
there. A CPU verification forward makes hundreds of temporaries of 0.1-10 MiB (a 257-node tree on the toy
hybrid: every [heads, n, n] GDN matrix is 1.6 MiB), so under the defaults many of them land on pages the
kernel must fault in and zero again, op after op. `tune_host_allocator` fixes both thresholds once per
process (mmap only from 32 MiB, glibc's maximum; trim only past 1 GiB of free heap top), so the freed blocks
are reused: one 257-node verification of the toy hybrid took 94-111 ms before and 74-79 ms after
(docs/engine-internals.md; same outputs: nothing but where the memory comes from changes).

Process-wide, like any malloc setting: every model in the process (the authors' loops and transformers' in
`bench/bench_engines.py` too) runs under it once it is set, and it stays set. The cost is that up to 1 GiB of
freed memory stays mapped to the process. So it is applied only when asked: `Engine(..., tune_host_allocator=True)`
(the library default is off), `host_allocator=true` of `python -m ddtree.run` (its default: on), or
DDTREE_HOST_MALLOC=1 for an Engine that leaves the setting at None. Never where the C library is not glibc, where
the environment sets either threshold (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES: theirs
wins), or with DDTREE_HOST_MALLOC=0 (which overrides a setting that asks).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator

import torch

from ddtree.engine.options import HOST_BRANCHES as HOST_BRANCHES  # re-exported: the names device_path takes
from ddtree.engine.options import EngineOptions, parse_branches, scoped

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for this setting on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_STATE: dict[str, str] = {}


def _user_settings() -> list[str]:
    """The environment's own settings of these two thresholds."""
    found = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        found.append("GLIBC_TUNABLES")
    return found


def allocator_wanted(options: EngineOptions) -> bool:
    """Whether an engine with these options tunes the allocator: asked (`tune_host_allocator`: the setting, else
    DDTREE_HOST_MALLOC=1), and not under DDTREE_HOST_MALLOC=0 (read with the options: `host_malloc_off`)."""
    return options.tune_host_allocator and not options.host_malloc_off


def tune_host_allocator(options: EngineOptions | None = None) -> str:
    """Set the thresholds once per process; returns what holds, in words (also when nothing was changed).
    options: whose DDTREE_HOST_MALLOC=0 stops it (None: resolved now, from the scope or the environment)."""
    if "state" in _STATE:
        return _STATE["state"]
    state = _tune(options if options is not None else EngineOptions.resolve())
    _STATE["state"] = state
    log.debug("host allocator: %s", state)
    return state


def _tune(options: EngineOptions) -> str:
    if options.host_malloc_off:  # DDTREE_HOST_MALLOC=0, read with the options (ddtree.engine.options)
        return "untouched (DDTREE_HOST_MALLOC=0)"
    if not sys.platform.startswith("linux"):
        return f"untouched ({sys.platform}: not glibc)"
    user = _user_settings()
    if user:
        return f"untouched (the environment sets {', '.join(user)})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "untouched (the C library is not glibc)"
    version.restype = ctypes.c_char_p
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return f"untouched (glibc {version().decode()} refused mallopt)"
    return (f"glibc {version().decode()}: mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD >> 20} MiB")


# ---- CPU-only branches of the engine, and the switch that turns them off ---------------------------------------
# The engine takes one code path on every device, except where a branch of HOST_BRANCHES measured a gain on the CPU
# toy pair (docs/gpu.md lists each with its gain). `host_branch(name, device, options)` is the one place that decides,
# from the options it is given (ddtree.engine.options: an Engine's `device_path=`, else a `device_path()` block the
# options were resolved in, else DDTREE_DEVICE_PATH=1 or a comma list of branch names); the test suite and
# bench/bench_launches.py run the path a CUDA device takes on the CPU with `device_path()`.
_parse_off = parse_branches


def host_branch(name: str, device: torch.device, options: EngineOptions) -> bool:
    """Whether the CPU-only branch `name` (HOST_BRANCHES) runs for tensors on `device` under `options`."""
    return device.type == "cpu" and name not in options.device_path


@contextlib.contextmanager
def device_path(*names: str) -> Iterator[None]:
    """Inside: the named CPU-only branches (all without names) are off, so a CPU run takes a CUDA run's code.
    An Engine resolves its options when built (`Engine(device_path=...)` overrides): build it inside too."""
    off = parse_branches(",".join(names) if names else "all")
    options = EngineOptions.resolve()  # the enclosing block's, else the environment's
    with scoped(dataclasses.replace(options, device_path=options.device_path | off)):
        yield
