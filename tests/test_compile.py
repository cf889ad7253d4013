"""The compiled verification round (ddtree.engine.compiled, `compile=auto|true|false`).

References: HF greedy `generate` in fp32 (lossless), the eager engine (same tokens), the eager TargetSession's
verify/commit (logits after a non-contiguous commit), dynamo's counters (no graph break, no recompile after the
first generation across prompt lengths) and DispatchCount (one host read a round, the round's target work in
compiled-graph calls). The fast tests trace with dynamo only (backend "eager": seconds); the inductor ones, as a
user's `compile=true` runs, are slow here (about a minute of compiling each on this CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import ddtree
from ddtree.engine import host
from ddtree.engine.compiled import StaticRound, capacity_bucket
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.drafter.dflash2 import DFlash2Drafter
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import tree_from_parents
from ddtree.errors import ConfigError
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

VOCAB = 12  # random drafts are accepted several deep
NEW = 20

# the diagnosis record's fields stored in thousandths (of a nat, or permille): a rounding step apart where two equal
# computations differ in the last bit (the compiled drafter's logits); every other field exactly equal
_ROUNDED = ("costs", "rows", "tail", "tcosts", "probs")


def _same_records(a: dict, b: dict) -> bool:
    def close(x, y) -> bool:
        if isinstance(x, list) and isinstance(y, list):
            return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y, strict=True))
        return x == y or (isinstance(x, int) and isinstance(y, int) and abs(x - y) <= 1)

    return a.keys() == b.keys() and all(close(a[k], b[k]) if k in _ROUNDED else a[k] == b[k] for k in a)



def _pair(model_type: str, attn: str = "sdpa"):
    target = tiny_model(model_type, seed=6, attn_implementation=attn, vocab_size=VOCAB)
    return target, DFlashDrafter.random_for_target(target.config, block_size=8, seed=3)


def _prompts(lengths=(5, 17, 30)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]


def _engine(target, drafter, method, budget=16, backend="eager", **kw):
    return ddtree.Engine(target, drafter if method != "ar" else None, method=method, budget=budget,
                         compile="true", compile_backend=backend, **kw)


def _pool_backend():
    """A torch.compile backend with CUDA graph trees' memory rule: a graph's outputs (those not aliasing an input) are
    overwritten as soon as a compiled function runs again (NaN, or an out-of-range value in integer outputs)."""
    live: list[torch.Tensor] = []

    def backend(gm, example_inputs):
        def run(*args):
            with torch.inference_mode():
                for t in live:
                    if t.dtype == torch.bool:
                        t.logical_not_()
                    else:
                        t.fill_(float("nan") if t.is_floating_point() else 1 << 20)
            live.clear()
            out = gm(*args)
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            flat = out if isinstance(out, tuple | list) else (out,)
            live.extend(t for t in flat if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
            return out
        return run

    return backend


def test_the_compiled_round_is_lossless_one_graph_each_no_recompile_one_read(dynamo_clean):
    """Smoke test of the default suite (dynamo tracing, fullgraph): DDTree on the tiny hybrid equals HF greedy and the
    eager engine on prompts of three lengths; after the first generation no recompile (error_on_recompile) and no
    graph break; each round reads the host once (the walk) and calls four graphs (drafter, tree build, verify, commit; the
    first round drafts eagerly); the drafts are the eager engine's (same acceptance lengths). The backend overwrites each
    graph's outputs at the next compiled call, as CUDA graph trees reuse their pool: the round reads them through the
    clones `StaticRound._run` makes under CUDA graphs (`cudagraphs`, on here as on CUDA)."""
    target, drafter = _pair("qwen3_5_text")
    prompts = _prompts()
    with host.device_path():  # the branches a CUDA run takes (device tree build and walk)
        engine = _engine(target, drafter, "ddtree", backend=_pool_backend())
        engine.static.cudagraphs = True  # as mode="reduce-overhead" sets it on CUDA
        eager = ddtree.Engine(target, drafter, method="ddtree", budget=16, compile="false")
        assert engine.static is not None and eager.static is None
        engine.generate(prompts[0], max_new_tokens=4)  # warm-up: the graphs are traced here
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 4 and not counters["graph_break"], dict(counters["graph_break"])
        with torch._dynamo.config.patch(error_on_recompile=True):
            accepted = []
            for ids in prompts:
                res = engine.generate(ids, max_new_tokens=NEW)
                assert res.output_ids == hf_greedy(target, ids, NEW)
                ref = eager.generate(ids, max_new_tokens=NEW)
                assert res.output_ids == ref.output_ids
                assert res.acceptance_lengths == ref.acceptance_lengths  # the compiled drafter drafted the same trees
                assert _same_records(res.diagnosis, ref.diagnosis)  # its logits: the target's tokens' ranks, costs
                accepted += res.acceptance_lengths
            with DispatchCount() as c:
                res = engine.generate(prompts[1], max_new_tokens=NEW)
    assert max(accepted) > 2  # multi-token commits ran (paths through the tree, not only the root)
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert c.total(c.syncs) == res.rounds + 2, dict(c.sync_names)  # + the prefill's token, the records
    # the prefill: no host-to-device copy (the GDN layers' cache counters are made on the device: kv_cache.new_cache)
    assert c.syncs["prefill"] == 0, dict(c.sync_names)
    assert c.syncs["commit"] == res.rounds and c.syncs["verify"] == 0
    assert c.graphs["verify"] == c.graphs["commit"] == c.graphs["tree"] == res.rounds
    assert c.graphs["draft"] == res.rounds - 1  # the first round reads the prompt's features eagerly
    assert c.ops["verify"] <= 2 * res.rounds  # the tree's tensors handed over: views only, no op of the forward


DFLASH2_CASES = [("dflash", None), ("ddtree", "marginal"), ("ddtree", "pair")]


def _dflash2_pair(model_type: str):
    """A tiny target and a random DFlash2 drafter (convolutions off the identity, pair scores that reorder)."""
    target = tiny_model(model_type, seed=6, vocab_size=VOCAB)
    return target, DFlash2Drafter.random_for_target(target.config, block_size=8, seed=3, selector_top_k=4,
                                                    selector_rank=8)


# the marginal tree over DFlash2's rows is DDTree's own tree build (compiled above); make test-slow runs it too
@pytest.mark.parametrize("method,scoring", [("dflash", None), pytest.param("ddtree", "marginal", marks=pytest.mark.slow),
                                            ("ddtree", "pair")])
def test_a_dflash2_drafter_drafts_in_the_compiled_round(dynamo_clean, method, scoring):
    """A DFlash2 drafter (ddtree.engine.drafter.dflash2) in the compiled round, traced by dynamo on the tiny hybrid:
    its forward with the convolutions (StaticDraft, from the second round) and the selector's walk, the marginal tree
    or the pair tree as graphs. The chain and both scorings equal HF greedy and the eager engine (the same drafts:
    acceptance lengths; the same diagnosis records), each round calls one graph a stage and reads the host once, no
    recompile after the first generation, and the result says the round was compiled with nothing eager. Outputs are
    overwritten at the next compiled call as under CUDA graphs (`_pool_backend`): the round reads the clones."""
    target, drafter = _dflash2_pair("qwen3_5_text")
    prompts = _prompts((5, 17))
    torch._dynamo.reset()
    counters.clear()
    with host.device_path():  # the branches a CUDA run takes (the device tree build)
        engine = _engine(target, drafter, method, budget=10, backend=_pool_backend(), scoring=scoring)
        engine.static.cudagraphs = True
        eager = ddtree.Engine(target, drafter, method=method, budget=10, scoring=scoring, compile="false")
        engine.generate(prompts[0], max_new_tokens=4)  # warm-up: the graphs are traced here
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for ids in prompts:
                res = engine.generate(ids, max_new_tokens=NEW)
                assert res.output_ids == hf_greedy(target, ids, NEW), (method, scoring)
                ref = eager.generate(ids, max_new_tokens=NEW)
                assert res.acceptance_lengths == ref.acceptance_lengths, (method, scoring)
                assert _same_records(res.diagnosis, ref.diagnosis), (method, scoring)
                assert (res.round, res.round_note, res.round_fallback) == ("compiled", None, False)
            with DispatchCount() as c:
                res = engine.generate(prompts[1], max_new_tokens=NEW)
    assert graphs == 4 and counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert max(res.acceptance_lengths) > 1, (method, scoring)  # drafts accepted: paths through the tree
    assert c.graphs["tree"] == c.graphs["verify"] == c.graphs["commit"] == res.rounds, (method, scoring)
    assert c.graphs["draft"] == res.rounds - 1  # the first round reads the prompt's features eagerly
    assert c.total(c.syncs) == res.rounds + 2, dict(c.sync_names)  # the walk's, the prefill's token, the records


# (DFlash2 embeds through the same DFlashDrafter.embed_block; its compiled round: above)
@pytest.mark.parametrize("kind", ["dflash", pytest.param("dflash2", marks=pytest.mark.slow)])
def test_the_compiled_drafter_embeds_the_block_times_its_scale(dynamo_clean, kind):
    """input_embedding_scale in the compiled round (StaticDraft embeds the block inside its graph): a drafter declaring
    2.0 drafts there as the eager engine does (the same acceptance lengths and diagnosis records, which carry the
    drafter's log-probabilities), and otherwise than the same weights unscaled."""
    target, drafter = _dflash2_pair("qwen3")
    if kind == "dflash":
        drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3)
    scaled = copy.deepcopy(drafter)
    scaled.config.input_embedding_scale = 2.0
    ids = _prompts((9,))[0]
    records = {}
    for name, d in (("plain", drafter), ("scaled", scaled)):
        torch._dynamo.reset()
        res = _engine(target, d, "ddtree", budget=10).generate(ids, max_new_tokens=NEW)
        ref = ddtree.Engine(target, d, method="ddtree", budget=10, compile="false").generate(ids, max_new_tokens=NEW)
        assert res.output_ids == ref.output_ids == hf_greedy(target, ids, NEW), name
        assert res.round == "compiled" and res.acceptance_lengths == ref.acceptance_lengths, name
        assert _same_records(res.diagnosis, ref.diagnosis), name
        records[name] = res.diagnosis
    assert not _same_records(records["plain"], records["scaled"])


