"""Fused ops: one launch where the composite takes several, the same call on every device.

A decode-sized round of a 27B target is bound by kernel launches when it runs without CUDA graphs (`compile=false`):
each aten op is one launch, and an RMSNorm in the model's float32 arithmetic on a bf16 input is three of them. A
`FusedOp` is called like a function by the engine on every device, and each device has one implementation:

* CPU: the composite, the exact torch ops the engine ran before (bitwise, tested).
* CUDA: a Triton kernel, one launch, under the tensors' device (`torch.cuda.device`: a device map across GPUs). It
  is checked against the composite on its first call with each dtype and tile (`check_key`: the argument dtypes,
  every dimension's power-of-two bucket, which the launchers' tiles derive from, and which optional arguments are
  given), so a tile first used late (the GDN solve's 128-node one after its 1-node one) is checked before it is
  trusted (the kernels were validated with Triton's interpreter, `TRITON_INTERPRET=1`, on a CPU); a kernel that fails
  to build or disagrees logs one WARNING and the composite runs for that key from then on. kernels=strict
  (DDTREE_KERNELS=strict) raises there instead (bench/device_all.sh: a GPU check must not pass on the fallback);
  kernels=composite never runs a kernel.

The checks' results belong to an engine: each `Engine` holds one `KernelChecks` (its `kernels=` setting, and what
each op's check found under it), and enters it around its own calls (`checking`); the ops are called from code
transformers' forward calls (the split attention, the GDN layer) as well as the engine's, so they find it in scope
(a ContextVar), not as an argument. A kernel that failed under one engine (auto: the composite runs there) is
checked again by the next engine, and raises there under strict. Calls outside any engine (tests, a drafter's
training) share one process-wide `KernelChecks` with the default setting (auto).

The choice is made in Python on the first tensor argument's device, not by registering an op with torch's
dispatcher: a dispatcher op with a Python kernel costs ~8 us of host time a call here (argument boxing both ways),
about what the launches it saves cost, and a launch-bound GPU round pays host time first. Inside a compiled graph the
call sites use the composite, which Inductor fuses itself. `ddtree.testing.dispatch.DispatchCount` counts a fused
call as the one launch a GPU makes (and its composite's ops not at all). Without Triton (a CPU build of torch) the
CUDA implementation is the composite.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import statistics
from collections.abc import Callable, Iterator, Sequence

import torch

from ddtree.engine.options import KERNEL_SETTINGS, check_kernels

__all__ = ["FusedOp", "KernelChecks", "active", "checking", "fused", "triton_interpreting"]

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


class KernelChecks:
    """One engine's fused-op checks: its `setting` (auto | strict | composite: ddtree.engine.options.EngineOptions.
    kernels) and, per op name, what the first-call checks found (`checked`: check_key -> passed), the timed ops'
    choices (`faster`, `timings`) and the op's state ("unchecked", "triton", "composite")."""

    def __init__(self, setting: str = "auto"):
        self.setting = check_kernels(setting, "kernels")
        self.checked: dict[str, dict[tuple, bool]] = {}
        self.faster: dict[str, dict[tuple, bool]] = {}
        self.timings: dict[str, dict[tuple, tuple[float, float]]] = {}
        self.state: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"KernelChecks({self.setting!r}, {self.state})"


_PROCESS = KernelChecks()  # calls outside any engine
_NONE: dict = {}  # (read only) an op no check has seen yet
_ACTIVE: contextvars.ContextVar[KernelChecks | None] = contextvars.ContextVar("ddtree_kernel_checks", default=None)


def active() -> KernelChecks:
    """The checks of the engine whose call is running, else the process-wide ones (calls outside an engine)."""
    found = _ACTIVE.get()
    return found if found is not None else _PROCESS


@contextlib.contextmanager
def checking(checks: KernelChecks) -> Iterator[KernelChecks]:
    """Inside: the fused ops run under `checks` (an engine enters its own around its calls)."""
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)


