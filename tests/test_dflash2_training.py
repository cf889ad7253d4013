"""DFlash2 training as the published recipes train it (docs/training.md, "DFlash2 drafters"): the selector's term
against a slow float64 reference (the k-way CE with and without the label injected, alpha, both denominators), the
stop-gradient boundary, the recipes' metrics against a slow walk, the metric that moves with the selector alone (the
TorchSpec #177 trap), the settings' one-line refusals, and a trained checkpoint in the public layout both ways."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_support import MASK, _direct_features, _records, _target, _train

from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.drafter.dflash2 import DFlash2Drafter
from ddtree.errors import ConfigError
from ddtree.testing.dflash2 import selector_loss_reference, selector_metrics_reference
from ddtree.train.config import to_train_config
from ddtree.train.features import Sample
from ddtree.train.objective import block_loss, drafter_hidden, make_batch, selector_loss

DECAY = 3.0


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def setup(target):
    """A perturbed DFlash2 drafter (the pair term reorders candidates), a batch of blocks, its hidden states."""
    torch.manual_seed(0)
    drafter = DFlash2Drafter.random_for_target(target.config, num_layers=1, block_size=6, target_layer_ids=[1, 3],
                                               mask_token_id=MASK, seed=2, selector_top_k=4, selector_rank=8)
    with torch.no_grad():  # a larger pair term: the selector's choice differs from the unary top-1 at many positions
        drafter.candidate_selector.successor_codebook.mul_(3)
    samples = [Sample(torch.tensor(r["input_ids"]), _direct_features(target, r["input_ids"], [1, 3]),
                      [tuple(r["spans"][0])]) for r in _records(6, seed=4)]
    batch = make_batch(samples, 6, 5, MASK, random.Random(1))
    head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        hidden = drafter_hidden(drafter, target.get_input_embeddings().weight, batch)
    return drafter, batch, head, hidden


@pytest.fixture(scope="module")
def reachable(setup):
    """The same blocks with labels the drafter can draft: at each position its unary top-1 or top-2 (in turn), so
    the unary head is right about half the time and the selector's choice among the candidates decides the rest."""
    drafter, batch, head, hidden = setup
    B, n, L = batch.labels.shape
    with torch.no_grad():
        top2 = (hidden.view(B, n, 6, -1)[:, :, 1:] @ head.T).topk(2, dim=-1).indices
    pick = (torch.arange(B * n * L).view(B, n, L) % 3 == 0).long()
    labels = torch.where(batch.labels >= 0, top2.gather(-1, pick[..., None])[..., 0], batch.labels)
    return drafter, dataclasses.replace(batch, labels=labels), head, hidden


def _term(setup, **kw):
    drafter, batch, head, hidden = setup
    with torch.no_grad():
        return selector_loss(drafter, hidden, head, batch, DECAY, **kw)


@pytest.mark.parametrize("rule,alpha,inject", [("public", 1.0, True), ("public", 0.5, True), ("public", 2.0, False),
                                               ("ours", 0.7, True)])
def test_selector_term_matches_the_slow_reference(setup, rule, alpha, inject):
    drafter, batch, head, hidden = setup
    loss, stats = _term(setup, rule=rule, alpha=alpha, inject_gold=inject)
    want = selector_loss_reference(drafter, head, hidden, batch, DECAY, rule=rule, alpha=alpha, inject_gold=inject)
    assert loss.item() == pytest.approx(want, rel=1e-4)
    assert 0.0 < stats["selector_coverage"] < 1.0  # both kinds of position are in the batch: injection matters here


def test_injection_and_denominators_differ_where_they_should(setup):
    """Injection changes the term where the top-k misses a label; with it, ours and public are the same number."""
    inject = _term(setup, rule="public", inject_gold=True)[0].item()
    strict = _term(setup, rule="public", inject_gold=False)[0].item()
    ours = _term(setup, rule="ours")[0].item()
    assert ours == pytest.approx(inject, rel=1e-6) and abs(inject - strict) > 1e-3
    with pytest.raises(ValueError, match="always injects"):
        _term(setup, rule="ours", inject_gold=False)


def _grads(drafter, target, batch, *, stop_gradient: bool, with_block: bool):
    drafter = copy.deepcopy(drafter).train()
    head = target.get_output_embeddings().weight.detach()
    hidden = drafter_hidden(drafter, target.get_input_embeddings().weight, batch)
    loss, _ = selector_loss(drafter, hidden, head, batch, DECAY, stop_gradient=stop_gradient)
    if with_block:
        loss = loss + block_loss(hidden, head, batch.labels, 6, DECAY)[0]
    loss.backward()
    return {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in drafter.named_parameters()}