@pytest.mark.slow  # inductor: about a minute a graph on this CPU
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_inductor_compiled_dflash2_methods_equal_hf_greedy(model_type, dynamo_clean):
    """compile=true as a user runs it (inductor) with a DFlash2 drafter: the chain and both scorings equal HF greedy
    and the eager engine, without a recompile or a graph break, the round compiled."""
    target, drafter = _dflash2_pair(model_type)
    prompts = _prompts((5, 23))
    for method, scoring in DFLASH2_CASES:
        with host.device_path():
            engine = _engine(target, drafter, method, budget=10, backend=None, scoring=scoring)
            engine.generate(prompts[0], max_new_tokens=4)
            graphs = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=True):
                for ids in prompts:
                    res = engine.generate(ids, max_new_tokens=NEW)
                    assert res.output_ids == hf_greedy(target, ids, NEW), (method, scoring, ids.shape)
                    ref = ddtree.generate(target, drafter, ids, method=method, budget=10, scoring=scoring,
                                          max_new_tokens=NEW, compile="false")
                    assert res.acceptance_lengths == ref.acceptance_lengths, (method, scoring)
                    assert (res.round, res.round_note) == ("compiled", None)
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.slow
def test_without_the_clones_the_pool_rule_breaks_the_round(dynamo_clean):
    """The smoke test's check can fail: the same run with the clones off (`cudagraphs` False) under the backend that
    overwrites outputs at the next compiled call no longer equals HF greedy (or raises)."""
    target, drafter = _pair("qwen3_5_text")
    ids = _prompts((9,))[0]
    with host.device_path():
        engine = _engine(target, drafter, "ddtree", backend=_pool_backend())
        assert not engine.static.cudagraphs
        try:
            out = engine.generate(ids, max_new_tokens=NEW).output_ids
        except (RuntimeError, IndexError, ValueError):
            out = None
    assert out != hf_greedy(target, ids, NEW)


