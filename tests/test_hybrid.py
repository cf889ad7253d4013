"""Hybrid GDN + attention targets through the whole engine: lossless for every method.

The tiny hybrids keep a slowly decaying GDN state (A_log = log 0.05), so a wrong rollback
or a GDN layer that ignores the tree shows up in the output.
"""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine import gdn as tree_gdn
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.methods import check_target_supported
from ddtree.engine.output_check import Validator
from ddtree.errors import ConfigError
from ddtree.testing.reference import ScriptedProposer, hf_greedy
from ddtree.tiny import tiny_model

HYBRIDS = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"]


def _prompts(vocab):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (3, 14)]


# the fast suite: each hybrid once, both attentions; the rest of the grid in make test-slow
FAST_HYBRIDS = {("qwen3_5_text", "sdpa"), ("qwen3_next", "eager"), ("qwen3_5_moe_text", "sdpa")}


@pytest.mark.parametrize("model_type,attn", [
    pytest.param(m, a, marks=() if (m, a) in FAST_HYBRIDS else pytest.mark.slow)
    for m in HYBRIDS for a in ("eager", "sdpa")])
def test_hybrid_methods_equal_hf_greedy(model_type, attn):
    vocab = 12  # small vocabulary: random drafts are accepted deep
    target = tiny_model(model_type, seed=6, attn_implementation=attn, vocab_size=vocab)
    new, deepest = 16, 0
    validator = Validator(target, max_new_tokens=new)  # fp32: every verdict is exact
    for bs in (4, 16):
        drafter = DFlashDrafter.random_for_target(target.config, block_size=bs, seed=bs, attn_implementation=attn)
        for ids in _prompts(vocab):
            ref = hf_greedy(target, ids, new)
            ref_check, _ = validator.check(ids, ref)
            assert ref_check.ok
            assert ddtree.generate(target, drafter, ids, method="ar", max_new_tokens=new).output_ids == ref
            assert ddtree.generate(target, drafter, ids, method="dflash", max_new_tokens=new).output_ids == ref
            for budget in (2, 7, 48):
                res = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=new)
                assert res.output_ids == ref, f"ddtree block {bs} budget {budget}"
                assert validator.verdict(ids, res.output_ids, ref, ref_check).verdict == "exact"
                deepest = max(deepest, max(res.acceptance_lengths))
    assert deepest >= 3


def test_scripted_deep_trees_on_hybrid():
    target = tiny_model("qwen3_5_text", seed=8, vocab_size=64)
    for seed, ids in enumerate(_prompts(64)):
        ref = hf_greedy(target, ids, 24)
        res = ddtree.generate(target, None, ids, max_new_tokens=24, proposer=ScriptedProposer(ref, 64, seed=seed))
        assert res.output_ids == ref
        assert max(res.acceptance_lengths) >= 4


def test_without_the_gdn_patch_the_same_test_fails(gdn_tree_off):
    """Proves the lossless tests see the bug: a GDN layer run as a flat chain gives other tokens."""
    target = tiny_model("qwen3_5_text", seed=8, vocab_size=64)
    wrong = 0
    for seed, ids in enumerate(_prompts(64)):
        ref = hf_greedy(target, ids, 24)
        res = ddtree.generate(target, None, ids, max_new_tokens=24, proposer=ScriptedProposer(ref, 64, seed=seed))
        wrong += res.output_ids != ref
    assert wrong > 0


def test_other_stateful_families_are_refused_for_tree_methods():
    for family in ("falcon_h1", "nemotron_h", "granitemoehybrid", "mamba2", "lfm2"):
        check_target_supported(family, "ar")
        for method in ("dflash", "ddtree"):
            with pytest.raises(ConfigError, match=family):
                check_target_supported(family, method)


def test_multimodal_wrapper_class_is_lossless():
    """Qwen3_5ForConditionalGeneration: embeddings and lm_head reached through the wrapper's accessors."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from ddtree.tiny import slow_decay_, tiny_config

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5_text", vocab_size=12).to_dict(), vision_config=vision)
    torch.manual_seed(0)
    target = slow_decay_(Qwen3_5ForConditionalGeneration(cfg)).eval()
    drafter = DFlashDrafter.random_for_target(cfg.text_config, block_size=8, seed=1)
    for ids in _prompts(12):
        ref = hf_greedy(target, ids, 12)
        for method, budget in (("dflash", None), ("ddtree", 16)):
            assert ddtree.generate(target, drafter, ids, method=method, budget=budget,
                                   max_new_tokens=12).output_ids == ref


def test_unknown_linear_attention_family_is_refused():
    """A model whose cache has linear-attention layers we have no exact tree patch for is refused."""
    target = tiny_model("qwen3_5_text", seed=1, vocab_size=12)
    target.config.model_type = "some_new_hybrid"
    ids = torch.tensor([[1, 2, 3]])
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4)
    assert ddtree.generate(target, drafter, ids, method="ar", max_new_tokens=3).output_ids
    with pytest.raises(ConfigError, match="some_new_hybrid"):
        ddtree.generate(target, drafter, ids, method="ddtree", budget=4, max_new_tokens=3)


def test_hybrid_ddtree_reads_the_device_once_per_round(monkeypatch):
    """The walk's one read per round and nothing else: the GDN verify/commit take the DraftTree where it is.

    The tree is built the way it is on a GPU (torch ops on the device: the engine option device_path="host_tree");
    on a CPU the default C build reads the drafter's top-k on purpose (there it is no device transfer)."""
    gpu_tree = {"device_path": "host_tree"}
    target = tiny_model("qwen3_5_text", seed=6, vocab_size=12)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=3)
    ids = _prompts(12)[1]
    ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=4, **gpu_tree)  # first-call work
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    res = ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=24, record=False, **gpu_tree)
    n_plain = len(reads)
    recorded = ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=24, **gpu_tree)
    monkeypatch.undo()
    assert res.rounds >= 3
    assert n_plain == 1 + res.rounds, reads  # the prefill's first token, then one walk per round
    # the per-round diagnosis records: one more read, at the end of the generation
    assert len(reads) - n_plain == 1 + recorded.rounds + 1, reads


