"""Seconds per stage of a generation (`StageTimer`): wall seconds on a CPU; on CUDA a pair of events per stage, read
once after the generation, so timing adds no host sync to a round (sync_timing=True synchronises instead)."""

from __future__ import annotations

import time

import torch

from ddtree.engine.result import STAGES

__all__ = ["StageTimer"]


class StageTimer:
    """Seconds per stage. On the CPU: wall seconds (perf_counter). On CUDA: by default a pair of CUDA events per
    stage, recorded at its boundaries and read once by `finish()` after the generation, so timing adds no host
    sync to a round (a stage's time is then the device timeline between its boundaries: its kernels, or the gaps
    while the host launches them). sync=True instead synchronises at every boundary and takes wall seconds (8 host
    syncs a round: the old, intrusive attribution)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        cuda = device.type == "cuda"
        self._sync = sync and cuda
        self._stream = torch.cuda.current_stream(device) if cuda and not sync else None
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def finish(self) -> dict[str, float]:
        """The seconds per stage, the recorded events resolved (one wait for the last of them)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self.seconds[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return self.seconds

    def stage(self, name: str) -> _Stage:
        """`with timer.stage(name):` adds the block's wall seconds to `name`."""
        return _Stage(self, name)

    def move(self, source: str, dest: str, seconds: float) -> None:
        """Book `seconds` timed inside stage `source` under `dest` instead (work of that kind done there)."""
        self.seconds[source] -= seconds
        self.seconds[dest] += seconds


class _Stage:
    """One timed block of a StageTimer (a plain context manager: a generator-based one costs ~3x more a round)."""

    __slots__ = ("timer", "name", "t")

    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        timer = self.timer
        if timer._stream is not None:
            self.t = torch.cuda.Event(enable_timing=True)
            self.t.record(timer._stream)
            return
        if timer._sync:
            torch.cuda.synchronize()
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> None:
        timer = self.timer
        if timer._stream is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(timer._stream)
            timer._events.append((self.name, self.t, end))
            return
        if timer._sync:
            torch.cuda.synchronize()
        timer.seconds[self.name] += time.perf_counter() - self.t