def _mtp_engines(target, head, topk, budget, backend="eager"):
    kw = dict(method="mtp", steps=3, topk=topk, budget=budget)
    return (ddtree.Engine(target, head, compile="true", compile_backend=backend, **kw),
            ddtree.Engine(target, head, compile="false", **kw))


def _drafts(engine, ids, **kw):
    """(the generation, the trees its proposer drafted)."""
    trees, propose = [], engine.proposer.propose
    engine.proposer.propose = lambda state: trees.append(propose(state)) or trees[-1]
    try:
        return engine.generate(ids, max_new_tokens=NEW, **kw), trees
    finally:
        del engine.proposer.propose


def _same_trees(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.equal(a.depths, b.depths) and torch.equal(a.ancestor_matrix(), b.ancestor_matrix())
        if b.scores is not None:
            torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)


def test_mtp_through_the_compiled_round_is_lossless_without_recompile_one_read(dynamo_clean):
    """method=mtp's EAGLE tree (a fixed node count: min(budget, pool)) drafted by the compiled head (StaticMTP, from
    the second round) and verified and committed by the compiled round: the eager engine's tokens and acceptance
    (the same drafts) on prompts of two lengths, no graph break, no recompile after the first generation, one host
    read a round (the walk's), three graph calls a round and no op of the head's outside them. The backend
    overwrites outputs as CUDA graph trees do (the smoke test above)."""
    from ddtree.engine.drafter.mtp import MTPHead

    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=VOCAB, num_hidden_layers=2,
                        layer_types=["linear_attention", "full_attention"])  # one of each: a short trace
    head = MTPHead.random_for_target(target, seed=0, std=0.3)  # peaked: frontiers mix parents
    prompts = _prompts((5, 17))
    with host.device_path():
        engine, eager = _mtp_engines(target, head, topk=3, budget=32, backend=_pool_backend())  # 21 nodes: the pool
        engine.static.cudagraphs = True  # outputs overwritten at the next compiled call: read through the clones
        engine.generate(prompts[0], max_new_tokens=4)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            accepted = []
            for ids in prompts:
                (res, got), (ref, want) = _drafts(engine, ids), _drafts(eager, ids)
                assert res.output_ids == ref.output_ids and res.acceptance_lengths == ref.acceptance_lengths
                _same_trees(got, want)  # the compiled head drafts the eager head's trees
                accepted += res.acceptance_lengths
            assert max(accepted) > 1  # drafts committed (and rolled back)
            counts = []
            for new in (4, NEW):
                with DispatchCount() as c:
                    res = engine.generate(prompts[1], max_new_tokens=new)
                counts.append((c, res.rounds))
    assert c.total(c.syncs) == res.rounds + 1, dict(c.sync_names)  # + the prefill's token
    assert c.syncs["prefill"] == 0, dict(c.sync_names)
    assert c.syncs["commit"] == res.rounds and c.syncs["draft"] == c.syncs["tree"] == 0
    assert c.graphs["verify"] == c.graphs["commit"] == res.rounds and c.graphs["draft"] == res.rounds - 1
    (short, r0), (long, r1) = counts
    assert graphs == 3 and r1 > r0 and long.ops["draft"] == short.ops["draft"]  # later rounds: the head's graph only
    assert long.ops["verify"] - short.ops["verify"] <= 2 * (r1 - r0)  # its tree handed over: views
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", pytest.param(None, id="inductor")])
def test_mtp_chain_and_trees_through_the_compiled_round_equal_hf_greedy(backend, dynamo_clean):
    """A head fitted to the target (drafts accepted several deep): its chain, a tree and a tree cut by its budget
    through the compiled round equal HF greedy and the eager engine (same acceptance) on prompts of three lengths,
    without a recompile or a graph break (inductor: as compile=true runs, the chain only: a minute a graph here)."""
    from mtp_support import fitted_head

    target = tiny_model("qwen3_5_text", seed=0, vocab_size=128)
    head = fitted_head(target, seed=1)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (1, n), generator=g) for n in (9, 4, 26)]
    accepted = 0
    for topk, budget in ((1, 64), (3, 12), (2, 5))[: 3 if backend else 1]:
        engine, eager = _mtp_engines(target, head, topk, budget, backend)
        engine.generate(prompts[0], max_new_tokens=4)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for ids in prompts:
                (res, got), (ref, want) = _drafts(engine, ids), _drafts(eager, ids)
                assert res.output_ids == ref.output_ids == hf_greedy(target, ids, NEW), (topk, budget, ids.shape)
                assert res.acceptance_lengths == ref.acceptance_lengths
                _same_trees(got, want)
                accepted += sum(a - 1 for a in res.acceptance_lengths)
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert accepted > 3 * len(prompts)


