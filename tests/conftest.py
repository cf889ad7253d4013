"""Shared fixtures. Tests never download: the hub is switched off for the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# one intra-op thread: tiny models gain nothing from more, and 2 threads on a busy 2-core box thrash
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("MLFLOW_DISABLE_TELEMETRY", "true"),
                     ("OMP_NUM_THREADS", "1")):
    os.environ.setdefault(_key, _value)


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -m ddtree.run ARGS` in a subprocess, from a directory outside the repo."""

    def run(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": ""}
        return subprocess.run([sys.executable, "-m", "ddtree.run", *args], cwd=cwd or tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


FIXTURES = Path(__file__).resolve().parent / "compat_fixtures"


@pytest.fixture
def clean_compat():
    """Every patch reverted and the authors' modules forgotten, before and after the test."""
    import compat
    from ddtree.upstream.loader import purge

    compat.revert()
    purge()
    yield
    compat.revert()
    purge()


def copy_checkout(name: str, tmp_path: Path) -> Path:
    """A stand-in checkout of the authors' repository (written in tests, none of their code)."""
    import shutil

    return Path(shutil.copytree(FIXTURES / name, tmp_path / "ddtree-checkout"))
