"""engine=upstream: the authors' generate functions (a stand-in checkout here) on our models and metrics.

tests/compat_fixtures/upstream_checkout is written in the shape of the authors' repository (their
function names, signatures, returned fields and 4.x call style); it is not their code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import copy_checkout

from ddtree.engine.drafter import DFlashDrafter
from ddtree.errors import ConfigError
from ddtree.pipeline import config_checks as V
from ddtree.pipeline import schema as C
from ddtree.tiny import tiny_model
from ddtree.upstream.engine import (
    UpstreamResult,
    generate_upstream,
    load_upstream_engine,
    to_result,
    upstream_drafter,
)

STAND_IN = Path(__file__).resolve().parent / "compat_fixtures" / "upstream_checkout"


pytestmark = pytest.mark.usefixtures("clean_compat")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return copy_checkout("upstream_checkout", tmp_path)


@pytest.fixture(scope="module")
def models():
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa")
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=8, seed=0)
    return target, drafter


def greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, target(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0, ids.shape[1]:].tolist()


# ------------------------------------------------------------------ the run CLI


@pytest.mark.slow  # a CLI subprocess, ~15 s: make test-slow (the engine's own tests above stay in make test)
def test_run_cli_engine_upstream_writes_samples_and_summary(cli, checkout, tmp_path):
    job = tmp_path / "job"
    proc = cli("engine=upstream", f"upstream.path={checkout}", "model=tiny_qwen3", "drafter=tiny", "method=ddtree",
               "budget=8", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "tracking=none",
               f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["role"], r["method"]) for r in samples}) == [("baseline", "ar"), ("method", "ddtree")]
    assert all(r["engine"] == "upstream" and "stage_seconds" in r["upstream"] for r in samples)
    assert all(sum(r["acceptance_lengths"]) == len(r["output_ids"]) - 1 for r in samples)
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["engine"], summary["method"], summary["budget"]) == ("upstream", "ddtree", 8)
    assert summary["match_rate"] == 1.0  # their DDTree reproduces their AR (and greedy decoding)
    assert summary["compat"]["patches"]["upstream-gdn-tree"] == "applied"
    assert (job / "config_resolved.yaml").read_text().count(str(checkout)) == 1


def test_run_cli_engine_upstream_bad_path_is_one_line(cli, tmp_path):
    proc = cli("engine=upstream", f"upstream.path={tmp_path / 'nope'}", "tracking=none",
               f"hydra.run.dir={tmp_path / 'job'}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: upstream.path:") and "does not exist" in lines[0]


# ------------------------------------------------------------------ config validation


def _rc(**overrides) -> C.RunConfig:
    rc = C.RunConfig()
    rc.model = C.ModelConfig(name="tiny_qwen3", tiny=C.TinyModelConfig())
    rc.drafter = C.DrafterConfig(kind="random")
    rc.tracking = C.TrackingConfig(backend="none")
    rc.device = "cpu"
    for key, value in overrides.items():
        obj, _, name = key.rpartition(".")
        setattr(getattr(rc, obj) if obj else rc, name, value)
    return rc


def test_validate_engine_upstream(checkout, tmp_path):
    assert V.validate(_rc(engine="upstream", **{"upstream.path": str(checkout)})).engine == "upstream"
    for path, words in ((None, "not set"), (str(tmp_path / "nope"), "does not exist"),
                        (str(tmp_path), "lacks ddtree.py")):
        with pytest.raises(ConfigError) as info:
            V.validate(_rc(engine="upstream", **{"upstream.path": path}))
        assert info.value.setting == "upstream.path" and words in str(info.value)
    with pytest.raises(ConfigError, match="attention.target: engine=upstream verifies the tree"):
        V.validate(_rc(engine="upstream", **{"upstream.path": str(checkout), "attention.target": "flex_attention"}))


def test_load_upstream_engine_import_failure_is_a_config_error(checkout):
    (checkout / "dflash.py").write_text("raise ImportError('broken checkout')\n")
    with pytest.raises(ConfigError) as info:
        load_upstream_engine(checkout)
    assert info.value.setting == "upstream.path" and "broken checkout" in str(info.value)


# ------------------------------------------------------------------ generate_upstream


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_generate_upstream_equals_greedy(checkout, models, method):
    target, drafter = models
    up = load_upstream_engine(checkout)
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    res = generate_upstream(up, target, drafter if method != "ar" else None, ids, method=method, budget=6,
                            max_new_tokens=12)
    assert isinstance(res, UpstreamResult) and res.engine == "upstream"
    assert res.output_ids == greedy(target, ids, 12) and res.method == method and res.prompt_len == 9
    assert sum(res.acceptance_lengths) == len(res.output_ids) - 1 and res.stopped_by == "max_new_tokens"
    assert (res.budget, res.block_size) == {"ar": (None, None), "dflash": (None, 8), "ddtree": (6, 8)}[method]
    assert res.ttft_s > 0 and res.decode_s > 0 and res.stage_seconds["verify"] > 0
    assert (res.stage_seconds["tree"] > 0) == (method == "ddtree")
    assert res.upstream["num_output_tokens"] == 12 and len(res.upstream["acceptance_lengths"]) == res.rounds
    assert set(res.to_dict()) >= {"engine", "upstream", "tau", "tokens_per_s"}


def test_generate_upstream_stop_token_and_sampling(checkout, models):
    target, drafter = models
    up = load_upstream_engine(checkout)
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = greedy(target, ids, 12)
    stop = expected[4]
    res = generate_upstream(up, target, drafter, ids, method="ddtree", budget=6, max_new_tokens=12,
                            stop_token_ids=[stop])
    assert res.output_ids == expected[: expected.index(stop) + 1] and res.stopped_by == "stop_token"
    state = torch.get_rng_state()
    runs = [generate_upstream(up, target, drafter, ids, method="dflash", temperature=1.0, max_new_tokens=10,
                              generator=torch.Generator().manual_seed(seed)).output_ids for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2] and torch.equal(torch.get_rng_state(), state)


def test_upstream_drafter_shares_our_tensors(checkout, models):
    _, drafter = models
    up = load_upstream_engine(checkout)
    theirs = upstream_drafter(up, drafter)
    assert isinstance(theirs, up.DFlashDraftModel) and upstream_drafter(up, theirs) is theirs
    ours = dict(drafter.named_parameters())
    assert all(p.data_ptr() == ours[name].data_ptr() for name, p in theirs.named_parameters())
    assert (theirs.block_size, theirs.mask_token_id, theirs.target_layer_ids) == (
        drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids)
    assert upstream_drafter(up, drafter) is theirs  # built once per drafter: calls time generation only
    moved = copy.deepcopy(drafter)  # other tensors: another twin
    assert upstream_drafter(up, moved) is not theirs


def test_to_result_maps_their_fields():
    """Their acceptance lengths are capped to the tokens kept; mask tokens in the prompt shift their output."""
    raw = SimpleNamespace(output_ids=torch.tensor([[5, 6, 1, 2, 3, 4]]), num_output_tokens=4,
                          time_to_first_token=0.5, time_per_output_token=0.25, acceptance_lengths=[2, 3],
                          stage_times={"draft": 1.0, "tree_build": 0.5, "tree_compile": 0.25, "verify": 2.0,
                                       "commit": 0.125, "tree_build_heap": 0.1}, round_timestamps=[0.1, 0.2])
    prompt = torch.tensor([[5, 9, 6]])  # their filter removed the mask token 9 from the prompt
    res = to_result(raw, prompt, method="ddtree", mask_token_id=9, stops=[4], wall_s=2.0, temperature=0.0,
                    budget=4, block_size=8, max_new_tokens=4)
    assert res.output_ids == [1, 2, 3, 4] and res.acceptance_lengths == [2, 1] and res.stopped_by == "stop_token"
    assert res.stage_seconds == {"draft": 1.0, "tree": 0.75, "verify": 2.0, "commit": 0.125}
    assert (res.ttft_s, res.decode_s, res.upstream["decode_s"]) == (0.5, 1.5, 1.0)
    assert res.upstream["acceptance_lengths"] == [2, 3] and res.upstream["stage_seconds"]["tree_build_heap"] == 0.1
