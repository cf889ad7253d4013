"""Engine: lossless against HF greedy, tree verification against per-path runs, the walk, the builder."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import ddtree
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import accepted_path, best_first_tree, chain_tree, tree_from_parents, walk
from ddtree.testing.reference import (
    ScriptedProposer,
    heap_best_first,
    hf_greedy,
    random_tree,
    sequential_path_logits,
    tree_paths,
)
from ddtree.testing.tiny import tiny_model

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


def test_the_kv_arena_commits_as_each_layer_alone(target, monkeypatch):
    """All attention layers in one KVArena buffer: a commit's one gather and copy leave every layer's keys and values
    as each layer's own keep does, through buffer growth (a short capacity hint) and chains; and every layer joined."""
    from ddtree.engine.target import KVArena, PreallocatedLayer

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


def test_walk_follows_target_choices():
    tree = tree_from_parents([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4])
    # target after root wants 2 → node 2; after node 2 wants 4 → node 4; after node 4 wants 7 (miss)
    choice = torch.tensor([2, 0, 4, 0, 7, 0])
    assert accepted_path(tree, choice).tolist() == [0, 2, 4]
    assert accepted_path(tree, torch.tensor([8, 0, 0, 0, 0, 0])).tolist() == [0]
    chain = chain_tree(torch.tensor(9), torch.tensor([1, 2, 3]))
    assert accepted_path(chain, torch.tensor([1, 2, 0, 0])).tolist() == [0, 1, 2]


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


@pytest.mark.parametrize("budget", [1, 2, 7, 64, 300])
def test_best_first_tree_matches_heap(budget):
    g = torch.Generator().manual_seed(budget)
    for L, V in ((1, 50), (3, 7), (15, 200)):
        logp = torch.log_softmax(torch.randn(L, V, generator=g) * 3, dim=-1)
        tree = best_first_tree(torch.tensor(0), logp, budget)
        ref = heap_best_first(logp, budget)
        got = tree_paths(tree)
        assert set(got) == {p for _, p in ref}
        for s, p in ref:
            assert abs(got[p] - s) < 1e-4
        # structure: parents precede children, depth = parent depth + 1
        par = tree.parents.tolist()
        assert all(0 <= par[i] < i for i in range(1, len(par)))
        assert (tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all()


@pytest.mark.parametrize("build", ["c", "python", "python-pruned"])
@pytest.mark.parametrize("budget", [1, 7, 64, 300])
def test_best_first_tree_host_build_equals_device_build(budget, build, monkeypatch):
    """The host build (CPU default: the C build, or without it the Python heap / NumPy passes, pruning as shipped
    and at every budget) and the torch build (other devices) give the same tree, ties included."""
    from ddtree.engine import tree as tree_mod

    if build == "c" and tree_mod._hosttree is None:
        pytest.skip("the C tree build is not compiled here")
    if build != "c":
        monkeypatch.setattr(tree_mod, "_hosttree", None)
    if build == "python-pruned":
        monkeypatch.setattr(tree_mod, "PRUNE_MIN_BUDGET", 1)
    g = torch.Generator().manual_seed(budget)
    cases = [torch.randn(L, V, generator=g) * 3 for L, V in ((1, 50), (3, 7), (15, 200))]
    cases += [torch.zeros(6, 5), torch.randn(15, 64, generator=g).bfloat16().float()]  # ties everywhere / bf16 ties
    peaky = torch.randn(15, 300, generator=g)  # a trained drafter's shape: the host build prunes most candidates
    peaky[torch.arange(15), torch.randint(0, 300, (15,), generator=g)] += 14
    peaky[9:, :] = 0  # flat deep rows: every candidate there falls below the threshold (the depths stop)
    cases += [peaky]
    cases = [torch.log_softmax(c, dim=-1) for c in cases]
    for logp in cases:
        a = best_first_tree(torch.tensor(3), logp, budget, host=True)
        b = best_first_tree(torch.tensor(3), logp, budget, host=False)
        for name in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.ancestor_matrix(), b.ancestor_matrix())
        width = a.ancestor_index().shape[1]  # the host knows the exact depth; the device a bound
        assert torch.equal(a.ancestor_index(), b.ancestor_index()[:, :width])