@pytest.mark.slow
@pytest.mark.parametrize("topk,budget", [(1, 64), (3, 12)])
def test_mtp_sampling_through_the_compiled_round_draws_as_the_eager_one(topk, budget, dynamo_clean):
    """T > 0: the chain samples its drafts with the generation's generator (its head stays eager: ready never set),
    the tree drafts by top-k (its head compiled): with equal seeds the compiled engine's draws and drafts are the
    eager engine's."""
    from ddtree.engine.drafter.mtp import MTPHead

    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=VOCAB)
    head = MTPHead.random_for_target(target, seed=0, std=0.3)
    engine, eager = _mtp_engines(target, head, topk, budget)
    for seed, ids in enumerate(_prompts((6, 19))):
        kw = dict(temperature=0.8)
        (res, got), (ref, want) = [_drafts(e, ids, generator=torch.Generator().manual_seed(seed), **kw)
                                   for e in (engine, eager)]
        assert res.output_ids == ref.output_ids and res.acceptance_lengths == ref.acceptance_lengths
        _same_trees(got, want)
    assert engine.static.draft.ready == (topk > 1)


@pytest.mark.parametrize("model_type", [pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_5_text"])
def test_a_non_contiguous_commit_leaves_the_eager_sessions_state(model_type, dynamo_clean):
    """Verify a branching tree, commit a path that skips nodes, then verify the next tree: the compiled round's
    logits equal the eager TargetSession's at every step (the attention rows moved, the GDN states advanced)."""
    target, _ = _pair(model_type)
    binding = ddtree.Engine(target, None, method="ar").binding
    static = StaticRound(binding, backend="eager")
    ids = _prompts((11,))[0]
    trees = [tree_from_parents([3, 1, 5, 2, 7, 4, 9], [-1, 0, 0, 1, 2, 2, 4], ),
             tree_from_parents([4, 6, 1, 8, 2, 0, 3], [-1, 0, 1, 1, 0, 4, 5])]
    paths = [torch.tensor([0, 2, 4, 6]), torch.tensor([0, 1, 3])]
    eager = TargetSession(target, binding=binding, capacity=64)
    compiled = static.session(64)
    for s in (eager, compiled):
        s.prefill(ids)
    for tree, path in zip(trees, paths, strict=True):
        want, _ = eager.verify(tree)
        got, _ = compiled.verify(tree)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for s in (eager, compiled):
            s.commit(tree, path, path.tolist())
    assert compiled.length == eager.length == 11 + 4 + 3
    assert int(static.state.length) == compiled.length
    last = tree_from_parents([1], [-1])
    torch.testing.assert_close(compiled.verify(last)[0], eager.verify(last)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_a_sliding_window_drafter_drafts_as_the_eager_one(attn, dynamo_clean):
    """A drafter with sliding-window layers (window 6, shorter than the context, as Qwen3.6-27B-DFlash's 2048 is at
    long context) and a full one, on the eager or sdpa attention: the compiled draft's masks (window and causal
    rules by position over the whole buffer) give the eager forward's drafts (same records, same acceptance)."""
    target = tiny_model("qwen3", seed=6, attn_implementation="sdpa", vocab_size=VOCAB)
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=2, block_size=6, seed=3, attn_implementation=attn,
                                              layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    engine = _engine(target, drafter, "dflash")
    assert engine.static.draft is not None
    eager = ddtree.Engine(target, drafter, method="dflash", compile="false")
    for ids in _prompts((4, 13)):
        res, ref = engine.generate(ids, max_new_tokens=NEW), eager.generate(ids, max_new_tokens=NEW)
        assert res.output_ids == ref.output_ids == hf_greedy(target, ids, NEW)
        assert res.acceptance_lengths == ref.acceptance_lengths and _same_records(res.diagnosis, ref.diagnosis)


def test_a_bf16_hybrid_through_the_compiled_round_gets_exact_or_tie_verdicts(dynamo_clean):
    """bf16, as users run (the GDN buffers in the model's dtype where the eager layer keeps them): every output is the
    target's choice within the bf16 tolerance against the eager engine's (verdict exact or tie, never suspect)."""
    from ddtree.engine.output_check import Validator

    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=VOCAB, dtype=torch.bfloat16)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3).to(torch.bfloat16)
    with host.device_path():
        engine = _engine(target, drafter, "ddtree")
        eager = ddtree.Engine(target, drafter, method="ddtree", budget=16, compile="false")
        validator = Validator(target, max_new_tokens=NEW)
        for ids in _prompts((5, 17)):
            res, ref = engine.generate(ids, max_new_tokens=NEW), eager.generate(ids, max_new_tokens=NEW)
            assert validator.verdict(ids, res.output_ids, ref.output_ids).verdict in ("exact", "tie")


def test_compile_settings_and_refusals():
    target, drafter = _pair("qwen3")
    with pytest.raises(ConfigError, match="compile: unknown value 'maybe'"):
        ddtree.Engine(target, drafter, method="ddtree", budget=4, compile="maybe")
    auto = ddtree.Engine(target, drafter, method="ddtree", budget=4)
    assert auto.static is None and auto.round == "eager" and not auto.round_fallback  # auto on a CPU: eager
    assert auto.round_note.startswith("compile=auto compiles on CUDA only")
    assert ddtree.Engine(target, drafter, method="ddtree", budget=4, compile=False).static is None
    assert ddtree.Engine(target, drafter, method="dflash", compile=True).static is not None
    moe = tiny_model("qwen3_5_moe_text", seed=1, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="compile: .*MoE"):
        ddtree.Engine(moe, None, method="ar", compile="true")
    eager_attn = tiny_model("qwen3", seed=1, vocab_size=VOCAB, attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="compile: .*lean forward"):
        ddtree.Engine(eager_attn, None, method="ar", compile="true")
    assert capacity_bucket(1) == 256 and capacity_bucket(257) == 512 and capacity_bucket(512) == 512  # (test_capacity)


def test_auto_falls_back_to_the_eager_round_where_compiling_fails(monkeypatch, caplog, dynamo_clean):
    """compile=auto on a machine whose compiler fails (a torch.compile backend that raises, as an Inductor or
    CUDA-graph failure would): the generation is logged and rerun eagerly, equal to HF greedy; the engine stays eager
    (no second attempt), and a sampling generation's generator is put back first (the same draws as an eager engine).
    compile=true raises instead."""
    from ddtree.engine import compiled

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    target, drafter = _pair("qwen3")
    ids = _prompts((7,))[0]
    monkeypatch.setattr(compiled, "auto_compiles", lambda binding: True)  # as on a CUDA device
    engine = ddtree.Engine(target, drafter, method="ddtree", budget=8, compile="auto", compile_backend=broken)
    assert engine.static is not None
    with caplog.at_level("WARNING", logger="ddtree.engine"):
        res = engine.generate(ids, max_new_tokens=NEW)
    assert res.output_ids == hf_greedy(target, ids, NEW)
    assert engine.static is None and "the compiled round failed (BackendCompilerFailed" in caplog.text
    # the result says so (summary.json and the sweep table read it): never a silent fallback
    assert (res.round, res.round_fallback) == ("eager", True)
    assert res.round_note.startswith("compile=auto: the compiled round failed (BackendCompilerFailed")
    sampled = ddtree.Engine(target, drafter, method="ddtree", budget=8, compile="auto", compile_backend=broken)
    eager = ddtree.Engine(target, drafter, method="ddtree", budget=8, compile="false")
    draws = [e.generate(ids, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(5)).output_ids
             for e in (sampled, eager)]
    assert draws[0] == draws[1] and sampled.static is None
    strict = ddtree.Engine(target, drafter, method="ddtree", budget=8, compile="true", compile_backend=broken)
    with pytest.raises(Exception, match="no compiler here"):
        strict.generate(ids, max_new_tokens=4)


@pytest.mark.slow
def test_auto_falls_back_for_mtp_and_its_head_drafts_eagerly_again(monkeypatch, dynamo_clean):
    """method=mtp under compile=auto with a compiler that fails: rerun eagerly, the eager engine's tokens, and the
    proposer's compiled head detached (its drafts eager from then on)."""
    from ddtree.engine import compiled
    from ddtree.engine.drafter.mtp import MTPHead

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled, "auto_compiles", lambda binding: True)  # as on a CUDA device
    ids = _prompts((7,))[0]
    hybrid = tiny_model("qwen3_5_text", seed=6, vocab_size=VOCAB, num_hidden_layers=2,
                        layer_types=["linear_attention", "full_attention"])
    head = MTPHead.random_for_target(hybrid, seed=0, std=0.3)
    mtp, eager = (ddtree.Engine(hybrid, head, method="mtp", topk=2, budget=6, compile=c, compile_backend=broken)
                  for c in ("auto", "false"))
    assert mtp.proposer.static_draft is not None
    assert mtp.generate(ids, max_new_tokens=NEW).output_ids == eager.generate(ids, max_new_tokens=NEW).output_ids
    assert mtp.static is None and mtp.proposer.static_draft is None


