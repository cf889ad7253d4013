"""What a round asks of a GPU, counted on the CPU: one host read a round, ops booked per stage, the CPU-only
branches switchable (ddtree.engine.host), and the lossless grid on the path a CUDA run takes."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine import host
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.options import EngineOptions, current
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model


def test_the_counter_sees_each_kind_of_host_read():
    """The reference for the counts below: each device->host read a GPU would wait on, and nothing else."""
    x = torch.randn(6)
    with torch.inference_mode(), DispatchCount() as c:
        y = x * 2 + 1  # no read
        y.view(2, 3)
    assert c.total(c.syncs) == 0 and c.total(c.ops) >= 3 and c.total(c.kernel_ops) == 2
    reads = [lambda y: y[0].item(), lambda y: int(y[1]), lambda y: y.tolist(), lambda y: y[y > 0],
             lambda y: y.nonzero(), lambda y: bool(y[0] > 0), lambda y: y.numpy()]
    for read in reads:
        with torch.inference_mode(), DispatchCount() as c:
            read(x * 2)
        assert c.total(c.syncs) == 1, dict(c.sync_names)
    assert torch.Tensor.tolist is not None and "read" not in torch.Tensor.tolist.__qualname__  # unwrapped after
    # host->device copies (a CUDA run waits on them too; a CPU run shows no transfer: counted at the Python call)
    import numpy as np

    dev = x.device
    writes = [lambda: torch.tensor([1, 2], device=dev), lambda: torch.as_tensor([1.0], device=dev),
              lambda: torch.tensor([3, 4]).to(dev), lambda: torch.from_numpy(np.arange(3)).to(device=dev),
              lambda: torch.zeros(2, dtype=torch.long, device=dev).copy_(torch.tensor([5, 6]))]
    for write in writes:
        with torch.inference_mode(), DispatchCount() as c:
            write()
        assert c.total(c.syncs) == 1, dict(c.sync_names)
    stays = [lambda: torch.tensor([1, 2]), lambda: torch.full((3,), 7, device=dev), lambda: torch.arange(4, device=dev),
             lambda: (x * 2).to(dev), lambda: torch.as_tensor(x, device=dev), lambda: x.to(torch.float64)]
    for stay in stays:  # data that stays on the host, tensors made on the device, moves of device tensors: no copy
        with torch.inference_mode(), DispatchCount() as c:
            stay()
        assert c.total(c.syncs) == 0, dict(c.sync_names)
    assert "make" not in torch.tensor.__qualname__ and "to" == torch.Tensor.to.__name__  # unwrapped after


CASES = [("qwen3", "ar", None), ("qwen3", "dflash", None), ("qwen3", "ddtree", 16), ("qwen3_5_text", "ar", None),
         ("qwen3_5_text", "dflash", None), ("qwen3_5_text", "ddtree", 64)]


@pytest.mark.parametrize("model_type,method,budget,temperature", [
    *((*case, 0.0) for case in CASES), ("qwen3", "dflash", None, 1.0)])  # T > 0: the sampled chain's rejection walk
def test_a_round_reads_the_device_once(model_type, method, budget, temperature):
    """On the path a CUDA run takes: the prefill's first token, then one read a round (the walk's), whatever the
    stage timer does (CUDA events there, never a synchronize: tests/test_gpu.py), and where the proposer drafts
    one read per generation for the diagnosis records (ddtree.engine.diagnostics)."""
    target = tiny_model(model_type, seed=6, attn_implementation="sdpa", vocab_size=12)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3)
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    with host.device_path():
        engine = ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget)
        engine.generate(ids, max_new_tokens=4, temperature=temperature, generator=g)  # first-call work
        with DispatchCount(layers=True) as c:
            res = engine.generate(ids, max_new_tokens=20, temperature=temperature, generator=g)
    assert res.rounds >= 3
    # every verification op booked under one decoder layer kind or outside them; each lean layer once a round
    assert sum(v for (stage, _), v in c.layer_ops.items() if stage == "verify") == c.ops["verify"]
    types = getattr(target.config, "layer_types", None) or ["full_attention"] * target.config.num_hidden_layers
    for kind in ("linear_attention", "full_attention"):
        assert c.layer_calls[("verify", kind)] == types.count(kind) * res.rounds
        assert (c.layer_ops[("verify", kind)] > 0) == (kind in types)
    # the prefill's first token (read in the loop), one a round, the diagnosis records' one per generation
    assert c.total(c.syncs) == res.rounds + 1 + (method != "ar"), dict(c.sync_names)
    assert c.syncs["commit"] == res.rounds  # the walk's read, booked where it happens
    assert c.syncs["prefill"] == 0, dict(c.sync_names)  # the GDN layers' cache counters made on the device
    if method != "ar":
        assert c.ops["draft"] > 0 and c.ops["tree"] > 0
    assert c.ops["verify"] > 0 and c.ops["prefill"] > 0


@pytest.mark.parametrize("topk,budget,temperature", [(1, None, 0.0), (3, 10, 0.0), (1, None, 1.0)])
def test_an_mtp_round_reads_the_device_once(topk, budget, temperature):
    """method=mtp, its chain and its EAGLE tree: the head's expansion stays on the device (top-k, frontier and the
    kept nodes by stable sorts), so a round reads once, at the walk."""
    from ddtree.engine.drafter.mtp import MTPHead

    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12)
    head = MTPHead.random_for_target(target, seed=0)
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1))
    with host.device_path():
        engine = ddtree.Engine(target, head, method="mtp", steps=3, topk=topk, budget=budget or 64)
        g = torch.Generator().manual_seed(0)
        engine.generate(ids, max_new_tokens=4, temperature=temperature, generator=g)
        with DispatchCount(layers=True) as c:
            res = engine.generate(ids, max_new_tokens=20, temperature=temperature, generator=g)
    assert res.rounds >= 3
    # every verification op booked under one decoder layer kind or outside them; each lean layer once a round
    assert sum(v for (stage, _), v in c.layer_ops.items() if stage == "verify") == c.ops["verify"]
    types = getattr(target.config, "layer_types", None) or ["full_attention"] * target.config.num_hidden_layers
    for kind in ("linear_attention", "full_attention"):
        assert c.layer_calls[("verify", kind)] == types.count(kind) * res.rounds
        assert (c.layer_ops[("verify", kind)] > 0) == (kind in types)
    assert c.total(c.syncs) == res.rounds + 1, dict(c.sync_names)  # + the prefill's token, read in the loop
    assert c.syncs["prefill"] == 0, dict(c.sync_names)  # the GDN layers' cache counters made on the device
    assert c.syncs["draft"] == c.syncs["tree"] == 0


# Ops a steady-state round dispatches on the device path, by stage, on the tiny 4-layer targets below (qwen3_5_text:
# 3 GDN layers and 1 attention layer): the counts after issue 30's eager work (GDN views made once, RoPE tables, the
# AR token through the tree-exact GDN). Before it verify was 257 / 380 / 378 (qwen3: AR / DFlash / DDTree 16) and
# 438 / 471 / 463 (qwen3_5_text); the drafter 103. More than these is a regression (bench/bench_launches.py counts the
# 64-layer structures).
ROUND_OPS = {("qwen3", "ar"): {"verify": 180, "commit": 5},
             ("qwen3", "dflash"): {"draft": 69, "tree": 6, "verify": 201, "commit": 35},
             ("qwen3", "ddtree"): {"draft": 69, "tree": 15, "verify": 199, "commit": 68},
             ("qwen3_5_text", "ar"): {"verify": 100, "commit": 37},
             ("qwen3_5_text", "dflash"): {"draft": 69, "tree": 6, "verify": 126, "commit": 67},
             ("qwen3_5_text", "ddtree"): {"draft": 69, "tree": 15, "verify": 118, "commit": 111}}
# (a hybrid's commit: +1 op from transformers 5.25, the GDN layers' token counts advanced together (gdn.commit._count_tokens),
# which its get_seq_length of a cache whose first layer is linear reads)
# (commit holds the diagnosis records: their format 2, the row sketches, added 8-11 ops a round; a gated attention
# layer's gate is copied contiguous before its sigmoid, as the module does: +1 op, bitwise on AVX-512 CPUs. Then the
# attention and drafter work of branch attn-ops: the lerp merge, index_copy_ cache writes in the projections' layout,
# lazy cache views, the text M-RoPE table, fused drafter norms: measured before it, verify 197 / 270 / 268 (qwen3)
# and 216 / 258 / 250 (qwen3_5_text, after gdn-ops), draft 87, DDTree commit 92 / 128. Then the fused tails of
# ddtree.engine.kernels.attention, one op each: the MLP's silu * up (-1 a layer, target and drafter) and a split
# verification's merge with its layout, cast and gate (-8 a float32 qwen3 attention layer, -10 a gated one): before
# them verify 184 / 229 / 227 (qwen3) and 190 / 225 / 217 (qwen3_5_text), draft 70. Then the GDN layer's fused ops
# (ddtree.engine.kernels.gdn, -16 a GDN layer): qwen3_5_text's verify measured 148 / 174 / 166 before them. DDTree's
# tree stage: 72 before the build after the top-k became one fused op, ddtree::tree_build (ddtree.engine.kernels.tree))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_ops_a_round_do_not_regress(model_type):
    """Steady-state ops a round by stage (two generations of one prompt, the longer one's extra rounds), device path."""
    target = tiny_model(model_type, seed=6, attn_implementation="sdpa", vocab_size=12)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3)
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1))
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16)):
        with host.device_path():
            engine = ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget)
            engine.generate(ids, max_new_tokens=4)  # first-call work
            counts, rounds = [], []
            for n in (8, 24):
                with DispatchCount() as c:
                    rounds.append(engine.generate(ids, max_new_tokens=n).rounds)
                counts.append(c)
        extra = rounds[1] - rounds[0]
        assert extra >= 2
        per_round = {stage: (counts[1].ops[stage] - counts[0].ops[stage]) / extra
                     for stage in ("draft", "tree", "verify", "commit")}
        limits = ROUND_OPS[(model_type, method)]
        assert all(per_round[stage] <= limits.get(stage, 0) for stage in per_round), (method, per_round, limits)


