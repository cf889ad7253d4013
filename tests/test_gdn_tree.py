"""Tree-aware Gated DeltaNet (ddtree.engine.gdn) against per-path sequential forwards.

Reference for every check: the unpatched model run on a node's root-to-node path as a plain
sequence after the same prefix (a deep copy of the prefilled cache). Tiny hybrids keep the
slow GDN decay of ddtree.tiny so the recurrent state carries memory across the tree.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from ddtree.engine import gdn as tree_gdn
from ddtree.engine.tree import DraftTree
from ddtree.tiny import tiny_model

MODEL_TYPES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
ATTN = ("eager", "sdpa")
VOCAB = 128
PROMPT_LEN = 9
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny matrices: extra intra-op threads only spin against each other on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def patched():
    was_installed = tree_gdn.is_installed()
    tree_gdn.install()
    yield
    if not was_installed:
        tree_gdn.uninstall()


@pytest.fixture
def unpatched():
    was_installed = tree_gdn.is_installed()
    tree_gdn.uninstall()
    yield
    if was_installed:
        tree_gdn.install()


@functools.cache
def _model(model_type: str, attn: str):
    return tiny_model(model_type, attn_implementation=attn, vocab_size=VOCAB)


# --------------------------------------------------------------------------- trees and helpers


def _random_tree(n: int, gen: torch.Generator, p_deep: float) -> list[int]:
    """Parents of an n-token tree; p_deep is the chance a node extends the previous one."""
    parents = [-1]
    for i in range(1, n):
        if torch.rand((), generator=gen).item() < p_deep:
            parents.append(i - 1)
        else:
            parents.append(int(torch.randint(0, i, (), generator=gen)))
    return parents


def _trees(seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "bushy": _random_tree(20, gen, p_deep=0.0),
        "deep": _random_tree(24, gen, p_deep=0.85),  # paths longer than the conv kernel
        "wide": [-1] + [0] * 9 + [1, 1, 2, 10, 13],
        "chain": [-1] + list(range(7)),  # DFlash
        "root": [-1],  # AR
    }


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _leaves(parents: list[int]) -> list[int]:
    has_child = set(parents[1:])
    return [i for i in range(len(parents)) if i not in has_child]


def _tree_mask(parents: list[int], past: int, dtype=torch.float32) -> torch.Tensor:
    """Additive (1, 1, q, past + q) mask: prefix, ancestors and self visible."""
    n = len(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i] = visible[p]
        visible[i, i] = True
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), visible], dim=1)
    return torch.zeros(1, 1, n, past + n, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


def _forward(model, ids, cache, position_ids=None, attention_mask=None):
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # < 5.24
    return model(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                 **{cache_kw: cache}).logits


def _prefill(model, prompt):
    cache = DynamicCache(config=model.config)
    _forward(model, prompt, cache)
    return cache


def _verify(model, cache, tokens, parents, past, method=tree_gdn.DEFAULT_METHOD):
    depth = torch.tensor([_depths(parents)]) + past
    with tree_gdn.tree_verification(torch.tensor(parents), method=method):
        return _forward(model, tokens, cache, position_ids=depth, attention_mask=_tree_mask(parents, past))


def _per_path_error(model, cache, tokens, parents, tree_logits) -> float:
    """Max |tree logit - per-path sequential logit| over all nodes (one run per leaf covers its path)."""
    err = 0.0
    for leaf in _leaves(parents):
        path = _path(parents, leaf)
        ref = _forward(model, tokens[:, path], copy.deepcopy(cache))
        err = max(err, (ref[0] - tree_logits[0, path]).abs().max().item())
    return err


def _compact_attention(cache, past: int, accepted: list[int]) -> None:
    keep = torch.tensor(list(range(past)) + [past + i for i in accepted])
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionLayer):
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def _linear_states(cache):
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers
            if isinstance(layer, LinearAttentionLayer)]


def _commit_and_compare(model, cache, ref_cache, tokens, past: int, accepted: list[int]) -> int:
    """Commit `accepted` (as the engine does: attention compacted, GDN committed), run it on the reference
    cache as a plain sequence, and check the GDN states agree. Returns the new committed length."""
    _compact_attention(cache, past, accepted)
    tree_gdn.commit_linear_states(cache, torch.tensor(accepted))
    _forward(model, tokens[:, accepted], ref_cache)
    for (c, r), (rc, rr) in zip(_linear_states(cache), _linear_states(ref_cache), strict=True):
        assert (c - rc).abs().max() <= 1e-5 and (r - rr).abs().max() <= 1e-5
    return past + len(accepted)


# --------------------------------------------------------------------------- verification


@pytest.mark.parametrize("method", tree_gdn.METHODS)
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tree_logits_equal_per_path_logits(patched, model_type, attn, method):
    model = _model(model_type, attn)
    gen = torch.Generator().manual_seed(1)
    cache = _prefill(model, torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen))
    for name, parents in _trees(seed=2).items():
        tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
        work = copy.deepcopy(cache)
        before = [(c.clone(), r.clone()) for c, r in _linear_states(work)]
        logits = _verify(model, work, tokens, parents, PROMPT_LEN, method)
        err = _per_path_error(model, cache, tokens, parents, logits)
        assert err <= TOL, f"{model_type}/{attn}/{method} tree {name}: max error {err:.2e}"
        for (c0, r0), (c1, r1) in zip(before, _linear_states(work), strict=True):  # verification leaves GDN state alone
            assert torch.equal(c0, c1) and torch.equal(r0, r1)


def _draft_tree(parents: list[int], tokens: torch.Tensor) -> DraftTree:
    """The engine's form of the same tree (device tensors, a host-known depth bound), built by hand."""
    depth = _depths(parents)
    return DraftTree(tokens[0], torch.tensor(parents), torch.tensor(depth), is_chain=parents == [-1, *range(len(parents) - 1)],
                     depth_bound=max(depth) + 2)  # a loose bound, as best_first_tree gives