def test_the_run_setting_is_checked_before_loading():
    from ddtree.pipeline.config_checks import check_run_settings
    from ddtree.pipeline.schema import RunConfig, identity_dict

    with pytest.raises(ConfigError, match="compile: unknown value"):
        check_run_settings(RunConfig(compile="sometimes"))
    check_run_settings(RunConfig(compile="true", method="mtp"))  # every method runs compiled (a fixed node count)
    rc = RunConfig(compile="True")
    check_run_settings(rc)
    assert rc.compile == "true"
    assert "compile" not in identity_dict(RunConfig()) and identity_dict(rc)["compile"] == "true"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_inductor_compiled_methods_equal_hf_greedy(model_type, dynamo_clean):
    """compile=true as a user runs it (inductor; on this CPU about a minute of compiling a graph): AR, DFlash and
    DDTree equal HF greedy and the eager engine on prompts of two lengths, without a recompile or a graph break."""
    target, drafter = _pair(model_type)
    prompts = _prompts((5, 23))
    for method, budget in (("ddtree", 16), ("dflash", None), ("ar", None)):
        engine = _engine(target, drafter, method, budget, backend=None)
        engine.generate(prompts[0], max_new_tokens=4)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for ids in prompts:
                res = engine.generate(ids, max_new_tokens=NEW)
                assert res.output_ids == hf_greedy(target, ids, NEW), (method, ids.shape)
                eager = ddtree.generate(target, drafter if method != "ar" else None, ids, method=method,
                                        budget=budget, max_new_tokens=NEW, compile="false")
                assert res.output_ids == eager.output_ids
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


