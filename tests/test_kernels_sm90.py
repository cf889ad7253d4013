"""Every fused op's Triton kernels compile for an sm_90 GPU with Triton's real compiler, as a real generation calls
them (bench/kernels_sm90.py: AR, DFlash, DDTree on Qwen3.6-27B's widths and head dims), and every op's real calls
reach its kernel (no launcher fallback). No GPU needed; slow (a minute or two of compiling)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_as_a_generation_calls_it(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "sm90.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_sm90.py"), "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    import json

    found = json.loads(out.read_text())
    names = {r["kernel"] for r in found["kernels"]}
    assert {"rms_norm_rows", "norm_rope_rows", "merge_rows", "silu_mul_flat", "decays_kernel", "conv_kernel",
            "qk_norm_kernel", "delta_rule_kernel", "gated_norm_kernel", "tree_build_kernel"} <= names, names
