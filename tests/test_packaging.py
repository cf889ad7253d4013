"""A plain (non-editable) install carries conf/ and the toy pair, and runs from any directory.

Slow: it builds the package twice (a wheel, and `pip install .`) from a copy of the checkout, into a
fresh venv that borrows this venv's dependencies (a .pth file), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from ddtree.paths import CHECKOUT, SHIPPED

pytestmark = pytest.mark.slow


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _fresh_venv(path: Path) -> Path:
    """A venv with nothing of ddtree in it; the shared venv's packages visible through a plain .pth path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # a plain path, not a site dir: the shared venv's editable ddtree finder (a .pth there) stays off
    Path(purelib, "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The checkout as a source tree (what a git clone or an sdist has), outside the repo."""
    dst = tmp_path_factory.mktemp("src") / "ddtree"
    shutil.copytree(CHECKOUT, dst, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                                  "__pycache__", ".pytest_cache"))
    return dst


def test_wheel_carries_configs_and_the_toy_pair(source, tmp_path):
    _pip("wheel", ".", "-w", str(tmp_path), cwd=source)
    (wheel,) = tmp_path.glob("ddtree-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in ("conf/config.yaml", "conf/model/toy.yaml", "conf/dataset/toy.yaml", "assets/toy/target/config.json",
                "assets/toy/target/model.safetensors", "assets/toy/drafter/model.safetensors",
                "assets/toy/target/model-mtp.safetensors", "assets/toy/target/model.safetensors.index.json",
                "assets/toy/prompts.jsonl", "docs/paper_reference.yaml"):
        assert f"ddtree/_data/{rel}" in names, rel
    assert SHIPPED == ("conf", "assets/toy", "docs/paper_reference.yaml")
    assert not any(n.startswith(("conf/", "assets/", "tests/")) for n in names)  # nothing at the top level


def test_pip_install_runs_from_any_directory_and_writes_under_it(source, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", ".", cwd=source)
    where = tmp_path / "anywhere"
    where.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MLFLOW_DISABLE_TELEMETRY="true")
    site = subprocess.run([str(python), "-c", "import ddtree.paths as p; print(p.IS_CHECKOUT, p.DATA_ROOT)"],
                          cwd=where, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert site[0] == "False" and str(tmp_path / "venv") in site[1]
    proc = subprocess.run([str(python), "-m", "ddtree.run", "method=dflash", "max_new_tokens=8",
                           "dataset.max_samples=1", "warmup=false"], cwd=where, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary,) = (where / "runs").glob("*/*/summary.json")
    s = json.loads(summary.read_text())
    assert (s["model"], s["method"], s["dataset"], s["match_rate"]) == ("toy", "dflash", "toy", 1.0)
    assert (where / "runs" / "mlflow.db").is_file()
    assert not list((tmp_path / "venv").rglob("mlflow.db")) and not list((tmp_path / "venv").rglob("samples.jsonl"))