def test_the_capacity_returns_to_what_a_prompt_needs(dynamo_clean):
    """The fixed KV capacity follows each generation's bucket: a long generation's 1,024 rows do not stay for the
    short ones after it (attention reads every row), and the short generation after the shrink is HF greedy's."""
    target, drafter = _pair("qwen3_5_text")
    engine = _engine(target, drafter, "dflash")
    ids = _prompts((7,))[0]
    engine.static.session(600).prefill(ids)
    big = engine.static.state
    assert big.capacity == 1024
    res = engine.generate(ids, max_new_tokens=NEW)
    assert engine.static.state.capacity == capacity_bucket(7 + NEW + 9) == 256 and engine.static.state is not big
    assert engine.static.draft.keys[0].shape[-2] == 256
    assert res.output_ids == hf_greedy(target, ids, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 64)])
def test_traced_methods_on_both_families_and_a_longer_generation(method, budget, dynamo_clean):
    """Every method on both tiny families through the traced graphs, a generation long enough to cross 256 rows:
    the capacity grows once to the next bucket (one more trace), outputs stay HF greedy's."""
    for model_type in ("qwen3", "qwen3_5_text"):
        target, drafter = _pair(model_type)
        engine = _engine(target, drafter, method, budget)
        for ids, new in ((_prompts((7,))[0], NEW), (_prompts((40,))[0], 240)):
            res = engine.generate(ids, max_new_tokens=new)
            assert res.output_ids == hf_greedy(target, ids, new), (model_type, new)
        assert engine.static.state.capacity == 512