@pytest.mark.parametrize("method", tree_gdn.METHODS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_draft_tree_verify_and_commit_equal_per_path(patched, model_type, method):
    """The engine's path: a DraftTree in, a device path tensor to commit, against sequential forwards."""
    model = _model(model_type, "sdpa")
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    cache, ref_cache = _prefill(model, prompt), _prefill(model, prompt)
    past = PROMPT_LEN
    for name in ("deep", "bushy", "chain", "wide"):
        parents = _trees(seed=8)[name]
        tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
        depth = torch.tensor([_depths(parents)]) + past
        with tree_gdn.tree_verification(_draft_tree(parents, tokens), method=method):
            logits = _forward(model, tokens, cache, position_ids=depth, attention_mask=_tree_mask(parents, past))
        err = _per_path_error(model, ref_cache, tokens, parents, logits)
        assert err <= TOL, f"{model_type}/{method} tree {name}: max error {err:.2e}"
        past = _commit_and_compare(model, cache, ref_cache, tokens, past, _path(parents, len(parents) - 1))


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_without_patch_the_tree_is_wrong(unpatched, model_type, attn):
    """Proves the per-path test sees the bug: upstream GDN runs the flat tree as one chain."""
    model = _model(model_type, attn)
    gen = torch.Generator().manual_seed(1)
    cache = _prefill(model, torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen))
    parents = _trees(seed=2)["bushy"]
    tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
    logits = _verify(model, copy.deepcopy(cache), tokens, parents, PROMPT_LEN)
    assert _per_path_error(model, cache, tokens, parents, logits) > 1e-3