def test_the_host_builds_select_the_same_tree():
    """The C build (_best_first_native), the Python heap (_best_first_heap) and the per-depth passes
    (_best_first_host) select the same tree, ties and -inf included, with the same ancestry and child lists."""
    from ddtree.engine.tree import _best_first_heap, _best_first_host, _best_first_native, _hosttree

    if _hosttree is None:
        pytest.skip("the C tree build is not compiled here (see test_the_c_tree_build_is_compiled)")
    g = torch.Generator().manual_seed(7)
    peaky = torch.randn(15, 120, generator=g)
    peaky[torch.arange(15), torch.randint(0, 120, (15,), generator=g)] += 10
    hole = torch.randn(15, 100, generator=g)
    hole[3, :] = float("-inf")  # a row with one finite value: -inf scores below it
    hole[3, 5] = 0
    cases = [torch.randn(15, 120, generator=g) * 3, torch.zeros(6, 5), peaky, hole, torch.zeros(15, 30),
             torch.randn(15, 64, generator=g).bfloat16().float(), torch.randn(1, 9, generator=g), torch.randn(2, 1)]
    for logits in cases:
        logp = torch.log_softmax(logits, dim=-1)
        for budget in (1, 2, 3, 5, 16, 33, 64, 100, 200, 1024):
            vals, toks = logp.topk(min(budget, logp.shape[1]), dim=-1)
            native = _best_first_native(torch.tensor(4), vals, toks, budget)
            heap = _best_first_heap(torch.tensor(4), vals, toks, budget)
            for b in (heap, _best_first_host(torch.tensor(4), vals, toks, budget)):
                for name in ("tokens", "parents", "depths", "scores"):
                    assert torch.equal(getattr(native, name), getattr(b, name)), (name, budget, logits.shape)
                assert torch.equal(native.ancestor_matrix(), b.ancestor_matrix())
                assert torch.equal(native.ancestor_index(), b.ancestor_index())
                assert native.depth_bound == b.depth_bound
            assert native._walk_index == heap._walk_index


def test_the_c_build_from_the_rows_reads_exactly_torch_topk():
    """_best_first_rows takes each row's ranks itself, as the search reads them: the same tree as torch.topk and the
    C build from its lists wherever the ranks read are unique; None (the caller then takes torch.topk) where a rank
    read ties, a row read holds a NaN or a read reaches -inf; ties among ranks never read change nothing."""
    from ddtree.engine.tree import _best_first_native, _best_first_rows, _hosttree

    if _hosttree is None:
        pytest.skip("the C tree build is not compiled here")

    def same(a, b):  # scores bitwise (NaN included)
        return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("tokens", "parents", "depths")) and (
            torch.equal(a.scores.view(torch.int32), b.scores.view(torch.int32))
            and torch.equal(a.ancestor_matrix(), b.ancestor_matrix()) and a._walk_index == b._walk_index)

    g = torch.Generator().manual_seed(11)
    read = 0
    for trial in range(120):
        L, V = int(torch.randint(1, 17, (1,), generator=g)), int(torch.randint(1, 2100, (1,), generator=g))
        logits = torch.randn(L, V, generator=g) * (0.5 + trial % 4)
        if trial % 3 == 0:  # a trained drafter's peaked rows
            logits[torch.arange(L), torch.randint(0, V, (L,), generator=g)] += 12
        logp = torch.log_softmax(logits, dim=-1)
        for budget in (1, 2, 9, 64, 65, 300):
            got = _best_first_rows(torch.tensor(5), logp, budget)
            want = _best_first_native(torch.tensor(5), *logp.topk(min(budget, V), dim=-1), budget)
            if got is None:  # random float32 values: only where a tie is read
                top = logp.sort(dim=-1, descending=True).values[:, : min(budget, V) + 1]
                assert (top[:, 1:] == top[:, :-1]).any(), (L, V, budget)
                continue
            read += 1
            assert same(got, want), (L, V, budget)
    assert read > 600
    ties = torch.log_softmax(torch.randn(6, 50, generator=g) * 3, dim=-1)
    ties[:, 40:] = -30.0  # ties far below anything a budget of 8 reads
    assert same(_best_first_rows(torch.tensor(1), ties, 8), _best_first_native(torch.tensor(1), *ties.topk(8), 8))
    for bad in ("tie", "nan", "-inf"):
        logp = torch.log_softmax(torch.randn(6, 50, generator=g) * 3, dim=-1)
        second = logp[2].topk(2).indices[1]
        if bad == "tie":  # rank 1 of row 2 ties rank 2: read at once by a budget of 8
            logp[2, logp[2].topk(3).indices[2]] = logp[2, second]
        elif bad == "nan":  # torch.topk ranks a NaN first
            logp[2, 0] = float("nan")
        else:  # row 0 holds one finite value: its rank 1 is -inf, tied with all the others
            logp[0] = float("-inf")
            logp[0, 7] = 0.0
        assert _best_first_rows(torch.tensor(1), logp, 8) is None, bad
        # best_first_tree then takes torch.topk's lists
        assert same(best_first_tree(torch.tensor(1), logp, 8), _best_first_native(torch.tensor(1), *logp.topk(8), 8))


