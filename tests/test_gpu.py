"""Lossless and verdict tests on a CUDA device (`pytest -m gpu`; skipped without one; bench/device_all.sh runs them).

Grid: fp32 and bf16 x sdpa and flash_attention_2 (where flash-attn is installed) x split and dense tree
attention x AR / DFlash / DDTree, on a tiny pure-attention Qwen3 and a tiny hybrid Qwen3.5 (GDN) target.
fp32: every method equals HF greedy decoding. bf16: exact equality is no test (ties within a few bf16 steps,
see DESIGN.md), so each output gets a verdict against a teacher-forced target forward: every emitted token
is the target's argmax within a dtype-derived tolerance. The split path must run on the CUDA kernels
(aten flash / efficient, flash-attn), not the math fallback.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ddtree
from ddtree.engine import attention as A
from ddtree.engine.drafter import DFlashDrafter
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
VOCAB = 12  # random drafts are accepted several deep
NEW = 24
RUNS = [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 48)]


@pytest.fixture(autouse=True)
def exact_fp32():
    """No TF32 (cuDNN convolutions allow it by default): fp32 must be fp32 for the greedy comparison."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _pair(model_type: str, attn: str, dtype: torch.dtype):
    target = tiny_model(model_type, seed=3, attn_implementation=attn, vocab_size=VOCAB, dtype=dtype).to("cuda")
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=1)
    return target, drafter.to(device="cuda", dtype=dtype)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (1, n), generator=g).to("cuda") for n in (3, 17)]


def verdict(target, prompt: torch.Tensor, output: list[int]) -> list[int]:
    """Positions where an emitted token is not the teacher-forced target's argmax within the dtype's tolerance."""
    ids = torch.cat([prompt[0], torch.tensor(output, device=prompt.device)])[None]
    with torch.inference_mode():
        logits = target(ids).logits[0, prompt.shape[1] - 1: -1].float()
    best = logits.max(-1).values
    chosen = logits.gather(-1, ids[0, prompt.shape[1]:, None])[:, 0]
    eps = torch.finfo(target.dtype).eps
    tol = 4 * eps * best.abs().clamp(min=1.0)  # a few steps of the dtype at the logit's magnitude
    return (best - chosen > tol).nonzero().flatten().tolist()


def _modes(attn: str) -> list[str]:
    return ["split", "dense"] if attn == "sdpa" else ["split"]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("flash_attention_2", marks=pytest.mark.skipif(
    not HAS_FLASH, reason="flash-attn not installed"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_methods_on_cuda(model_type, attn, dtype):
    if attn == "flash_attention_2" and dtype == torch.float32:
        pytest.skip("flash-attn has no fp32 kernels")
    target, drafter = _pair(model_type, attn, dtype)
    for ids in _prompts():
        ref = hf_greedy(target, ids, NEW) if dtype == torch.float32 else None
        for mode in _modes(attn):
            for method, budget in RUNS:
                res = ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=NEW,
                                      tree_attention=mode)
                where = (model_type, attn, str(dtype), mode, method, budget)
                assert len(res.output_ids) == NEW, where
                if ref is not None:
                    assert res.output_ids == ref, where
                else:
                    assert verdict(target, ids, res.output_ids) == [], where
    kernels = {k: v for k, v in A.chosen_kernels().items() if "/cuda/" in k}
    assert kernels and all(v != "math" for v in kernels.values()), kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_equals_dense_verification_on_cuda(dtype):
    """One DDTree-shaped tree after a prefill: split and dense logits agree within the dtype's noise."""
    from ddtree.engine.target import TargetSession
    from ddtree.engine.tree import best_first_tree

    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=256, dtype=dtype).to("cuda")
    logp = torch.log_softmax(torch.randn(15, 256, generator=torch.Generator().manual_seed(1)) * 3, -1).cuda()
    tree = best_first_tree(torch.tensor(5, device="cuda"), logp, 64)
    prefix = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(2)).cuda()
    out = {}
    for mode in ("split", "dense"):
        session = TargetSession(target, tree_attention=mode)
        session.prefill(prefix)
        out[mode] = session.verify(tree)[0].float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out["split"], out["dense"], rtol=tol, atol=tol)