class FusedOp:
    """One fused op, called as `op(*args)`: `composite(*args)` on the CPU (and the CUDA fallback), `launch(*args)` the
    Triton implementation on CUDA (None: not written for this op). `schema` names it and documents its arguments, in
    torch's schema syntax. mutated: positions of the arguments the op writes (`Tensor(a!)`); it then returns nothing.
    `FusedOp.op` is the op itself (call sites hold it); `run_triton(*args)` runs the Triton implementation directly
    (tests).

    timed=True: a kernel whose speed against the composite is not obvious (a sequential loop replacing library
    kernels): on the first CUDA call with each set of argument shapes and integer arguments (a loop bound), after the
    check, both are timed (`compare`: each from a drained queue, alternating, the median of TIMING_REPEATS) and the
    faster one runs for that key from then on (logged at INFO, `timings`).
    What the checks found lives in the engine's `KernelChecks` (`active()`); the op's properties read those in scope:
    `checked`: check_key -> whether the kernel passed its check there (False: the composite runs for that key);
    `state`: "unchecked", "triton" (every key checked so far passed) or "composite" (some key, or the op, fell back);
    `faster`, `timings`: a timed op's choices."""

    registry: dict[str, FusedOp] = {}

    def __init__(self, schema: str, composite: Callable, launch: Callable | None = None,
                 mutated: Sequence[int] = (), atol: float | None = None, rtol: float | None = None,
                 timed: bool = False):
        name = schema.split("(", 1)[0]
        self.name, self.schema, self.composite, self.launch = name, schema, composite, launch
        self.mutated, self.atol, self.rtol, self.timed = tuple(mutated), atol, rtol, timed
        self.op = self
        FusedOp.registry[name] = self

    # what the checks in scope found for this op (KernelChecks: the engine's whose call is running)
    @property
    def state(self) -> str:
        """"unchecked" -> "triton" (checked on its first CUDA call) or "composite"."""
        return active().state.get(self.name, "unchecked")

    @state.setter
    def state(self, value: str) -> None:
        active().state[self.name] = value

    @property
    def checked(self) -> dict[tuple, bool]:
        """check_key -> passed its first-call check there."""
        return active().checked.setdefault(self.name, {})

    @property
    def faster(self) -> dict[tuple, bool]:
        """timed: argument shapes and ints -> whether the kernel was faster there."""
        return active().faster.setdefault(self.name, {})

    @property
    def timings(self) -> dict[tuple, tuple[float, float]]:
        """timed: that key -> (kernel us, composite us), medians."""
        return active().timings.setdefault(self.name, {})

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
        checks = active()  # once a call: the hot path reads its dicts directly
        if self.launch is None or checks.setting == "composite" or not _has_triton():
            checks.state[self.name] = "composite"
            return self.composite(*args)
        key = check_key(args)
        passed = checks.checked.get(self.name, _NONE).get(key)
        if passed is None:
            return self._first_call(key, args)
        if not passed:  # failed its check under these checks (an engine with kernels=auto: strict raised there)
            return self.composite(*args)
        if self.timed:
            shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor)
                           else a if isinstance(a, int) and not isinstance(a, bool) else None for a in args)
            faster = checks.faster.get(self.name, _NONE).get(shapes)
            if faster is None:
                faster = self._timed(key, shapes, args)
            if not faster:
                return self.composite(*args)
        try:
            with _on_device(args[0]):
                return self.launch(*args)
        except Exception as exc:  # noqa: BLE001 -- a shape the first call did not see failed to build: a
            # compile error raises before the launch, nothing written
            self._fail(key, f"the Triton kernel failed on a new shape ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})")
            return self.composite(*args)

    def _timed(self, key: tuple, shapes: tuple, args) -> bool:
        """Times the kernel and the composite on copies of what they write (`compare`); records and returns whether
        the kernel was faster."""
        trial = list(args)
        for i in self.mutated:
            trial[i] = args[i].clone()
        try:
            with _on_device(args[0]):
                kernel, composite = compare(self.launch, self.composite, trial)
        except Exception as exc:  # noqa: BLE001 -- as in _cuda: a shape that fails to build
            self._fail(key, f"the Triton kernel failed on a new shape ({type(exc).__name__})")
            return False
        self.timings[shapes], self.faster[shapes] = (kernel, composite), kernel < composite
        log.info("ddtree::%s at %s: Triton %.1f us, composite %.1f us (medians of %d): %s runs", self.name,
                 [k for k in shapes if k is not None], kernel, composite, TIMING_REPEATS,
                 "Triton" if kernel < composite else "composite")
        return kernel < composite

    def _fail(self, key: tuple, message: str) -> None:
        if _setting() == "strict":
            raise RuntimeError(f"ddtree::{self.name}: {message} (kernels=strict)")
        log.warning("ddtree::%s: %s; running the composite ops for %s", self.name, message, _describe(key))
        self.checked[key] = False
        self.state = "composite"

    def _first_call(self, key: tuple, args):
        """The Triton kernel's first CUDA call with this dtype and tile (`key`): built, run on copies of what it
        writes, compared with the composite (which writes the real outputs); from then on the kernel alone there, or
        the composite where it failed."""
        try:
            trial = list(args)
            for i in self.mutated:
                trial[i] = args[i].clone()
            with _on_device(args[0]):
                got = self.launch(*trial)
            got = [trial[i] for i in self.mutated] if self.mutated else got
        except Exception as exc:  # noqa: BLE001 -- a kernel that cannot build or run here: the composite runs
            self._fail(key, f"the Triton kernel failed ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})")
            return self.composite(*args)
        want = self.composite(*args)
        ref = [args[i] for i in self.mutated] if self.mutated else want
        try:
            for a, b in zip(_tensors(got), _tensors(ref), strict=True):
                torch.testing.assert_close(a, b, atol=self.atol, rtol=self.rtol, equal_nan=True)
        except AssertionError as exc:
            self._fail(key, f"the Triton kernel disagrees with the composite ({str(exc).splitlines()[0]})")
            return want
        self.checked[key] = True
        if self.state != "composite":
            self.state = "triton"
        return want


