"""Fused ops: one launch where the composite takes several, the same call on every device.

A decode-sized round of a 27B target is bound by kernel launches when it runs without CUDA graphs (`compile=false`):
each aten op is one launch, and an RMSNorm in the model's float32 arithmetic on a bf16 input is three of them. A
`FusedOp` is called like a function by the engine on every device, and each device has one implementation:

* CPU: the composite, the exact torch ops the engine ran before (bitwise, tested).
* CUDA: a Triton kernel, one launch. It is checked once per process against the composite on its first call (the
  kernels were validated with Triton's interpreter, `TRITON_INTERPRET=1`, on a CPU); a kernel that fails to build or
  disagrees logs one WARNING and the composite runs from then on. DDTREE_KERNELS=strict raises there instead
  (bench/device_all.sh: a GPU check must not pass on the fallback); DDTREE_KERNELS=composite never runs a kernel.

The choice is made in Python on the first tensor argument's device, not by registering an op with torch's
dispatcher: a dispatcher op with a Python kernel costs ~8 us of host time a call here (argument boxing both ways),
about what the launches it saves cost, and a launch-bound GPU round pays host time first. Inside a compiled graph the
call sites use the composite, which Inductor fuses itself. `ddtree.testing.dispatch.DispatchCount` counts a fused
call as the one launch a GPU makes (and its composite's ops not at all). Without Triton (a CPU build of torch) the
CUDA implementation is the composite.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

__all__ = ["FusedOp", "fused", "triton_interpreting"]

log = logging.getLogger("ddtree.engine")


def triton_interpreting() -> bool:
    """Whether Triton kernels built now run in its interpreter (TRITON_INTERPRET=1: on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused(*tensors: torch.Tensor) -> bool:
    """Whether a call site takes a fused op rather than its composite: eager and without autograd (the ops have no
    backward: a drafter in training runs the composite; so does a compiled graph, which Inductor fuses itself)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class FusedOp:
    """One fused op, called as `op(*args)`: `composite(*args)` on the CPU (and the CUDA fallback), `launch(*args)` the
    Triton implementation on CUDA (None: not written for this op). `schema` names it and documents its arguments, in
    torch's schema syntax. mutated: positions of the arguments the op writes (`Tensor(a!)`); it then returns nothing.
    `FusedOp.op` is the op itself (call sites hold it); `run_triton(*args)` runs the Triton implementation directly
    (tests).

    timed=True: a kernel whose speed against the composite is not obvious (a sequential loop replacing library
    kernels): on the first CUDA call with each set of argument shapes, after the check, both are timed (CUDA events,
    a few runs on copies) and the faster one runs for those shapes from then on (logged at INFO, `timings`)."""

    registry: dict[str, FusedOp] = {}

    def __init__(self, schema: str, composite: Callable, launch: Callable | None = None,
                 mutated: Sequence[int] = (), atol: float | None = None, rtol: float | None = None,
                 timed: bool = False):
        name = schema.split("(", 1)[0]
        self.name, self.schema, self.composite, self.launch = name, schema, composite, launch
        self.mutated, self.atol, self.rtol, self.timed = tuple(mutated), atol, rtol, timed
        self.state = "unchecked"  # -> "triton" (checked on its first CUDA call) or "composite"
        self.faster: dict[tuple, bool] = {}  # timed: argument shapes -> whether the kernel was faster there
        self.timings: dict[tuple, tuple[float, float]] = {}  # timed: shapes -> (kernel us, composite us)
        self.op = self
        FusedOp.registry[name] = self

    def __call__(self, *args):
        if args[0].is_cuda:
            return self._cuda(*args)
        return self.composite(*args)

    def run_triton(self, *args):
        """The Triton implementation on these arguments (CPU tensors need TRITON_INTERPRET=1)."""
        if self.launch is None:
            raise NotImplementedError(f"ddtree::{self.name} has no Triton implementation")
        return self.launch(*args)

    def _cuda(self, *args):
        if self.state == "triton":
            if self.timed:
                key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
                faster = self.faster.get(key)
                if faster is None:
                    faster = self._timed(key, args)
                if not faster:
                    return self.composite(*args)
            try:
                return self.launch(*args)
            except Exception as exc:  # noqa: BLE001 -- a shape the first call did not see failed to build: a
                # compile error raises before the launch, nothing written
                self._fail(f"the Triton kernel failed on a new shape ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})")
                return self.composite(*args)
        if self.state == "composite" or self.launch is None or _setting() == "composite" or not _has_triton():
            self.state = "composite"
            return self.composite(*args)
        return self._first_call(args)

    def _timed(self, key: tuple, args) -> bool:
        """Times the kernel and the composite on copies of what they write (after a warm-up run each); records and
        returns whether the kernel was faster."""
        trial = list(args)
        for i in self.mutated:
            trial[i] = args[i].clone()

        try:
            kernel, composite = _micros(self.launch, trial), _micros(self.composite, trial)
        except Exception as exc:  # noqa: BLE001 -- as in _cuda: a shape that fails to build
            self._fail(f"the Triton kernel failed on a new shape ({type(exc).__name__})")
            return False
        self.timings[key], self.faster[key] = (kernel, composite), kernel < composite
        log.info("ddtree::%s at %s: Triton %.1f us, composite %.1f us: %s runs", self.name,
                 [k for k in key if k is not None], kernel, composite, "Triton" if kernel < composite else "composite")
        return kernel < composite

    def _fail(self, message: str) -> None:
        if _setting() == "strict":
            raise RuntimeError(f"ddtree::{self.name}: {message} (DDTREE_KERNELS=strict)")
        log.warning("ddtree::%s: %s; running the composite ops", self.name, message)
        self.state = "composite"

    def _first_call(self, args):
        """The Triton kernel's first CUDA call: built, run on copies of what it writes, compared with the composite
        (which writes the real outputs); from then on the kernel alone, or the composite where it failed."""
        try:
            trial = list(args)
            for i in self.mutated:
                trial[i] = args[i].clone()
            got = self.launch(*trial)
            got = [trial[i] for i in self.mutated] if self.mutated else got
        except Exception as exc:  # noqa: BLE001 -- a kernel that cannot build or run here: the composite runs
            self._fail(f"the Triton kernel failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            return self.composite(*args)
        want = self.composite(*args)
        ref = [args[i] for i in self.mutated] if self.mutated else want
        try:
            for a, b in zip(_tensors(got), _tensors(ref), strict=True):
                torch.testing.assert_close(a, b, atol=self.atol, rtol=self.rtol, equal_nan=True)
        except AssertionError as exc:
            self._fail(f"the Triton kernel disagrees with the composite ({str(exc).splitlines()[0]})")
            return want
        self.state = "triton"
        return want


def _micros(fn: Callable, args: list, runs: int = 5) -> float:
    """fn(*args)'s mean CUDA time over `runs` after one warm-up run, in microseconds (CUDA events)."""
    fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / runs


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)]


_TRITON: list = []
SETTINGS = ("auto", "strict", "composite")


def _setting() -> str:
    value = os.environ.get("DDTREE_KERNELS", "auto") or "auto"
    if value not in SETTINGS:
        raise ValueError(f"DDTREE_KERNELS={value!r}: use one of {', '.join(SETTINGS)}")
    return value


def _has_triton() -> bool:
    if not _TRITON:
        try:
            import triton  # noqa: F401
            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


def jit_cache() -> Callable[[Callable], Callable]:
    """Decorator for a module's kernel factory `def build(): import triton ...; return kernels`: built on first use,
    once per interpreter setting (TRITON_INTERPRET is read when a kernel is decorated)."""
    def wrap(factory: Callable) -> Callable:
        built: dict[bool, object] = {}

        def get():
            key = triton_interpreting()
            if key not in built:
                built[key] = factory()
            return built[key]
        return get
    return wrap
