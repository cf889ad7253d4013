"""Counting what a generation asks of the device: aten ops dispatched per stage, and host syncs.

`DispatchCount` is a TorchDispatchMode: every aten op that reaches the dispatcher below autograd is one call of
`__torch_dispatch__` (at least one CUDA kernel launch each without graphs, except the view and allocation ops,
counted apart). Ops are booked under the engine stage running at the time (`StageTimer` stages: draft, tree,
verify, commit; `prefill` for the prompt; `other` for the loop's own work between stages).

Host syncs are the reads that make the host wait for the device on a GPU:
* `aten.item` / `aten._local_scalar_dense` (`.item()`, `int(t)`, `float(t)`, `bool(t)`, a tensor used as a Python index);
* ops whose output size depends on the data (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without
  `output_size`, indexing with a boolean mask) or that answer on the host (`equal`, `is_nonzero`);
* a copy to the CPU from another device (`_to_copy` / `copy_`), which is how `.tolist()`, `.cpu()` and `.numpy()`
  read a CUDA tensor;
* on CPU tensors (where that copy is no op): `Tensor.tolist` and `Tensor.numpy` themselves, counted by wrapping them
  while the mode is active, so a CPU run counts the reads a CUDA run would make;
* host-to-device copies, which wait too (a copy from pageable host memory returns once the data has left it, behind
  the work queued before): a copy from a CPU tensor to another device (`_to_copy` / `copy_`); and, counted at the
  Python call because a CPU run shows no transfer: a tensor made from Python data with an explicit `device=`
  (`torch.tensor(list, device=d)`, `torch.as_tensor`: on CUDA the data is copied to the device there), and a tensor
  made from Python data on the host (no device) then moved (`.to(device)`) or copied into another tensor (`copy_`).
  A host tensor that stays on the host (the CPU walk's) is no transfer.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["DispatchCount", "NO_KERNEL", "SYNC_OPS"]

SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "equal", "is_nonzero",
                      "_unique", "_unique2", "unique_dim", "unique_consecutive", "argwhere"})
# dispatched, but no kernel runs: views and metadata (host work only) and allocations (the caching allocator)
NO_KERNEL = frozenset({"detach", "detach_", "resolve_conj", "resolve_neg", "lift_fresh", "_unsafe_view", "alias", "empty", "empty_like", "empty_strided",
                       "new_empty", "new_empty_strided", "resize_", "set_", "_reshape_alias", "sym_size", "sym_stride",
                       "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"})
# composites a GPU runs as one fused kernel where the CPU runs their decomposition: `rms_norm` goes to `_fused_rms_norm`
# (a CUDA / MPS / XPU kernel; CompositeImplicitAutograd on the CPU: pow, mean, add_, rsqrt, mul, mul) when the weight
# has the input's dtype. decompose=True counts them as the one op a GPU dispatches (a strided input costs the fused
# kernel one contiguous copy more, inside it: uncounted, as any op's internal launches are).
DEVICE_FUSED = frozenset({"rms_norm"})
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})  # torch.distributed's ops: counted apart
COLLECTIVE_BOOKKEEPING = frozenset({"wait_tensor", "_wrap_tensor_autograd"})  # a functional collective's wrappers


class _HostBorn:
    """CPU tensors made from Python data, by identity (a WeakSet compares tensors with `==`: an op, and a read)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t, lambda _, key=id(t): self._refs.pop(key, None))

    def __contains__(self, t) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


def _is_sync(name: str, func, args, kwargs, host_born: _HostBorn) -> bool:
    if name in SYNC_OPS:
        return True
    if name == "copy_" and isinstance(args[1], torch.Tensor) and args[1] in host_born and args[0] not in host_born:
        return True  # Python data copied into a (device) tensor: a host-to-device copy on CUDA
    if name == "repeat_interleave":
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name == "index" and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst_dev = args[0].device if name == "copy_" else kwargs.get("device")
        if not isinstance(src, torch.Tensor) or dst_dev is None:
            return False
        kinds = {src.device.type, torch.device(dst_dev).type}
        return "cpu" in kinds and len(kinds) == 2 and "meta" not in kinds  # device->host or host->device
    return False


def _device_fused(func, args) -> bool:
    """Whether a GPU runs this call as one fused kernel (DEVICE_FUSED; rms_norm: a real weight of the input's dtype or
    none, a real input)."""
    if func.overloadpacket.__name__ not in DEVICE_FUSED:
        return False
    x = args[0]
    weight = args[2] if len(args) > 2 else None
    return not x.is_complex() and (weight is None or weight.dtype == x.dtype)