def test_drafter_cache_on_cuda():
    """The preallocated drafter cache on CUDA equals one call over the whole context."""
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa")
    drafter = DFlashDrafter.random_for_target(target.config, block_size=6).to("cuda")
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 40, len(drafter.target_layer_ids) * 64, generator=g).cuda()
    cache, held = drafter.new_cache(capacity=4), 0
    for c in (9, 3, 5, 1, 6, 2):
        noise = torch.randn(1, 6, 64, generator=g).cuda()
        blk = torch.arange(held + c, held + c + 6, device="cuda")[None]
        out = drafter(noise, feats[:, held: held + c], torch.arange(held, held + c, device="cuda")[None], blk, cache)
        held += c
        whole = drafter(noise, feats[:, :held], torch.arange(held, device="cuda")[None], blk)
        torch.testing.assert_close(out, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_on_cuda_matches_the_module(dtype):
    """The lean forward's norm on CUDA (the fused op's Triton kernel, ddtree.engine.kernels.norm; the engine's
    inference mode) against the module's formula: equal within the last bit of the dtype (the kernel reduces in
    another order); the residual add folded in likewise. Strict: a kernel that fails its first-call check fails
    here, not falls back."""
    from ddtree.engine import kernels
    from ddtree.engine.forward import lean_add_norm

    strict = kernels.KernelChecks("strict")  # what an Engine(kernels="strict") enters around its calls
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from ddtree.engine.forward import lean_norm

    g = torch.Generator().manual_seed(0)
    for cls in (Qwen3RMSNorm, Qwen3_5RMSNorm):
        for width in (64, 5120):
            norm = cls(width, eps=1e-6).to("cuda", dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(width, generator=g))
            fused, fused_add = lean_norm(norm), lean_add_norm(norm)
            assert fused is not norm.forward
            x = (torch.randn(3, 17, width, generator=g) * 3).to("cuda", dtype)
            h = torch.randn(3, 17, width, generator=g).to("cuda", dtype)
            with torch.inference_mode(), kernels.checking(strict):
                got, (got_add, total) = fused(x), fused_add(h, x)
                want, want_total = norm(x), x + h
                want_add = norm(want_total)
            tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-6}
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(got_add, want_add, **tol)
            assert torch.equal(total, want_total)
    assert strict.state["rms_norm"] == strict.state["add_rms_norm"] == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_attention_tails_run_their_triton_kernels_on_cuda(dtype):
    """merge_attention and silu_mul (ddtree.engine.kernels.attention) on CUDA at Qwen3.6-27B's attention dims, the
    parts from the kernels a split verification takes: the Triton kernels pass their first-call check (no fallback
    to the composite) and match the composite; a split verification with GQA in the CUDA kernels' layouts runs."""
    pytest.importorskip("triton")
    from ddtree.engine.kernels import FusedOp
    from ddtree.engine.kernels import attention as ka

    g = torch.Generator().manual_seed(0)
    B, H, kv, n, kp, d = 1, 24, 4, 65, 300, 256
    q = torch.randn(B, n, H, d, generator=g).transpose(1, 2).to("cuda", dtype)
    k, v = (torch.randn(B, kv, kp + n, d, generator=g).to("cuda", dtype) for _ in range(2))
    qp = q.reshape(B, kv, H // kv * n, d)
    bias = torch.zeros(qp.shape[2], n, device="cuda", dtype=dtype)
    parts = [A.attention_lse(qp, k[:, :, :kp], v[:, :, :kp], None, d ** -0.5),
             A.attention_lse(qp, k[:, :, kp:], v[:, :, kp:], bias[None, None], d ** -0.5)]
    gate = torch.randn(B, n, H, 2 * d, generator=g).to("cuda", dtype)[..., d:]
    with torch.no_grad():
        for gated in (None, gate):
            got = ka.merge_attention(*parts[0], *parts[1], gated, H, dtype)
            torch.testing.assert_close(got, ka._merge_attention(*parts[0], *parts[1], gated, H, dtype))
        x, y = (torch.randn(B, n, 17408, generator=g).to("cuda", dtype) for _ in range(2))
        torch.testing.assert_close(ka.silu_mul(x, y), torch.nn.functional.silu(x) * y)
    assert FusedOp.registry["merge_attention"].state == FusedOp.registry["silu_mul"].state == "triton"


def test_a_cuda_round_reads_the_device_once_and_times_stages_with_events(monkeypatch):
    """Default timing (sync_timing=False) on CUDA: no torch.cuda.synchronize inside the generation, the stages
    timed by CUDA events (every stage > 0), and one device->host read a round (the walk's) plus the prefill's."""
    from ddtree.testing.dispatch import DispatchCount

    target, drafter = _pair("qwen3_5_text", "sdpa", torch.float32)
    ids = _prompts()[1]
    engine = ddtree.Engine(target, drafter, method="ddtree", budget=16)
    engine.generate(ids, max_new_tokens=4)
    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1) or real(*a, **k))
    with DispatchCount() as c:
        res = engine.generate(ids, max_new_tokens=NEW)
    assert not syncs
    assert c.total(c.syncs) == res.rounds + 1, dict(c.sync_names)  # the prefill's copies apart
    assert all(res.stage_seconds[s] > 0 for s in ("draft", "tree", "verify", "commit")), res.stage_seconds
    sync_res = ddtree.Engine(target, drafter, method="ddtree", budget=16, sync_timing=True).generate(
        ids, max_new_tokens=NEW)
    assert len(syncs) == 8 * sync_res.rounds and sync_res.output_ids == res.output_ids