def test_the_switch_turns_each_branch_off_and_back(monkeypatch):
    monkeypatch.delenv("DDTREE_DEVICE_PATH", raising=False)
    cpu = torch.device("cpu")

    def on(name, device=cpu):  # as an engine built here would decide (its options resolved in the scope)
        return host.host_branch(name, device, EngineOptions.resolve())

    assert all(on(name) for name in host.HOST_BRANCHES)
    assert not on("host_tree", torch.device("meta"))
    with host.device_path("host_tree"):
        assert not on("host_tree") and on("gdn_step")
        assert not host.host_branch("host_tree", cpu, current())  # what transformers-called code reads in scope
        with host.device_path():
            assert not any(on(name) for name in host.HOST_BRANCHES)
        assert on("gdn_step")
    assert all(on(name) for name in host.HOST_BRANCHES)
    with pytest.raises(ValueError, match="unknown branch"):
        host._parse_off("host_tree,nonsense")


def test_the_device_path_takes_no_cpu_branch(monkeypatch):
    """Under device_path() the engine builds the tree with torch ops, verifies through split attention with the
    head on every row, and verifies an AR token as a one-node tree through the tree-exact GDN (the single-token
    CPU step `_step_forward` is not even asked): none of the CPU-only code runs."""
    from ddtree.engine import gdn, target, tree

    called = []
    for owner, name in ((tree, "_best_first_host"), (tree, "host_walk"),
                        (gdn.forward, "_step_forward"), (target.TargetSession, "_dense_mask")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    model = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12)
    drafter = DFlashDrafter.random_for_target(model.config, block_size=8, seed=3)
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1))
    with host.device_path():
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 100)):
            ddtree.generate(model, drafter, ids, method=method, budget=budget, max_new_tokens=12)
    assert not called
    called.clear()
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 100)):
        ddtree.generate(model, drafter, ids, method=method, budget=budget, max_new_tokens=12)
    assert {"_best_first_host", "_dense_mask", "_step_forward"} <= set(called)  # the CPU default takes them


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_the_device_path_is_lossless(model_type):
    """The lossless grid on the code a CUDA run takes (every CPU-only branch off), against HF greedy."""
    vocab = 12
    target = tiny_model(model_type, seed=6, attn_implementation="sdpa", vocab_size=vocab)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (1, n), generator=g) for n in (3, 14)]
    deepest = 0
    with host.device_path():
        for bs in (4, 16):
            drafter = DFlashDrafter.random_for_target(target.config, block_size=bs, seed=bs)
            for ids in prompts:
                ref = hf_greedy(target, ids, 16)
                assert ddtree.generate(target, drafter, ids, method="ar", max_new_tokens=16).output_ids == ref
                assert ddtree.generate(target, drafter, ids, method="dflash", max_new_tokens=16).output_ids == ref
                for budget in (7, 100):
                    res = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=16)
                    assert res.output_ids == ref, f"ddtree block {bs} budget {budget}"
                    deepest = max(deepest, max(res.acceptance_lengths))
    assert deepest >= 3