@pytest.mark.parametrize("model_type", ["qwen3_5_text", pytest.param("qwen3", marks=pytest.mark.slow)])  # (KV rows too)
def test_one_engine_over_many_prompts_equals_a_fresh_generate_each(model_type):
    """ddtree.Engine sets up once and starts only a fresh cache per generation: nothing of one prompt's state
    (KV rows, GDN states, the drafter's context, the dense mask buffer) reaches the next. Prompts of several
    lengths, long then short, so a longer earlier state would show; greedy against HF and T = 1 against generate()."""
    vocab = 12
    target = tiny_model(model_type, seed=6, vocab_size=vocab)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=2)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab, (1, n), generator=g) for n in (23, 3, 14, 3)]
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 2), ("ddtree", 48)):
        engine = ddtree.Engine(target, drafter, method=method, budget=budget)
        for ids in prompts:
            assert engine.generate(ids, max_new_tokens=16).output_ids == hf_greedy(target, ids, 16), (method, budget)
        for i, ids in enumerate(prompts):
            got = engine.generate(ids, temperature=1.0, max_new_tokens=12, generator=torch.Generator().manual_seed(i))
            fresh = ddtree.generate(target, drafter, ids, method=method, budget=budget, temperature=1.0,
                                    max_new_tokens=12, generator=torch.Generator().manual_seed(i))
            assert got.output_ids == fresh.output_ids and got.acceptance_lengths == fresh.acceptance_lengths


def test_an_engine_checks_its_settings_when_built():
    target = tiny_model("qwen3", seed=6, vocab_size=12)
    with pytest.raises(ConfigError, match="budget"):
        ddtree.Engine(target, DFlashDrafter.random_for_target(target.config, block_size=8), method="ddtree", budget=0)
    with pytest.raises(ConfigError, match="tree_attention"):
        ddtree.Engine(target, None, method="ar", tree_attention="sparse")
    engine = ddtree.Engine(target, None, method="ar")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=0)


@pytest.mark.parametrize("prompt_len", [5, 70])  # a chain prefill (committed by the GDN commit), an upstream one
def test_stacked_gdn_states_commit_as_the_layers_alone(prompt_len, monkeypatch):
    """After a group's first commit its layers' conv and recurrent states become views of one stacked tensor each
    (gdn.commit._adopt_states) and later commits update them in one op each; the verification writes every layer's keys,
    d, decay exponents and conv inputs into slots of shared buffers (gdn.buffers._shared_layer) the commit gathers in one op each:
    bitwise the same states, round after round, as each layer alone from its own tensors."""
    import random

    from ddtree.engine.target import TargetSession
    from ddtree.testing.reference import random_tree

    target = tiny_model("qwen3_5_text", seed=6, vocab_size=12)
    ids = torch.randint(0, 12, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    states = {}
    for mode in ("stacked", "stacked, own tensors", "alone, shared", "alone"):
        rng = random.Random(4)
        with monkeypatch.context() as m:
            if mode.startswith("alone"):
                m.setattr(tree_gdn.commit, "_adopt_states", lambda cache, layer_ids: None)
            if mode in ("stacked, own tensors", "alone"):
                m.setattr(tree_gdn.forward, "_shared_layer", lambda *a: None)
            sess = TargetSession(target, capacity=256)
            sess.prefill(ids)
            states[mode] = []
            for n in (9, 24, 2, 40, 13):
                tree = random_tree(n, 12, rng)
                sess.verify(tree)
                leaf = max(range(n), key=lambda i: (int(tree.depths[i]), rng.random()))
                path = torch.nonzero(tree.ancestor_matrix()[leaf]).flatten()
                sess.commit(tree, path, path.tolist())
                # every layer counts the committed tokens (transformers >= 5.25 counts a GDN layer's tokens, and a
                # hybrid cache's get_seq_length reads its first layer: here a GDN one)
                counts = [getattr(layer, "cumulative_length_linear", None) for layer in sess.cache.layers]
                assert int(sess.cache.get_seq_length()) == sess.length and all(
                    int(c) == sess.length for c in counts if c is not None), (mode, sess.length, counts)
                states[mode].append([(layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
                                     for layer in sess.cache.layers if hasattr(layer, "recurrent_states")])
            if mode == "stacked":
                found = sess.cache.__dict__[tree_gdn.commit._STATES_ATTR]
                linear = [layer for layer in sess.cache.layers if hasattr(layer, "recurrent_states")]
                assert len(found[0]) == len(linear) >= 2
                assert all(layer.conv_states[0] is conv and layer.recurrent_states[0] is rec  # still the views
                           for layer, (conv, rec) in zip(linear, found[3], strict=True))
                assert linear[1].recurrent_states[0].data_ptr() == found[2][1].data_ptr()
    for mode in ("stacked", "stacked, own tensors", "alone, shared"):
        for r, (a, b) in enumerate(zip(states[mode], states["alone"], strict=True)):
            for (c, s), (c1, s1) in zip(a, b, strict=True):
                assert torch.equal(c, c1) and torch.equal(s, s1), f"{mode}, round {r}"