def test_stop_gradient_trains_the_selector_alone(setup, target):
    drafter, batch, _, _ = setup
    free = _grads(drafter, target, batch, stop_gradient=False, with_block=False)
    stopped = _grads(drafter, target, batch, stop_gradient=True, with_block=False)
    block_only = _grads(drafter, target, batch, stop_gradient=True, with_block=True)
    sel = [k for k in free if k.startswith("candidate_selector.")]
    backbone = [k for k in free if k not in sel]
    assert len(sel) == 3 and all(stopped[k].abs().sum() > 0 for k in sel)
    for k in sel:  # the selector's own gradient does not depend on the boundary
        torch.testing.assert_close(stopped[k], free[k])
    assert all(stopped[k].abs().sum() == 0 for k in backbone)
    assert sum(free[k].abs().sum() for k in backbone) > 0  # coupled: the term pulls on the unary head and the body
    # with the block loss beside it, the backbone gets exactly the block loss's gradient
    drafter2 = copy.deepcopy(drafter).train()
    head = target.get_output_embeddings().weight.detach()
    hidden = drafter_hidden(drafter2, target.get_input_embeddings().weight, batch)
    block_loss(hidden, head, batch.labels, 6, DECAY)[0].backward()
    for (k, p) in drafter2.named_parameters():
        if k in backbone:
            torch.testing.assert_close(block_only[k], torch.zeros_like(p) if p.grad is None else p.grad)


@pytest.mark.parametrize("labels", ["random", "reachable"])
def test_metrics_match_the_slow_walk(setup, reachable, labels):
    drafter, batch, head, hidden = setup if labels == "random" else reachable
    stats = _term((drafter, batch, head, hidden))[1]
    want = selector_metrics_reference(drafter, head, hidden, batch)
    assert {k: stats[k] for k in want} == pytest.approx(want, rel=1e-5)
    # the selector really departs from the unary head here, on its own path and given the true one
    assert stats["path_tau"] <= stats["oracle_tau"]
    if labels == "reachable":  # the selector really departs from the unary head here
        assert stats["selector_acc_tf"] != stats["unary_acc"] and 1 < stats["path_tau"] and stats["unary_recall"] == 1


def test_selector_metrics_move_with_the_selector_alone(reachable):
    """The TorchSpec #177 trap: a metric read off the unary head cannot see the selector. Changing only the selector's
    weights moves the selector's numbers and leaves the unary ones exactly as they were; with its pair term zeroed
    the walk is the unary chain, whose accepted length block_loss measures independently."""
    drafter, batch, head, hidden = reachable
    before = _term(reachable)[1]
    other = copy.deepcopy(drafter)
    with torch.no_grad():
        other.candidate_selector.predecessor_codebook.normal_(0, 3, generator=torch.Generator().manual_seed(9))
    after = _term((other, batch, head, hidden))[1]
    unary = ("unary_recall", "unary_mass", "unary_acc", "oracle_tau", "selector_coverage")
    assert {k: after[k] for k in unary} == {k: before[k] for k in unary}
    assert after["selector_acc_tf"] != before["selector_acc_tf"] and after["path_tau"] != before["path_tau"]
    with torch.no_grad():
        other.candidate_selector.successor_codebook.zero_()
    flat = _term((other, batch, head, hidden))[1]
    chain = block_loss(hidden, head, batch.labels, 6, DECAY)[1]
    assert flat["selector_acc_tf"] == pytest.approx(flat["unary_acc"])
    assert flat["path_tau"] == pytest.approx(chain["tau_proxy"]) and flat["unary_acc"] == pytest.approx(chain["acc"])


@pytest.mark.parametrize("over,expected", [
    ({"loss": "theirs"}, "optim.selector.loss: unknown value 'theirs'"),
    ({"alpha": -1.0}, "optim.selector.alpha: must be a finite number >= 0"),
    ({"loss": "ours", "stop_gradient": True}, "optim.selector.loss: the 'ours' loss always injects"),
])
def test_bad_selector_settings_are_refused(over, expected):
    cfg = {"out_dir": "x", "target": {"name_or_path": "t"}, "stages": ["train"], "optim": {"selector": over}}
    with pytest.raises(ConfigError) as err:
        to_train_config(cfg)
    assert str(err.value).startswith(expected), str(err.value)