def test_tree_on_an_empty_cache(patched):
    """A tree as the very first tokens: zero conv and recurrent state, then commit initialises them."""
    model = _model("qwen3_5_text", "sdpa")
    parents = _trees(seed=3)["deep"]
    tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    logits = _verify(model, cache, tokens, parents, past=0)
    err = 0.0
    for leaf in _leaves(parents):
        path = _path(parents, leaf)
        ref = _forward(model, tokens[:, path], DynamicCache(config=model.config))
        err = max(err, (ref[0] - logits[0, path]).abs().max().item())
    assert err <= TOL
    accepted = _path(parents, _leaves(parents)[-1])
    _compact_attention(cache, 0, accepted)
    tree_gdn.commit_linear_states(cache, torch.tensor(accepted))
    ref_cache = DynamicCache(config=model.config)
    _forward(model, tokens[:, accepted], ref_cache)
    nxt = torch.tensor([[5]])
    pos = torch.tensor([[len(accepted)]])
    assert (_forward(model, nxt, cache, pos) - _forward(model, nxt, ref_cache, pos)).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ("qwen3_5_text", "qwen3_next"))
def test_the_layer_norms_are_the_modules_formulas(model_type, dtype):
    """The layer's two F.rms_norm calls (one fused kernel each on a GPU) against upstream's formulas, on rows of
    ordinary size and rows so small that the epsilon counts: the q/k l2norm (x rsqrt(sum x^2 + eps), eps 1e-6, as
    rms_norm(x, eps / dk) dk^-1/2) within float32 rounding, and the gated output norm (the module's RMSNormGated of
    o = core / sqrt(dk) times silu(z), as rms_norm(core, weight, eps dk)) within the model dtype's rounding."""
    import importlib

    family = model_type.removesuffix("_text")
    l2norm = importlib.import_module(f"transformers.models.{family}.modeling_{family}").l2norm
    model = _model(model_type, "sdpa")
    layer = copy.deepcopy(next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.norm.weight.copy_(torch.randn(layer.head_v_dim, generator=g))
    dk, dv, hv, n = layer.head_k_dim, layer.head_v_dim, layer.num_v_heads, 7
    consts = tree_gdn.layer_consts(layer)
    x = torch.randn(3, n, dk, generator=g) * 2
    x[1] *= 1e-4  # |x|^2 ~ 1e-7 < eps
    got = torch.nn.functional.rms_norm(x, (dk,), consts.qk_weight, consts.qk_eps)
    torch.testing.assert_close(got, l2norm(x, eps=tree_gdn.L2NORM_EPS), rtol=4e-7, atol=0)
    hidden = torch.zeros(1, n, model.config.hidden_size, dtype=dtype)
    bufs = tree_gdn.new_buffers(layer, hidden, consts, layer.conv1d.weight.shape[0])
    core = bufs.core.copy_(torch.randn(1, hv, n, dv, generator=g) * 3)
    core[0, 0] *= 1e-5  # mean(o^2) ~ 1e-10 / dk < eps
    z = (torch.randn(1, n, hv * dv, generator=g) * 2).to(dtype)
    got = tree_gdn.layer._gated_norm(core, z, consts, bufs, tree_gdn.buffers._views(layer, bufs))
    o = (core.double() / dk ** 0.5).transpose(1, 2)  # (B, T, Hv, dv)
    exact = (layer.norm.weight.double() * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm.variance_epsilon)
             * torch.nn.functional.silu(z.double()).unflatten(-1, (hv, dv))).flatten(2)
    assert got.dtype == dtype
    if dtype == torch.float32:  # the module itself, on the same float32 input
        want = layer.norm(o.float().reshape(-1, dv), z.reshape(-1, dv)).reshape(1, n, -1)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9)
    else:  # one rounding to bf16 after silu(z) in bf16 (as before); upstream rounds o, the norm and its product too
        torch.testing.assert_close(got.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-6)


# --------------------------------------------------------------------------- commit