def test_the_c_tree_build_is_compiled():
    """`make install` compiles ddtree/engine/_hosttree.c (setup.py); where a C compiler exists it must be there, or
    every CPU round pays the Python build (several times slower) without saying so."""
    import shutil

    from ddtree.engine import tree as tree_mod

    if tree_mod._hosttree is None and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the Python builds serve")
    assert tree_mod._hosttree is not None, "ddtree/engine/_hosttree.c is not compiled: rerun `make install`"


def test_the_greedy_walk_on_asked_rows_equals_the_walk():
    """greedy_walk_rows asks only for the rows on its path (in batches) and walks as walk(tree, argmax) does."""
    from ddtree.engine import tree as tree_mod
    from ddtree.engine.tree import greedy_walk_rows

    g = torch.Generator().manual_seed(3)
    for budget in (4, 64, 200):
        logp = torch.log_softmax(torch.randn(10, 7, generator=g) * 2, dim=-1)
        tree = best_first_tree(torch.tensor(2), logp, budget)
        for _ in range(40):
            logits = torch.randn(len(tree), 7, generator=g)
            logits[0, int(tree.tokens[1])] += 3  # some walks go deep
            asked = []

            def argmax(nodes, logits=logits, asked=asked):
                asked.extend(nodes)
                return logits[nodes].argmax(-1).tolist()

            a, b = greedy_walk_rows(tree, argmax), walk(tree, logits.argmax(-1))
            assert a.path_list == b.path_list and a.tokens == b.tokens
            plain = dataclasses.replace(tree, _walk_index=None)  # the heap's child index (budget <= 64) or none
            c = greedy_walk_rows(plain, lambda nodes, logits=logits: logits[nodes].argmax(-1).tolist())
            assert (tree._walk_index is not None) == (budget <= 64 or tree_mod._hosttree is not None)
            assert c.path_list == a.path_list and c.tokens == a.tokens
            assert torch.equal(a.path, b.path) and int(a.next_root) == int(b.next_root)
            assert set(a.path_list) <= set(asked) and len(asked) == len(set(asked))  # each row once


def test_host_walk_equals_device_walk():
    """A host-built tree (CPU) walks in NumPy; the torch walk of the same tree gives the same path and tokens."""
    g = torch.Generator().manual_seed(0)
    for budget in (4, 64):
        logp = torch.log_softmax(torch.randn(8, 6, generator=g) * 2, dim=-1)
        tree = best_first_tree(torch.tensor(2), logp, budget)
        assert tree._host is not None
        device_built = best_first_tree(torch.tensor(2), logp, budget, host=False)
        assert device_built._host is None
        for _ in range(30):
            choice = torch.randint(0, 6, (len(tree),), generator=g)
            choice[0] = tree.tokens[1]  # the first node's token, so that some walks go deep
            a, b = walk(tree, choice), walk(device_built, choice)
            assert a.path_list == b.path_list and a.tokens == b.tokens
            assert torch.equal(a.path, b.path) and int(a.next_root) == int(b.next_root)


def test_best_first_tree_with_ties_is_a_tree():
    logp = torch.log_softmax(torch.zeros(6, 5), dim=-1)  # every score ties within a depth
    a = best_first_tree(torch.tensor(0), logp, 20)
    b = best_first_tree(torch.tensor(0), logp, 20)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    ref = sorted(s for s, _ in heap_best_first(logp, 20))
    assert sorted(tree_paths(a).values()) == pytest.approx(ref, abs=1e-5)
    par = a.parents.tolist()
    assert all(0 <= par[i] < i for i in range(1, len(par)))