class DispatchCount(TorchDispatchMode):
    """`with DispatchCount() as c:` ... then `c.ops[stage]`, `c.kernel_ops[stage]`, `c.syncs[stage]`, `c.names`,
    `c.graphs[stage]` (calls of the compiled round's graphs: their ops run outside the mode, uncounted; none of
    them reads the host, by construction: fullgraph).

    stages=True (default) books each op under the engine stage running (ddtree.engine.timing._Stage and
    TargetSession.prefill are wrapped while the mode is active).
    decompose=True counts a composite op (matmul, linear, reshape, to, ...) by what it dispatches, so a no-op cast or
    a reshape that is a view costs nothing, as on a device (per-layer counts: tests/test_gdn_launches.py); except
    those a GPU runs fused (DEVICE_FUSED: rms_norm), counted as one op.
    sequence=True keeps every op in order as (name, output shapes) in `c.sequence` (a capturable region dispatches
    the same sequence whatever the data). `c.kernel_names` / `c.view_names`: the ops by name, kernels and the rest;
    `with c.paused():` stops counting inside (what remains of a layer without its projections).
    layers=True also books each op under the kind of decoder layer running it, as the lean forward drives it
    (`ddtree.engine.forward.LeanLayer`: "linear_attention" or "full_attention"; "outside" between layers and on
    the plain model call): `c.layer_ops[(stage, kind)]`, and `c.layer_calls[(stage, kind)]` layers run, so ops per
    layer = their ratio.
    Collectives (a tensor-parallel target's all-reduces and all-gathers: the `c10d` and `_c10d_functional` ops) are
    counted apart, not as ops: `c.collectives[stage]`, `c.collective_names` (a GPU's fixed cost per layer, paid over
    the interconnect)."""

    def __init__(self, stages: bool = True, decompose: bool = False, sequence: bool = False, layers: bool = False):
        super().__init__()
        self.layer_ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.layer_calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._layers = layers
        self.layer = "outside"
        self.kernel_names: collections.Counter[str] = collections.Counter()
        self.view_names: collections.Counter[str] = collections.Counter()
        self.sequence: list[tuple[str, tuple]] | None = [] if sequence else None
        self._decompose = decompose
        self._paused = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.kernel_ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.sync_names: collections.Counter[str] = collections.Counter()
        self.names: collections.Counter[str] = collections.Counter()
        self.graphs: collections.Counter[str] = collections.Counter()  # compiled-region calls (ddtree.engine.compiled)
        self.collectives: collections.Counter[str] = collections.Counter()
        self.collective_names: collections.Counter[str] = collections.Counter()
        self.stage = "other"
        self._stages = stages
        self._stack = contextlib.ExitStack()
        self._host_born = _HostBorn()  # CPU tensors made from Python data (no device given)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._decompose and not _device_fused(func, args) and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
            with self:  # count what the composite dispatches instead
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if self._paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace in COLLECTIVE_NAMESPACES:
            if name not in COLLECTIVE_BOOKKEEPING:
                self.collectives[self.stage] += 1
                self.collective_names[name] += 1
            return func(*args, **kwargs)
        self._book(name, kernel=not (func.is_view or name in NO_KERNEL))
        if _is_sync(name, func, args, kwargs, self._host_born):
            self._sync(name)
        out = func(*args, **kwargs)
        self._record(name, out)
        return out

    def _book(self, name: str, kernel: bool) -> None:
        stage = self.stage
        self.ops[stage] += 1
        if self._layers:
            self.layer_ops[(stage, self.layer)] += 1
        self.names[name] += 1
        if kernel:
            self.kernel_ops[stage] += 1
            self.kernel_names[name] += 1
        else:
            self.view_names[name] += 1

    def _record(self, name: str, out) -> None:
        if self.sequence is not None:
            outs = out if isinstance(out, tuple | list) else (out,)
            self.sequence.append((name, tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside: nothing is counted (the ops still run)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _sync(self, name: str) -> None:
        self.syncs[self.stage] += 1
        self.sync_names[name] += 1

    def _host_read(self, name: str, real):
        def read(t: torch.Tensor, *a, **k):
            if t.device.type == "cpu" and not self._paused:  # a CUDA tensor's read shows up as its copy to the CPU
                self._sync(name)
            return real(t, *a, **k)
        return read

    def _from_data(self, name: str, real):
        """torch.tensor / as_tensor / from_numpy counted where a CUDA run copies Python data to the device."""
        def make(data, *a, **k):
            t = real(data, *a, **k)
            if self._paused or isinstance(data, torch.Tensor):  # (as_tensor of a tensor: a `.to`, dispatched)
                return t
            if k.get("device") is not None:
                if t.numel():  # (no bytes, no copy: transformers' caches start from `torch.tensor([], device=d)`)
                    self._sync(f"{name}(data, device=)")
            elif t.device.type == "cpu":
                self._host_born.add(t)
            return t
        return make

    def _moved(self, real):
        """Tensor.to counted where a host tensor of Python data goes to a device (a no-op, undispatched, on a CPU)."""
        def to(t: torch.Tensor, *a, **k):
            out = real(t, *a, **k)
            if out is t and not self._paused and t.numel() and t in self._host_born:
                dev = k.get("device", next((x for x in a if isinstance(x, torch.device | str)), None))
                if dev is not None:
                    self._sync("to(device) of host data")
            return out
        return to

    @contextlib.contextmanager
    def _booking(self) -> Iterator[None]:
        from ddtree.engine import compiled, target, timing
        from ddtree.engine.kernels import FusedOp

        counter = self
        stack = self._stack
        fused_call = FusedOp.__call__

        def counted_fused(op, *a):  # one launch on a GPU: counted as one kernel op, its composite's ops not at all
            if counter._paused:
                return fused_call(op, *a)
            counter._book(op.name, kernel=True)
            with counter.paused():
                out = fused_call(op, *a)
            counter._record(op.name, out)
            return out

        stack.callback(setattr, FusedOp, "__call__", fused_call)
        FusedOp.__call__ = counted_fused
        swaps = [(torch.Tensor, attr, self._host_read(attr, getattr(torch.Tensor, attr))) for attr in ("tolist", "numpy")]
        swaps += [(torch, attr, self._from_data(attr, getattr(torch, attr))) for attr in ("tensor", "as_tensor", "from_numpy")]
        swaps.append((torch.Tensor, "to", self._moved(torch.Tensor.to)))
        swaps = [(owner, attr, getattr(owner, attr), new) for owner, attr, new in swaps]
        for owner, attr, real, new in swaps:
            stack.callback(setattr, owner, attr, real)
            setattr(owner, attr, new)
        from ddtree.engine import batch

        def counted(run_graph):
            def counted_graph(static, graph, *a):  # a compiled region: counted as one call, its ops not dispatched
                counter.graphs[counter.stage] += 1
                for owner, attr, real, _ in swaps:  # the real functions: a graph guards on what it traced
                    setattr(owner, attr, real)
                try:
                    with _disable_current_modes():  # (torch.compile refuses to run under a user dispatch mode)
                        return run_graph(static, graph, *a)
                finally:
                    for owner, attr, _, new in swaps:
                        setattr(owner, attr, new)
            return counted_graph

        for cls in (compiled.StaticRound, batch.CompiledRound):  # the one-stream round's graphs, the batched round's
            stack.callback(setattr, cls, "_run", cls._run)
            cls._run = counted(cls._run)
        if self._layers:
            from ddtree.engine import forward

            lean_call = forward.LeanLayer.__call__

            def booked_layer(layer_self, *a, **k):
                kind = "linear_attention" if layer_self.linear else "full_attention"
                before, counter.layer = counter.layer, kind
                counter.layer_calls[(counter.stage, kind)] += 1
                try:
                    return lean_call(layer_self, *a, **k)
                finally:
                    counter.layer = before

            stack.callback(setattr, forward.LeanLayer, "__call__", lean_call)
            forward.LeanLayer.__call__ = booked_layer
        if self._stages:
            enter, exit_ = timing._Stage.__enter__, timing._Stage.__exit__
            prefill = target.TargetSession.prefill

            def staged_enter(stage_self):
                counter.stage = stage_self.name
                return enter(stage_self)

            def staged_exit(stage_self, *exc):
                out = exit_(stage_self, *exc)
                counter.stage = "other"
                return out

            def staged(real_prefill):
                def staged_prefill(session, *a, **k):
                    before, counter.stage = counter.stage, "prefill"
                    try:
                        return real_prefill(session, *a, **k)
                    finally:
                        counter.stage = before
                return staged_prefill

            for owner, attr, new in ((timing._Stage, "__enter__", staged_enter),
                                     (timing._Stage, "__exit__", staged_exit),
                                     (target.TargetSession, "prefill", staged(prefill)),
                                     (compiled.StaticSession, "prefill", staged(compiled.StaticSession.prefill))):
                stack.callback(setattr, owner, attr, getattr(owner, attr))
                setattr(owner, attr, new)
        try:
            yield
        finally:
            stack.close()

    def __enter__(self):
        # (re-entered by decompose=True's `with self:` inside __torch_dispatch__: the booking stays the outermost
        # one's; booking again and closing on the inner exit would undo the outer patches, FusedOp.__call__'s too)
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1:
            self._booking_cm = self._booking()
            self._booking_cm.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._booking_cm.__exit__(None, None, None)

    def total(self, counter: collections.Counter, exclude: tuple[str, ...] = ("prefill",)) -> int:
        return sum(v for k, v in counter.items() if k not in exclude)