@pytest.mark.parametrize("method", tree_gdn.METHODS)
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_commit_equals_sequential_prefix_plus_path(patched, model_type, attn, method):
    """Several verify/walk/commit rounds, as the engine runs them, against one sequential cache."""
    model = _model(model_type, attn)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    cache, ref_cache = _prefill(model, prompt), _prefill(model, prompt)
    trees = _trees(seed=5)
    rounds = [  # (tree, which node ends the accepted path)
        (trees["deep"], "deepest"),
        (trees["bushy"], "random"),
        (trees["wide"], "root"),
        (trees["chain"], "deepest"),  # DFlash, everything accepted
        (trees["root"], "root"),  # AR
        (trees["deep"], "random"),
    ]
    past = PROMPT_LEN
    for parents, pick in rounds:
        tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
        logits = _verify(model, cache, tokens, parents, past, method)
        err = _per_path_error(model, ref_cache, tokens, parents, logits)
        assert err <= TOL, f"round verification drifted: {err:.2e}"
        depth = _depths(parents)
        if pick == "root":
            node = 0
        elif pick == "deepest":
            node = max(range(len(parents)), key=lambda i: depth[i])
        else:
            node = int(torch.randint(0, len(parents), (), generator=gen))
        past = _commit_and_compare(model, cache, ref_cache, tokens, past, _path(parents, node))
    assert cache.get_seq_length() == ref_cache.get_seq_length() == past
    nxt = torch.randint(0, VOCAB, (1, 3), generator=gen)
    pos = torch.arange(past, past + 3)[None]
    err = (_forward(model, nxt, cache, pos) - _forward(model, nxt, ref_cache, pos)).abs().max().item()
    assert err <= TOL


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "fresh"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_stacked_commit_equals_the_layer_by_layer_commit(patched, model_type, prefix, monkeypatch):
    """_commit_stacked (the like layers at once) against _commit_layer run on each layer alone: every path of a
    branching tree and of a chain (the whole chain taken without a gather), after a prefix or on an empty cache; the
    stacked commit both from each layer's own tensors and, as the engine verifies under inference mode, from the
    cache's shared buffers (`_shared_layer`: one gather for all layers)."""
    model = _model(model_type, "sdpa")
    gen = torch.Generator().manual_seed(7)
    past = PROMPT_LEN if prefix else 0
    cache = (_prefill(model, torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)) if prefix
             else DynamicCache(config=model.config))

    def alone(cache, pending):
        return [[item] for item in sorted(pending.items())]

    for name in ("deep", "chain"):
        parents = _trees(seed=7)[name]
        tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
        work = copy.deepcopy(cache)
        _verify(model, work, tokens, parents, past)
        pending = work.__dict__[tree_gdn._PENDING_ATTR]
        assert all(rec.slot is None for rec in pending.values())  # outside inference mode: no shared buffers
        groups = tree_gdn.commit._commit_groups(work, pending)
        linear = sum(isinstance(layer, LinearAttentionLayer) for layer in work.layers)
        assert len(groups) == 1 and len(groups[0]) == linear >= 2  # every GDN layer at once
        for node in range(len(parents)):
            path = torch.tensor(_path(parents, node))
            stacked, hosted, single = copy.deepcopy(work), copy.deepcopy(work), copy.deepcopy(work)
            tree_gdn.commit_linear_states(stacked, path)
            tree_gdn.commit_linear_states(hosted, path, path.tolist())  # the conv rows built on the host
            with monkeypatch.context() as m:
                m.setattr(tree_gdn.commit, "_commit_groups", alone)
                tree_gdn.commit_linear_states(single, path)
            shared = copy.deepcopy(cache)
            with torch.inference_mode():
                _verify(model, shared, tokens, parents, past)
                recs = [rec for _, rec in sorted(shared.__dict__[tree_gdn._PENDING_ATTR].items())]
                assert tree_gdn.commit._shared_buffers(recs) is not None
                tree_gdn.commit_linear_states(shared, path, path.tolist())
            for got in (stacked, hosted, shared):
                for (c, r), (c1, r1) in zip(_linear_states(got), _linear_states(single), strict=True):
                    assert torch.equal(c, c1), f"{name} node {node}: conv state"
                    assert torch.equal(r, r1), f"{name} node {node}: recurrent state"


