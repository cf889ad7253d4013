"""Count the aten ops a piece of code dispatches: what a GPU run without graphs pays in kernel launches.

`OpCounter` is a TorchDispatchMode. Composite ops (matmul, linear, reshape, to, ...) are decomposed into what
they dispatch, so a no-op cast or a reshape that is a view costs nothing, as on a device. Ops are split into
`kernels` (each at least one launch on a GPU) and `views` (metadata only: view, transpose, slice, expand,
_unsafe_view, ... no launch). `paused()` stops counting inside a region (e.g. the projections of a layer, to count
what remains).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# metadata-only ops that are not tagged as views
_NO_KERNEL = {"_unsafe_view", "empty", "empty_strided", "empty_like", "new_empty"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()
        self._paused = 0

    @property
    def total(self) -> int:
        """Ops that launch a kernel."""
        return sum(self.kernels.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(),
                                                          torch._C.DispatchKey.CompositeImplicitAutograd):
            with self:  # count what the composite dispatches instead
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not self._paused:
            name = func.overloadpacket.__name__
            (self.views if func.is_view or name in _NO_KERNEL else self.kernels)[name] += 1
        return func(*args, **kwargs)


__all__ = ["OpCounter"]