def test_cli_refuses_a_bad_selector_loss_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ddtree.train", f"out_dir={tmp_path}", "target.name_or_path=x",
                        "stages=[train]", "tracking=none", "optim.selector.loss=theirs"],
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "optim.selector.loss" in lines[0], p.stderr


def test_a_trained_checkpoint_is_in_the_public_layout_both_ways(tmp_path, target):
    """ddtree trains (public loss, metrics in the summary) and saves the published tensor set and config; a checkpoint
    written in the published form by hand (block_size inside dflash_config, SpecForge's export) starts a training."""
    start = DFlash2Drafter.random_for_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                             mask_token_id=MASK, seed=0, selector_top_k=4, selector_rank=8,
                                             perturb=False)
    drafter, summary, _ = _train(tmp_path / "a", target, 10, drafter=start)
    assert {"final_path_tau", "probe_path_tau", "probe_oracle_tau", "probe_selector_acc_tf"} <= set(summary)
    ckpt = tmp_path / "a" / "checkpoints" / "step_000010"
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(raw["dflash_config"])
    names = set(load_file(ckpt / "model.safetensors"))
    public = {"fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.predecessor_codebook",
              "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"}
    layer = {f"layers.0.{m}" for m in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                       "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                       "input_layernorm.weight", "post_attention_layernorm.weight",
                                       "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                                       "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")}
    assert names == public | layer
    # the other way: the same tensors under a config written as SpecForge exports it
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    raw["is_causal"] = False
    (theirs / "config.json").write_text(json.dumps(raw))
    save_file(load_file(ckpt / "model.safetensors"), theirs / "model.safetensors")
    loaded = DFlashDrafter.from_pretrained(theirs)
    assert type(loaded) is DFlash2Drafter and loaded.block_size == 4
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, drafter.state_dict()[k], rtol=0, atol=0)
    again, summary2, losses = _train(tmp_path / "b", target, 5, drafter=loaded)
    assert losses and "final_selector_loss" in summary2


@pytest.mark.slow  # a whole data / extract / train run with two curve evaluations (~4 min on the busy 2-core CPU)
def test_cli_trains_a_dflash2_drafter_and_reports_the_selector(tmp_path):
    """python -m ddtree.train drafter.arch=dflash2 with the default selector settings (the public loss): each log
    line carries the selector's numbers, every evaluation the probe's (MLflow probe/...), the summary the last ones,
    and the drafter is a DFlash2 checkpoint the run pipeline loads."""
    import os

    from train_support import _history, _pipeline_cfg

    cfg = _pipeline_cfg(tmp_path, "d2")
    args = [f"out_dir={tmp_path / 'd2'}", f"target.name_or_path={cfg['target']['name_or_path']}",
            "data.source=texts", f"data.texts={cfg['data']['texts']}", "stages=[data,extract,train]",
            "extract.dtype=float32", "device=cpu", "drafter.arch=dflash2", "drafter.num_layers=1",
            "drafter.block_size=4", "drafter.target_layer_ids=[1,3]", "drafter.selector_top_k=4",
            "drafter.selector_rank=8", "optim.max_steps=4", "optim.log_every=1", "optim.batch_size=4",
            "optim.anchors_per_seq=4", "optim.warmup_steps=1", f"eval.prompts={cfg['eval']['prompts']}",
            "eval.every=2", "eval.curve_budget=4", "eval.curve_samples=1", "eval.max_new_tokens=8",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.run_name=d2"]
    p = subprocess.run([sys.executable, "-m", "ddtree.train", *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert sum("path tau" in ln and "oracle" in ln for ln in lines) == 4, p.stdout[-2000:]
    assert [ln.split()[2] for ln in lines if " probe " in ln] == ["2", "4"], p.stdout[-2000:]
    assert [s for s, _ in _history(tmp_path, "d2", "probe/path_tau")] == [2, 4]
    assert len(_history(tmp_path, "d2", "train/selector_acc_tf")) == 4
    summary = json.loads((tmp_path / "d2" / "summary.json").read_text())["stages"]["train"]
    assert 1.0 <= summary["probe_path_tau"] <= summary["probe_oracle_tau"]
    assert type(DFlashDrafter.from_pretrained(tmp_path / "d2" / "drafter")) is DFlash2Drafter