def test_the_commit_groups_are_worked_out_again_when_a_state_or_the_tree_size_changes(patched):
    """_cached_groups reuses a grouping only for the same state tensors and tree size: a state replaced by one of
    another dtype (it then commits alone) or a tree of another size gets its grouping worked out again."""
    model = _model("qwen3_5_text", "sdpa")
    cache = _prefill(model, torch.arange(PROMPT_LEN)[None])

    def groups(parents):
        _verify(model, cache, torch.arange(len(parents))[None] % VOCAB, parents, PROMPT_LEN)
        pending = cache.__dict__[tree_gdn._PENDING_ATTR]
        got = [[i for i, _ in g] for g in tree_gdn.commit._cached_groups(cache, pending)]
        assert got == [[i for i, _ in g] for g in tree_gdn.commit._commit_groups(cache, pending)]
        del cache.__dict__[tree_gdn._PENDING_ATTR]
        for layer in cache.layers:  # the attention layers drop the tree again (the GDN states were left untouched)
            if not isinstance(layer, LinearAttentionLayer):
                layer.crop(PROMPT_LEN - layer.get_seq_length())
        return got

    linear = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)]
    assert groups([-1, 0, 0, 1]) == [linear]
    assert groups([-1, 0, 0, 1]) == [linear]  # reused
    assert groups([-1, 0, 1]) == [linear]  # another size
    layer = cache.layers[linear[0]]
    layer.conv_states[0] = layer.conv_states[0].double()
    assert groups([-1, 0, 1]) == [[linear[0]], linear[1:]]


def test_commit_rejects_a_non_path_and_a_changed_state(patched):
    model = _model("qwen3_5_text", "eager")
    cache = _prefill(model, torch.arange(PROMPT_LEN)[None])
    parents = [-1, 0, 0, 1]
    _verify(model, cache, torch.tensor([[1, 2, 3, 4]]), parents, PROMPT_LEN)
    for bad in ([0, 2, 3], [1], [0, 4], []):
        with pytest.raises(ValueError, match="root-to-node path"):
            tree_gdn.commit_linear_states(cache, torch.tensor(bad, dtype=torch.long))
    _forward(model, torch.tensor([[5]]), cache)  # a stray forward moves the GDN state in place
    with pytest.raises(RuntimeError, match="changed between verification and commit"):
        tree_gdn.commit_linear_states(cache, torch.tensor([0, 1]))

    cache = _prefill(model, torch.arange(PROMPT_LEN)[None])
    _verify(model, cache, torch.tensor([[1, 2, 3, 4]]), parents, PROMPT_LEN)
    tree_gdn.commit_linear_states(cache, torch.tensor([0, 1, 3]))
    with pytest.raises(RuntimeError, match="no GDN tree verification"):
        tree_gdn.commit_linear_states(cache, torch.tensor([0]))


def test_inference_mode_verification_then_plain_commit(patched):
    """The engine verifies under torch.inference_mode and commits outside it."""
    model = _model("qwen3_next", "sdpa")
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    parents = _trees(seed=6)["bushy"]
    tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
    accepted = _path(parents, len(parents) - 1)
    with torch.inference_mode():
        cache, ref_cache = _prefill(model, prompt), _prefill(model, prompt)
        _verify(model, cache, tokens, parents, PROMPT_LEN)
        _forward(model, tokens[:, accepted], ref_cache)
    _compact_attention(cache, PROMPT_LEN, accepted)
    tree_gdn.commit_linear_states(cache, torch.tensor(accepted))
    with torch.inference_mode():
        pos = torch.tensor([[PROMPT_LEN + len(accepted)]])
        out, ref = _forward(model, torch.tensor([[9]]), cache, pos), _forward(model, torch.tensor([[9]]), ref_cache, pos)
    assert (out - ref).abs().max() <= TOL