def _compiled_on_cuda(engine, target, prompts, label):
    """A compiled engine on CUDA graphs: a warm-up (compile, cudagraph warm-up and record), then every prompt equal to
    HF greedy without a recompile; no graph break, no cudagraph skipped. Returns one more generation and its counts."""
    from torch._dynamo.utils import counters

    from ddtree.testing.dispatch import DispatchCount

    assert engine.static is not None and engine.static.options.get("mode") == "reduce-overhead"
    engine.generate(prompts[0], max_new_tokens=NEW)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ids in prompts:
            res = engine.generate(ids, max_new_tokens=NEW)
            assert res.output_ids == hf_greedy(target, ids, NEW), (label, ids.shape)
        with DispatchCount() as c:
            res = engine.generate(prompts[1], max_new_tokens=NEW)
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    return res, c


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_the_compiled_round_on_cuda_with_cuda_graphs(model_type):
    """compile=true on CUDA as a user runs it (inductor, mode="reduce-overhead": CUDA graphs; ddtree.engine.compiled):
    fp32 DDTree and DFlash equal HF greedy on two prompt lengths; after the first generation no recompile and no
    graph break, no cudagraph skipped; each round one host read (the walk's) and its target work in graph calls."""
    from torch._dynamo.utils import counters

    target, drafter = _pair(model_type, "sdpa", torch.float32)
    prompts = _prompts()
    torch._dynamo.reset()
    counters.clear()
    try:
        for method, budget in (("ddtree", 16), ("dflash", None)):
            engine = ddtree.Engine(target, drafter, method=method, budget=budget, compile="true")
            res, c = _compiled_on_cuda(engine, target, prompts, method)
            assert c.syncs["commit"] == res.rounds and c.syncs["verify"] == 0, dict(c.sync_names)
            assert c.graphs["verify"] == c.graphs["commit"] == res.rounds
    finally:
        torch._dynamo.reset()


