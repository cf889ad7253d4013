"""Engine: lossless against HF greedy, tree verification against per-path runs, the commit (trees: test_tree.py)."""

from __future__ import annotations

import random

import pytest
import torch

import ddtree
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import chain_tree
from ddtree.testing.reference import ScriptedProposer, hf_greedy, random_tree, sequential_path_logits
from ddtree.tiny import tiny_model

PURE = ["qwen3", "llama"]


@pytest.fixture(scope="module", params=[(t, a) for t in PURE for a in ("eager", "sdpa")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def target(request):
    model_type, attn = request.param
    return tiny_model(model_type, seed=1, attn_implementation=attn, vocab_size=96)


def prompts(vocab: int, lengths=(1, 5, 23)):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


def test_ar_equals_hf_greedy(target):
    for ids in prompts(target.config.vocab_size):
        ref = hf_greedy(target, ids, 12)
        res = ddtree.generate(target, None, ids, method="ar", max_new_tokens=12)
        assert res.output_ids == ref
        assert res.acceptance_lengths == [1] * 11


def test_scripted_trees_are_lossless_and_deep(target):
    V = target.config.vocab_size
    deep = 0
    for seed, ids in enumerate(prompts(V)):
        ref = hf_greedy(target, ids, 30)
        prop = ScriptedProposer(ref, V, seed=seed)
        res = ddtree.generate(target, None, ids, method="ddtree", max_new_tokens=30, proposer=prop)
        assert res.output_ids == ref
        assert sum(res.acceptance_lengths) == 29
        deep = max(deep, max(res.acceptance_lengths))
    assert deep >= 5  # the scripted truth was accepted several levels deep


def test_tree_logits_equal_per_path_sequential(target):
    V = target.config.vocab_size
    rng = random.Random(3)
    for ids in prompts(V, (4, 17)):
        for n in (1, 2, 9, 33):
            tree = random_tree(n, V, rng)
            ref = sequential_path_logits(target, ids, tree)
            sess = TargetSession(target)
            sess.prefill(ids)
            logits, _ = sess.verify(tree)
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arena", [True, False])
def test_update_rows_writes_what_update_writes(arena):
    """PreallocatedLayer.update_rows (keys and values in the projections' layout [B, T, kv heads, d], the lean
    forward's write) leaves the buffers and returns the views update() does: through growth, a commit's keep,
    crops, and a forward under autograd after inference-mode ones."""
    from ddtree.engine.kv_cache import KVArena, PreallocatedLayer

    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(1, n, 2, 4, generator=g), torch.randn(1, n, 2, 4, generator=g)) for n in (5, 1, 3, 7, 2, 9)]
    results = []
    for rows in (True, False):
        pool = KVArena(8, 2) if arena else None
        layers = [PreallocatedLayer(8, pool, i) for i in range(2)]
        seen = []
        for i, (k, v) in enumerate(steps):
            with torch.inference_mode(i < 5):
                for j, layer in enumerate(layers):
                    kj, vj = k + j, v - j
                    if rows:
                        out = layer.update_rows(kj, vj)
                    else:
                        out = layer.update(kj.transpose(1, 2), vj.transpose(1, 2))
                    seen.append([t.clone() for t in out] + [layer.get_seq_length()])
                    if i == 2:
                        layer.keep(2, torch.tensor([3, 0]))
                    if i == 3:
                        layer.crop(-2)
        results.append(seen)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_the_kv_arena_commits_as_each_layer_alone(target, monkeypatch):
    """All attention layers in one KVArena buffer: a commit's one gather and copy leave every layer's keys and values
    as each layer's own keep does, through buffer growth (a short capacity hint) and chains; and every layer joined."""
    from ddtree.engine.kv_cache import KVArena, PreallocatedLayer

    V = target.config.vocab_size
    ids = prompts(V, (9,))[0]
    trees = [random_tree(n, V, random.Random(n)) for n in (24, 1, 9, 40, 5, 60)]  # past 64 rows: growth
    trees.insert(2, chain_tree(torch.tensor(1), torch.tensor([2, 3, 4])))
    sessions = {}
    for mode in ("arena", "alone"):
        rng = random.Random(9)  # the same paths in both
        with monkeypatch.context() as m:
            if mode == "alone":
                m.setattr(KVArena, "join", lambda *a: False)
            sess = sessions[mode] = TargetSession(target, capacity=8)  # short: the buffers must grow
            sess.prefill(ids)
            for tree in trees:
                sess.verify(tree)
                leaf = max(range(len(tree)), key=lambda i: (int(tree.depths[i]), rng.random()))
                path = torch.nonzero(tree.ancestor_matrix()[leaf]).flatten()
                sess.commit(tree, path, path.tolist())
    layers = {mode: [layer for layer in s.cache.layers if isinstance(layer, PreallocatedLayer)]
              for mode, s in sessions.items()}
    assert all(layer.arena is not None for layer in layers["arena"]) and len(layers["arena"]) > 1
    assert all(layer.arena is None for layer in layers["alone"])
    assert layers["arena"][0]._k.shape[-2] > 64  # grown past its first allocation
    assert sessions["arena"].length == sessions["alone"].length
    for a, b in zip(layers["arena"], layers["alone"], strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_commit_keeps_exactly_the_accepted_path(target):
    """After a non-contiguous commit, the next forward equals a cache built from prefix + path."""
    V = target.config.vocab_size
    rng = random.Random(5)
    ids = prompts(V, (9,))[0]
    tree = random_tree(24, V, rng)
    sess = TargetSession(target)
    sess.prefill(ids)
    sess.verify(tree)
    leaf = max(range(len(tree)), key=lambda i: (int(tree.depths[i]), i))
    path = torch.nonzero(tree.ancestor_matrix()[leaf]).flatten()
    sess.commit(tree, path)
    nxt = torch.tensor([[3]])
    got = target(nxt, position_ids=torch.tensor([[sess.length]]), cache=sess.cache, use_cache=True).logits[0, -1]
    full = torch.cat([ids, tree.tokens[path][None], nxt], dim=1)
    want = target(full).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_stop_tokens_and_max_new_tokens(target):
    ids = prompts(target.config.vocab_size, (6,))[0]
    ref = hf_greedy(target, ids, 20)
    stop = ref[7]
    first = ref.index(stop)
    prop = ScriptedProposer(ref, target.config.vocab_size, seed=1, miss_rate=0.0)
    res = ddtree.generate(target, None, ids, max_new_tokens=20, stop_token_ids=[stop], proposer=prop)
    assert res.output_ids == ref[: first + 1] and res.stopped_by == "stop_token"
    for m in (1, 2, 13):
        res = ddtree.generate(target, None, ids, max_new_tokens=m,
                              proposer=ScriptedProposer(ref, target.config.vocab_size, seed=2, miss_rate=0.0))
        assert res.output_ids == ref[:m]