def test_tree_argument_errors(patched):
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], []):
        with pytest.raises(ValueError, match="parents"):
            with tree_gdn.tree_verification(torch.tensor(bad, dtype=torch.long)):
                pass
    with pytest.raises(ValueError, match="method"):
        with tree_gdn.tree_verification(torch.tensor([-1]), method="fast"):
            pass
    model = _model("qwen3_next", "eager")
    cache = _prefill(model, torch.arange(PROMPT_LEN)[None])
    with pytest.raises(ValueError, match="3-token tree"):
        with tree_gdn.tree_verification(torch.tensor([-1, 0, 0])):
            _forward(model, torch.tensor([[1, 2]]), cache)


# --------------------------------------------------------------------------- single cached token


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_single_step_equals_the_upstream_decode_step(patched, model_type):
    """Five decode steps under single_step(): logits and both GDN states as the upstream decode path's."""
    model = _model(model_type, "sdpa")
    prompt = torch.arange(PROMPT_LEN)[None]
    ours, ref = _prefill(model, prompt), _prefill(model, prompt)
    calls = []
    original = tree_gdn.forward._step_forward
    tree_gdn.forward._step_forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for i, tok in enumerate((3, 50, 7, 7, 101)):
            pos = torch.tensor([[PROMPT_LEN + i]])
            with tree_gdn.single_step():
                got = _forward(model, torch.tensor([[tok]]), ours, position_ids=pos)
            want = _forward(model, torch.tensor([[tok]]), ref, position_ids=pos)
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
            for (c1, r1), (c2, r2) in zip(_linear_states(ours), _linear_states(ref), strict=True):
                torch.testing.assert_close(c1, c2, atol=TOL, rtol=0)
                torch.testing.assert_close(r1, r2, atol=TOL, rtol=0)
    finally:
        tree_gdn.forward._step_forward = original
    assert len(calls) == 5 * len(_linear_states(ours))


def test_single_step_leaves_what_it_cannot_do_to_the_upstream_forward(patched):
    """No state yet (a prefill), several tokens, a padding mask: the upstream forward runs, unchanged."""
    model = _model("qwen3_5_text", "sdpa")
    prompt = torch.arange(PROMPT_LEN)[None]
    with tree_gdn.single_step():
        a = _prefill(model, prompt)
        two = _forward(model, torch.tensor([[4, 5]]), a)
    b = _prefill(model, prompt)
    assert torch.equal(two, _forward(model, torch.tensor([[4, 5]]), b))
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    x = torch.randn(1, 1, model.config.hidden_size)
    assert tree_gdn.forward._step_forward(layer, x, a, attention_mask=torch.ones(1, 1)) is None
    assert tree_gdn.forward._step_forward(layer, x, None) is None
    assert tree_gdn.forward._step_forward(layer, torch.randn(1, 2, model.config.hidden_size), a) is None


# --------------------------------------------------------------------------- patch mechanics


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outside_the_context_the_forward_is_untouched(model_type):
    model = _model(model_type, "sdpa")
    prompt, step = torch.arange(PROMPT_LEN)[None], torch.tensor([[7, 8, 9]])
    was_installed = tree_gdn.is_installed()
    outputs = []
    for install in (False, True):
        tree_gdn.install() if install else tree_gdn.uninstall()
        cache = _prefill(model, prompt)
        outputs.append((_forward(model, step, cache), _forward(model, torch.tensor([[3]]), cache),
                        [(c.clone(), r.clone()) for c, r in _linear_states(cache)]))
    if not was_installed:
        tree_gdn.uninstall()
    (a1, a2, sa), (b1, b2, sb) = outputs
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert all(torch.equal(x, y) for pa, pb in zip(sa, sb, strict=True) for x, y in zip(pa, pb, strict=True))