@pytest.mark.slow
@pytest.mark.parametrize("method,scoring,dflash2", [("ddtree", None, False), ("dflash", None, False),
                                                    ("dflash", None, True), ("ddtree", "pair", True)],
                         ids=["ddtree", "dflash", "dflash2-chain", "dflash2-pair"])
def test_sampling_through_the_compiled_round_draws_as_the_eager_one(method, scoring, dflash2, dynamo_clean):
    """T > 0: the compiled round feeds the same distributions to the same sampler (ddtree.engine.loop._choose and the
    walk; a sampled chain's ddtree.engine.tree.rejection_walk): with equal generator seeds the draws are the eager engine's (a draw could differ only where a uniform
    falls within rounding of a boundary), so the chi-square suites of the eager round speak for it too. A DFlash2
    drafter: its chain's walk samples eagerly after the compiled forward; its pair tree is compiled at any T."""
    target, drafter = (_dflash2_pair if dflash2 else _pair)("qwen3_5_text")
    engine = _engine(target, drafter, method, scoring=scoring)
    eager = ddtree.Engine(target, drafter, method=method, budget=16, scoring=scoring, compile="false")
    for seed, ids in enumerate(_prompts((6, 19))):
        runs = [e.generate(ids, max_new_tokens=NEW, temperature=0.8, generator=torch.Generator().manual_seed(seed))
                for e in (engine, eager)]
        assert runs[0].output_ids == runs[1].output_ids
        assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


def _graph_sdpa_calls(gm) -> list:
    """(query, keys, values, mask, enable_gqa) example values of every SDPA call in a dynamo FX graph."""
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention:
            val = [a.meta["example_value"] if isinstance(a, torch.fx.Node) else a for a in node.args]
            mask = node.kwargs.get("attn_mask")
            mask = mask.meta["example_value"] if isinstance(mask, torch.fx.Node) else mask
            calls.append((*val[:3], mask, bool(node.kwargs.get("enable_gqa", False))))
    return calls


@pytest.mark.parametrize("method", ["ddtree", "mtp"])
def test_attention_in_the_graphs_is_a_call_the_fused_kernels_take(method, dynamo_clean):
    """Every SDPA call in the compiled round's graphs (verify, the drafter or the MTP head) on a GQA hybrid (4 query
    heads over 2 KV heads), read from dynamo's graphs: a mask, no enable_gqa, the KV group's queries stacked, a mask
    in the queries' dtype with 16-aligned rows (`fused_sdpa_refusal`: CUDA's memory-efficient kernel takes it; a
    masked enable_gqa call falls to the math backend there). The rule itself refuses the call of before."""
    from ddtree.engine.compiled import fused_sdpa_refusal

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    target, drafter = _pair("qwen3_5_text")
    ids = _prompts((9,))[0]
    with host.device_path():
        if method == "mtp":
            from ddtree.engine.drafter.mtp import MTPHead

            head = MTPHead.random_for_target(target, seed=0)
            engine = ddtree.Engine(target, head, method="mtp", steps=3, topk=1, compile="true", compile_backend=backend)
        else:
            engine = _engine(target, drafter, method, backend=backend)
        res = engine.generate(ids, max_new_tokens=12)
    assert res.output_ids == hf_greedy(target, ids, 12)
    calls = [c for gm in graphs for c in _graph_sdpa_calls(gm)]
    assert len(calls) >= 2, len(calls)  # the target's attention layers and the drafter's / head's
    for q, k, v, mask, gqa in calls:
        assert mask is not None and not gqa and q.shape[1] == k.shape[1]
        assert fused_sdpa_refusal(q, k, v, mask, gqa) is None, fused_sdpa_refusal(q, k, v, mask, gqa)
    q = torch.empty(1, 4, 9, 16)
    k = torch.empty(1, 2, 256, 16)
    assert "grouped-query" in fused_sdpa_refusal(q, k, k, torch.ones(1, 1, 9, 256, dtype=torch.bool), True)
    assert "mask" in fused_sdpa_refusal(k[:, :, :9], k, k, torch.ones(1, 1, 9, 256, dtype=torch.bool))


