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


def _triton_interpreted() -> None:
    """Without a GPU, the fused ops' Triton kernels run in Triton's interpreter on CPU tensors
    (ddtree.testing.triton): it must be switched on before anything imports triton."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreted()


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -m ddtree.run ARGS` in a subprocess, from a directory outside the repo."""

    def run(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": ""}
        return subprocess.run([sys.executable, "-m", "ddtree.run", *args], cwd=cwd or tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


# ---------------------------------------------------------------- composed configs (lightning-hydra-template's
# cfg_train_global / cfg_train: one session-scoped composition, a function-scoped copy with this test's paths)

# the small job every run test starts from: a tiny random target, two built-in prompts, eight new tokens
SMALL = ("model=tiny_qwen3", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8")


def compose_config(*overrides: str, config_name: str = "config", hydra_node: bool = True):
    """conf/<config_name>.yaml composed with `overrides`, as the CLI would (with the hydra node by default)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ddtree.paths import CONF_DIR

    if config_name == "train":
        from ddtree.train.config import register

        register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_node)


@pytest.fixture(scope="session")
def compose() -> Callable[..., object]:
    """`compose(*overrides, config_name="config", hydra_node=True)`: a composed config."""
    return compose_config


@pytest.fixture(scope="session")
def small() -> tuple[str, ...]:
    """The overrides of the small job (SMALL), for CLI calls and compositions."""
    return SMALL


@pytest.fixture(scope="session")
def cfg_run_global():
    """The small job composed once per session (on the CPU, no warm-up, no tracking)."""
    return compose_config(*SMALL, "device=cpu", "warmup=false", "tracking=none")


@pytest.fixture
def cfg_run(cfg_run_global, tmp_path: Path):
    """A copy of the small job writing under this test's tmp_path (runs_dir, MLflow store, Hydra job dir)."""
    from omegaconf import open_dict

    cfg = cfg_run_global.copy()
    with open_dict(cfg):
        cfg.runs_dir = str(tmp_path / "runs")
        cfg.tracking.uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
        cfg.hydra.run.dir = str(tmp_path / "job")
    return cfg


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine oversubscribed by OpenMP crawls."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.fixture
def gdn_tree_off(monkeypatch):
    """A fault: hybrid targets verify as if the tree-exact GDN did not exist (the GDN sees a flat chain and no
    rollback happens); restored afterwards."""
    from ddtree.engine import gdn

    monkeypatch.setattr(gdn.forward, "_active_tree", lambda: None)
    monkeypatch.setattr(gdn, "commit_linear_states", lambda cache, accepted, host_path=None, **kw: None)
    gdn.uninstall()
    try:
        yield
    finally:
        monkeypatch.undo()
        gdn.install()


@pytest.fixture
def dynamo_clean():
    """Fresh dynamo caches and counters; error_on_recompile is set by the test inside a patch (reset after)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