def test_install_is_idempotent_and_reversible():
    was_installed = tree_gdn.is_installed()
    tree_gdn.uninstall()
    originals = {cls: cls.__dict__["forward"] for cls in tree_gdn.target_classes()}
    assert len(originals) == len(tree_gdn.TARGETS)
    assert not tree_gdn.is_installed()
    names = tree_gdn.install()
    assert sorted(names) == sorted(cls.__name__ for cls in originals)
    wrapped = {cls: cls.__dict__["forward"] for cls in originals}
    tree_gdn.install()
    assert tree_gdn.is_installed()
    assert all(cls.__dict__["forward"] is wrapped[cls] for cls in originals)
    tree_gdn.uninstall()
    tree_gdn.uninstall()
    assert all(cls.__dict__["forward"] is originals[cls] for cls in originals)
    if was_installed:
        tree_gdn.install()


def test_module_level_padding_mask(patched):
    """A 2-D padding mask zeroes the masked tokens' inputs, as upstream does; all-ones changes nothing."""
    model = _model("qwen3_5_text", "eager")
    cache = _prefill(model, torch.arange(PROMPT_LEN)[None])
    gdn = model.model.layers[0].linear_attn
    parents = [-1, 0, 0, 1]
    hidden = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with tree_gdn.tree_verification(torch.tensor(parents)):
        plain = gdn(hidden, cache=copy.deepcopy(cache), attention_mask=None)
        ones = gdn(hidden, cache=copy.deepcopy(cache), attention_mask=torch.ones(1, 4))
        masked = gdn(hidden, cache=copy.deepcopy(cache), attention_mask=torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
        zeroed = gdn(hidden * torch.tensor([1.0, 1.0, 0.0, 1.0])[None, :, None], cache=copy.deepcopy(cache))
    assert torch.equal(plain, ones)
    assert torch.equal(masked, zeroed)


# Upstream API this patch reads; a transformers upgrade that changes any of it must fail here.
_CACHE_PARAM = "cache" if Version(transformers.__version__) >= Version("5.24") else "cache_params"
_FORWARD_PARAMS = [("self", "POSITIONAL_OR_KEYWORD"), ("hidden_states", "POSITIONAL_OR_KEYWORD"),
                   (_CACHE_PARAM, "POSITIONAL_OR_KEYWORD"), ("attention_mask", "POSITIONAL_OR_KEYWORD"),
                   ("kwargs", "VAR_KEYWORD")]
_MODULE_ATTRS = ("conv1d", "conv_kernel_size", "activation", "A_log", "dt_bias", "norm", "out_proj", "layer_idx",
                 "key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads")


def test_installed_transformers_is_in_the_verified_range():
    assert Version(transformers.__version__) in SpecifierSet(tree_gdn.VERSIONS)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_upstream_gdn_api_is_pinned(model_type):
    model = _model(model_type, "eager")
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert type(gdn) in tree_gdn.target_classes()
    forward = inspect.unwrap(type(gdn).__dict__["forward"])
    params = [(p.name, p.kind.name) for p in inspect.signature(forward).parameters.values()]
    assert params == _FORWARD_PARAMS, f"{type(gdn).__name__}.forward signature changed: {params}"
    for attr in _MODULE_ATTRS:
        assert hasattr(gdn, attr), attr
    if model_type == "qwen3_next":
        assert all(hasattr(gdn, a) for a in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"))
    else:
        assert all(hasattr(gdn, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    assert gdn.conv1d.weight.shape == (gdn.key_dim * 2 + gdn.value_dim, 1, gdn.conv_kernel_size)

    cache = DynamicCache(config=model.config)
    for method, names in (("get_conv_state", ["layer_idx", "state_idx"]),
                          ("get_recurrent_state", ["layer_idx", "state_idx"]),
                          ("update_conv_state", ["conv_states", "layer_idx", "state_idx", "kwargs"]),
                          ("update_recurrent_state", ["recurrent_states", "layer_idx", "state_idx", "kwargs"])):
        assert list(inspect.signature(getattr(cache, method)).parameters) == names, method
    layer = cache.layers[0]
    assert isinstance(layer, LinearAttentionLayer)
    for attr in ("conv_states", "recurrent_states", "has_previous_state", "record_past", "conv_kernel_size"):
        assert hasattr(layer, attr), attr