@pytest.mark.slow  # Inductor plans each graph: over a minute here even without GDN layers
@pytest.mark.parametrize("hybrid,method", [(False, "dflash"), (True, "ddtree")])
def test_no_graph_copies_a_buffer_that_grows_with_context(hybrid, method, dynamo_clean):
    """Inductor's own plan of every graph of the compiled round on tiny targets (ddtree.testing.inductor_plan:
    the code Inductor generates, its kernels not built; the hybrid's GDN graphs take a minute to plan here: slow):
    the key and value buffers are written in place. No
    temporary has a capacity (target 512, drafter 1024) as anything but its last dim (a KV buffer's rows are
    (.., C, d): the stacked buffer of before was copied whole, (2, 1, Hkv, C, d) a layer, and the drafter's sdpa
    path expanded its K/V to (1, H, Cd, d)); the context-sized ones left are masks, at most (heads / KV heads) x N
    rows of C."""
    from ddtree.testing.inductor_plan import allocations, round_plans

    kinds = {} if hybrid else {"layer_types": ["full_attention"] * 2}  # the fast case: no GDN layer to plan
    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=VOCAB, num_hidden_layers=2,
                        **kinds)
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4, seed=3)
    with host.device_path():
        engine = _engine(target, drafter, method, budget=4, backend=None)
        plans = round_plans(engine, 512, 1024)
    assert set(plans) == {"verify", "commit", "draft", "tree"} - ({"tree"} if method == "dflash" else set())
    groups = target.config.num_attention_heads // target.config.num_key_value_heads
    for stage, plan in plans.items():
        assert plan.bytes > 0 and plan.nodes
        for name, shape, _ in allocations(plan.code):
            for cap in (512, 1024):
                if cap in shape:
                    assert shape[-1] == cap and shape.count(cap) == 1, (stage, name, shape)
                    assert torch.Size(shape).numel() <= groups * 5 * cap, (stage, name, shape)


def test_grouped_attention_equals_masked_gqa_attention():
    """grouped_attention (each KV group's queries stacked, an additive mask repeated per group member) against the
    plain masked call with enable_gqa and against K/V expanded per head: the same outputs in float64."""
    from ddtree.engine.fixed_kv import grouped_attention, grouped_bias

    g = torch.Generator().manual_seed(0)
    heads, kv, n, cap, d = 6, 2, 5, 32, 8
    q = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv, cap, d, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(n, cap, generator=g) < 0.6
    visible[:, 0] = True
    out = grouped_attention(q, k, v, grouped_bias(visible, heads // kv, q.dtype), 0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.3, enable_gqa=True)
    expanded = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1), attn_mask=visible, scale=0.3)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, expanded, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # inductor's code generation (~1 min on 2 shared cores); the plan serves the slow test above and bench
def test_the_plan_counts_an_extern_kernels_view_not_its_whole_buffer(dynamo_clean):
    """A matrix product reading one slot of a stacked buffer (a GDN layer's recurrent state) is counted at the slot's
    bytes, not the stack's (Inductor's dependency is the whole buffer): what the kernel reads."""
    from ddtree.testing.inductor_plan import plan_of

    def f(stack, a):
        return torch.bmm(a, stack[1]) * 2

    stack, a = torch.empty(3, 8, 16, 16), torch.empty(8, 20, 16)
    plan = plan_of(torch.compile(f, fullgraph=True, dynamic=False), stack, a)
    mm = [b for _, b, kind in plan.nodes if "bmm" in kind]
    assert mm == [4 * (8 * 20 * 16 + 8 * 16 * 16 + 8 * 20 * 16)], plan.nodes  # a, the slot, the output


def test_on_a_torch_without_recompile_limit_the_round_lifts_dynamos_own(monkeypatch, dynamo_clean):
    """torch 2.11 (the GPU image's) takes no `torch.compile(recompile_limit=)`: dynamo's own limit (8 graphs a
    function; 1 here) would make a fullgraph region raise at its next shape (a new capacity, node count or model). The
    round lifts it to RECOMPILE_LIMIT for its own calls only: a second capacity compiles, outputs HF greedy's, and
    dynamo's setting is what it was after."""
    from ddtree.engine import compiled

    monkeypatch.setattr(compiled, "_TAKES_RECOMPILE_LIMIT", False)
    target, _ = _pair("qwen3")
    engine = _engine(target, None, "ar")
    assert "recompile_limit" not in engine.static.options
    ids = _prompts((7,))[0]
    with torch._dynamo.config.patch(recompile_limit=1):
        for new in (NEW, 260):  # capacities 256, then 512
            assert engine.generate(ids, max_new_tokens=new).output_ids == hf_greedy(target, ids, new)
            assert engine.static is not None and engine.static.state.capacity == (256 if new == NEW else 512)
        assert torch._dynamo.config.recompile_limit == 1