def _bucket(d: int) -> int:
    """A dimension's bucket: 0 and 1 as they are, else the next power of two, at least 16 (the launchers' tiles)."""
    return d if d <= 1 else max(16, 1 << (d - 1).bit_length())


def check_key(args) -> tuple:
    """What a fused op's first-call check is keyed by: each tensor's dtype and its dimensions' power-of-two buckets
    (the tiles and grids derive from them), which optional arguments are given (None), and for an integer whether
    it is 1 or a multiple of 16 (what Triton specialises a kernel on)."""
    def part(a):
        if isinstance(a, torch.Tensor):
            return a.dtype, tuple(_bucket(d) for d in a.shape)
        if isinstance(a, bool) or a is None:
            return a
        if isinstance(a, int):
            return "int", a == 1, a % 16 == 0
        return type(a).__name__
    return tuple(part(a) for a in args)


def _describe(key: tuple) -> str:
    return ", ".join(f"{k[0]} {list(k[1])}" for k in key if isinstance(k, tuple) and isinstance(k[0], torch.dtype))


def _on_device(t: torch.Tensor):
    """The launch's device guard: Triton launches on the current CUDA device, which need not be the tensors' (a device
    map across GPUs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# the `timed` choice: each side TIMING_REPEATS times from a drained queue, TIMING_RUNS calls each, the medians
TIMING_REPEATS = 7
TIMING_RUNS = 3


def _drain() -> None:
    """Wait for the device's queue to empty: a side is timed from the same idle start as the other."""
    torch.cuda.synchronize()


def _elapsed_us(fn: Callable, args: list, runs: int) -> float:
    """Microseconds a call of fn(*args), over `runs` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / runs


def compare(kernel: Callable, composite: Callable, args: list) -> tuple[float, float]:
    """(kernel us, composite us) a call: after a warm-up call of each, TIMING_REPEATS rounds that time the kernel
    then the composite, each from a drained queue (`_drain`); the medians."""
    kernel(*args)
    composite(*args)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(TIMING_REPEATS):
        for side, fn in zip(times, (kernel, composite), strict=True):
            _drain()
            side.append(_elapsed_us(fn, args, TIMING_RUNS))
    return statistics.median(times[0]), statistics.median(times[1])


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)]


_TRITON: list = []
SETTINGS = KERNEL_SETTINGS


def _setting() -> str:
    """The `kernels=` setting of the checks in scope (an engine's; auto outside any engine)."""
    return active().setting


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
