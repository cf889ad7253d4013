"""ddtree.upstream.loader.load_upstream on a stand-in checkout laid out like the DDTree authors' repository."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import copy_checkout

import compat
from compat.patches import UPSTREAM_PACKAGE
from ddtree.errors import ConfigError
from ddtree.tiny import tiny_model
from ddtree.upstream.loader import UpstreamError, load_upstream

FAKE = Path(__file__).resolve().parent / "compat_fixtures" / "fake_upstream"


pytestmark = pytest.mark.usefixtures("clean_compat")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return copy_checkout("fake_upstream", tmp_path)


def _greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, target(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0, ids.shape[1] :].tolist()


def test_load_upstream_imports_under_private_names(checkout):
    ours = sys.modules.get("ddtree")
    up = load_upstream(checkout)
    assert (
        up.ddtree.__name__ == f"{UPSTREAM_PACKAGE}.ddtree"
        and up.model.__name__ == f"{UPSTREAM_PACKAGE}.model"
    )
    # imported in place, not copied
    assert Path(up.ddtree.__file__).resolve() == (checkout / "ddtree.py").resolve()
    assert sys.modules.get("ddtree") is ours and "model" not in sys.modules and "dflash" not in sys.modules
    assert up.ddtree.ToyDrafter is up.model.ToyDrafter  # their `from model import ...` got the private module
    assert set(up.stubs) <= {"datasets", "loguru"} and not any(name in sys.modules for name in up.stubs)
    assert not list(checkout.rglob("*.pyc"))  # nothing written into the checkout
    assert load_upstream(checkout) is up  # cached while its modules are loaded
    statuses = {e["id"]: e["status"] for e in up.patches}
    assert statuses["cache-crop-absolute"] == "applied"


def test_upstream_cuda_timer_on_cpu_and_its_revert(checkout):
    if torch.cuda.is_available():
        pytest.skip("the patch is skipped (condition) where CUDA exists")
    up = load_upstream(checkout)
    entry = next(e for e in up.patches if e["id"] == "upstream-cuda-timer")
    assert entry["status"] == "applied" and "_ddtree_upstream.ddtree" in entry["detail"]
    assert isinstance(up.dflash.cuda_time(), float)
    assert up.ddtree.cuda_time is up.dflash.cuda_time
    compat.revert()
    original = vars(up.dflash)["cuda_time"]
    assert not hasattr(original, "__wrapped__") and up.ddtree.cuda_time is original
    # the break the patch exists for: a CPU build of torch asserts, a CUDA build on a machine without a GPU raises
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        original()


def test_upstream_cuda_timer_skipped_where_cuda_exists(checkout, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    up = load_upstream(checkout)
    entry = next(e for e in up.patches if e["id"] == "upstream-cuda-timer")
    assert entry["status"] == "skipped-condition"


def test_upstream_generate_runs_through_the_patches(checkout):
    """Their 4.x-style loop (bare DynamicCache, past_key_values=, crop(start)) on a 5.24 target equals greedy."""
    up = load_upstream(checkout)
    target = tiny_model("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight[2:] = 0  # two live tokens: the repeat-last-token drafter is accepted often
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(9))
    tokens, accepted, elapsed = up.ddtree_generate(target, ids, max_new_tokens=12)
    assert tokens[0, ids.shape[1] :].tolist() == _greedy(target, ids, 12)
    assert max(accepted) > 1 and elapsed >= 0


def test_upstream_stub_explains_missing_optional_dependency(checkout, monkeypatch):
    import ddtree.upstream.loader

    real = {name: sys.modules.get(name) for name in ("datasets", "loguru")}
    monkeypatch.setattr(ddtree.upstream.loader, "_installed", lambda name: False)  # as on a machine without them
    up = load_upstream(checkout)
    assert up.stubs == ("datasets", "loguru")
    assert all(sys.modules.get(name) is module for name, module in real.items())  # stubs only during import
    with pytest.raises(UpstreamError, match="needs the `datasets` package"):
        up.model.load_prompts("gsm8k")
    up.ddtree.logger.info("goes to the stdlib logger")


def test_another_path_replaces_the_loaded_modules(checkout, tmp_path):
    first = load_upstream(checkout)
    other = tmp_path / "second"
    shutil.copytree(FAKE, other)
    second = load_upstream(other)
    assert second is not first and second.path == other.resolve()
    assert sys.modules[f"{UPSTREAM_PACKAGE}.dflash"] is second.dflash
    entry = next(e for e in compat.report() if e["id"] == "upstream-cuda-timer")
    if not torch.cuda.is_available():
        assert entry["status"] == "applied" and isinstance(second.dflash.cuda_time(), float)


@pytest.mark.parametrize("setting", [None, "", "missing-dir", "a-file", "empty-dir", "no-model"])
def test_upstream_path_errors_name_the_setting_and_the_layout(setting, tmp_path, checkout):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    shutil.rmtree(checkout / "model")
    path = None if setting is None else ("" if setting == "" else tmp_path / setting)
    if setting == "no-model":
        path = checkout
    with pytest.raises(UpstreamError) as info:
        load_upstream(path)
    message = str(info.value)
    assert message.startswith("upstream.path:") and "ddtree.py, dflash.py and model/" in message
    if setting == "no-model":
        assert "lacks model/__init__.py" in message
    assert isinstance(info.value, ConfigError) and info.value.setting == "upstream.path" and info.value.fix
    assert UPSTREAM_PACKAGE not in sys.modules


def test_upstream_import_failure_is_an_upstream_error(checkout):
    (checkout / "ddtree.py").write_text("from dflash import no_such_function\n")
    with pytest.raises(UpstreamError, match="importing the authors' code .* failed: ImportError"):
        load_upstream(checkout)
    assert not [n for n in sys.modules if n.startswith(UPSTREAM_PACKAGE)]
    assert "dflash" not in sys.modules and "model" not in sys.modules
