"""Running the fused ops' Triton kernels in tests: on a GPU as they are; on a CPU in Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before anything imports triton: the interpreter is chosen when triton's
own library functions are built), made faithful to a GPU's float32 -> bf16/fp16 rounding (round to nearest even; the
interpreter's own conversion truncates).

`with interpreter() as device:` yields the device to put the kernels' inputs on ("cuda" or "cpu"); the calling test
is skipped where Triton is missing, or imported without the interpreter on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["interpreter"]


@contextlib.contextmanager
def interpreter() -> Iterator[str]:
    import pytest

    if torch.cuda.is_available():
        pytest.importorskip("triton")
        yield "cuda"
        return
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no GPU, and TRITON_INTERPRET=1 was not set before triton was imported (tests/conftest.py)")
    pytest.importorskip("triton")
    from triton.runtime import interpreter as interp

    real = interp._convert_float

    def convert(data, src, dst, rounding_mode):
        if (src.name, dst.name) in (("fp32", "bf16"), ("fp32", "fp16")):  # torch's conversion: nearest even
            out = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            out = out.to(torch.bfloat16 if dst.name == "bf16" else torch.float16)
            return out.view(torch.int16).numpy().view(np.uint16)
        return real(data, src, dst, rounding_mode)

    interp._convert_float = convert
    try:
        yield "cpu"
    finally:
        interp._convert_float = real