def test_mtp_through_the_compiled_round_on_cuda_with_cuda_graphs():
    """method=mtp, compile=true on CUDA (inductor, CUDA graphs): the chain and a tree (the head's drafting a graph
    from the second round, StaticMTP) equal HF greedy on two prompt lengths; no recompile, no graph break, no
    cudagraph skipped; each round one host read and three graph calls (draft, verify, commit; the first draft eager)."""
    from torch._dynamo.utils import counters

    from ddtree.engine.drafter.mtp import MTPHead

    target = tiny_model("qwen3_5_text", seed=3, attn_implementation="sdpa", vocab_size=VOCAB).to("cuda")
    head = MTPHead.random_for_target(target, seed=0, std=0.3)
    prompts = _prompts()
    torch._dynamo.reset()
    counters.clear()
    try:
        for topk, budget in ((1, 64), (3, 12)):
            engine = ddtree.Engine(target, head, method="mtp", steps=3, topk=topk, budget=budget, compile="true")
            assert engine.static.draft is not None
            res, c = _compiled_on_cuda(engine, target, prompts, topk)
            assert c.total(c.syncs) == res.rounds + 1, dict(c.sync_names)  # the prefill's copies apart
            assert c.graphs["verify"] == c.graphs["commit"] == res.rounds and c.graphs["draft"] == res.rounds - 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gdn_fused_ops_run_their_triton_kernels_on_cuda(dtype):
    """The tree-exact GDN layer's five fused ops (ddtree.engine.kernels.gdn) on CUDA at Qwen3.6-27B's GDN dims (16 key
    and 48 value heads of 128, conv kernel 4) over a DDTree-64-sized tree: strict, every Triton kernel passes its
    first-call check against the composite (no fallback), and the layer's output and what the commit reads (d, X and
    Y, the conv rows) match the CPU's composite run."""
    pytest.importorskip("triton")
    import random

    from transformers import DynamicCache

    from ddtree.engine import gdn, kernels
    from ddtree.engine.tree import tree_from_parents
    from ddtree.engine.verification import tree_verification

    strict = kernels.KernelChecks("strict")  # what an Engine(kernels="strict") enters around its calls
    model = tiny_model("qwen3_5_text", dtype=dtype, vocab_size=64, linear_num_key_heads=16, linear_num_value_heads=48,
                       linear_key_head_dim=128, linear_value_head_dim=128)
    gdn.install()
    parents = [-1] + [random.Random(7).randrange(max(0, i - 4), i) for i in range(1, 65)]
    tree = tree_from_parents(list(range(len(parents))), parents)
    hidden = torch.randn(1, len(parents), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got = {}
    for device in ("cpu", "cuda"):
        model.to(device)
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.arange(12, device=device)[None], cache=cache, use_cache=True)
            layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
            with tree_verification(tree), kernels.checking(strict):
                out = layer(hidden.to(device, dtype), cache=cache)
            rec = cache.__dict__[gdn._PENDING_ATTR][layer.layer_idx]
            got[device] = [t.float().cpu() for t in (out, rec.bufs.deltas, rec.bufs.xy, rec.extended)]
    assert all(strict.state[f"gdn_{name}"] == "triton"
               for name in ("decays", "conv", "qk_norm", "delta_rule", "gated_norm"))
    tol = {"rtol": 1e-3, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    for a, b in zip(got["cuda"], got["cpu"], strict=True):  # (the prefix's state too came from two devices)
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_the_eager_batched_round_on_cuda_is_each_streams_greedy_decoding(model_type):
    """generate_many on CUDA, eager (compile=false): prompts of different lengths at 3 streams (joins, a tail, free
    slots), every method and budget=auto (the rule's choice every round), each stream equal to HF greedy decoding of
    its prompt alone (fp32); and the batched round reads the device once a round at 1 and at 4 streams."""
    from batch_support import per_round_at

    target, drafter = _pair(model_type, "sdpa", torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g).to("cuda") for n in (3, 17, 9, 5, 12)]
    refs = [hf_greedy(target, ids, NEW) for ids in prompts]
    for method, budget in [*RUNS, ("ddtree", "auto")]:
        with ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget,
                           compile="false") as engine:
            results = engine.generate_many(prompts, concurrency=3, max_new_tokens=NEW)
            assert [r.output_ids for r in results] == refs, (method, budget)
            reads = {n: per_round_at(engine, prompts[1], n, NEW, budget)[1] for n in (1, 4)}
            assert reads == {1: 1.0, 4: 1.0}, (method, budget, reads)  # (auto: the ranks ride along)
