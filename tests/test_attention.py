"""Tree attention (ddtree.engine.attention): split and flex against an independent dense reference, then the engine.

The reference builds the full visibility matrix from positions (prefix key j at pos0 + j, node i at
past + depth_i) and runs fp64 softmax attention with repeated key/value heads and an explicit sink
column; it shares no code with the implementation.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import ddtree
from ddtree.engine import attention as A
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.tree import chain_tree, walk
from ddtree.pipeline import config_checks as V
from ddtree.testing.reference import ScriptedProposer, hf_greedy, random_tree
from ddtree.tiny import tiny_model

D = 16


def reference(q, k, v, tree, past, pos0, window, scale, sink=None):
    """fp64 attention of the tree's queries over [prefix ++ tree] under the position rule."""
    B, H, n, _ = q.shape
    hkv, S = k.shape[1], k.shape[2]
    kp = S - n
    depth = torch.tensor(tree.depths.tolist())
    parents = tree.parents.tolist()
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a = i
        while a >= 0:  # walk up the parent links
            anc[i, a] = True
            a = parents[a]
    kpos = torch.cat([pos0 + torch.arange(kp), past + depth])
    qpos = past + depth
    vis = torch.cat([torch.ones(n, kp, dtype=torch.bool), anc], dim=1)
    if window is not None:
        vis &= kpos[None, :] > qpos[:, None] - window
    kk = k.double().repeat_interleave(H // hkv, dim=1)
    vv = v.double().repeat_interleave(H // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, H, 1, 1).expand(B, H, n, 1)], dim=-1)
        vv = torch.cat([vv, torch.zeros(B, H, 1, vv.shape[-1], dtype=vv.dtype)], dim=2)
    return (torch.softmax(s, dim=-1) @ vv).transpose(1, 2)  # [B, n, H, D] like the attention functions


def _inputs(H, hkv, kp, n, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, H, D, generator=g).transpose(1, 2)  # a transposed view, as the models pass it
    if strided:  # keys as views of a larger preallocated buffer
        kb = torch.randn(1, hkv, kp + n + 13, D, generator=g)
        vb = torch.randn(1, hkv, kp + n + 13, D, generator=g)
        return q, kb[:, :, : kp + n], vb[:, :, : kp + n]
    return q, torch.randn(1, hkv, kp + n, D, generator=g), torch.randn(1, hkv, kp + n, D, generator=g)


def _module():
    return SimpleNamespace(is_causal=True, num_key_value_groups=1)


TREES = [random_tree(n, 50, random.Random(n)) for n in (1, 2, 9, 33, 70)]


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, 1, 3, 16, 1000])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=lambda h: f"H{h[0]}kv{h[1]}")
def test_split_equals_dense_reference(base, window, heads):
    H, hkv = heads
    fn = A.split_attention(base)
    seed = 0
    for kp in (1, 7, 64, 300):
        for tree in TREES:
            for pos0 in ((0, 5) if window is not None else (0,)):  # pos0 > 0: a cropped sliding cache
                seed += 1
                past = pos0 + kp
                q, k, v = _inputs(H, hkv, kp, len(tree), seed, strided=seed % 2 == 0)
                sink = torch.randn(H, generator=torch.Generator().manual_seed(seed)) if seed % 3 == 0 else None
                with A.tree_verification(tree, past):
                    out, _ = fn(_module(), q, k, v, None, scaling=D ** -0.5, sliding_window=window, s_aux=sink)
                ref = reference(q, k, v, tree, past, pos0, window, D ** -0.5, sink)
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    kernels = set(A.chosen_kernels().values())
    assert ("cpu_flash" if base == "sdpa" else "math") in kernels  # sdpa's lse comes from torch's fused CPU kernel


def test_split_is_plain_outside_verification():
    fn = A.split_attention("sdpa")
    q, k, v = _inputs(4, 2, 10, 5, 0)
    mask = torch.zeros(1, 1, 5, 15)
    mask[..., 12:] = torch.finfo(torch.float32).min
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(is_causal=True, num_key_value_groups=2)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = fn(module, q, k, v, mask, scaling=0.25)
    assert torch.equal(got, want)


def test_merge_is_exact_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    parts = [A.attention_lse(q, k[:, :, a:b], v[:, :, a:b], None, 0.3, "eager") for a, b in ((0, 7), (7, 30))]
    full, _ = A.attention_lse(q, k, v, None, 0.3, "eager")
    torch.testing.assert_close(A.merge_lse(parts), full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_of_two_parts_is_as_precise_as_the_weighted_sum(dtype):
    """The two-part merge (one lerp in float32) against the float64 weighted sum of the same parts: no less precise
    than the float32 weighted sum sigmoid(gap) o_1 + sigmoid(-gap) o_2 it replaced, over gaps of every size."""
    g = torch.Generator().manual_seed(2)
    o1, o2 = (torch.randn(2, 3, 400, 16, generator=g).to(dtype) for _ in range(2))
    gaps = torch.cat([torch.randn(2, 3, 200, generator=g) * 3, torch.linspace(-40, 40, 1200).view(2, 3, 200)], -1)
    lse2 = torch.randn(2, 3, 400, generator=g) * 10
    lse1 = lse2 + gaps
    merged = A.merge_lse([(o1, lse1), (o2, lse2)])
    assert merged.dtype == torch.float32 and merged.shape == o1.shape
    w = torch.sigmoid(lse1.double() - lse2.double()).unsqueeze(-1)
    exact = o1.double() * w + o2.double() * (1 - w)
    gap = (lse1 - lse2).unsqueeze(-1)
    before = o1.float() * torch.sigmoid(gap) + o2.float() * torch.sigmoid(-gap)
    err, err_before = (merged.double() - exact).abs().max(), (before.double() - exact).abs().max()
    assert err <= max(err_before, 1e-7) * 1.5 and err < 1e-6
    # the attention-sink path (three terms) on the same parts
    sink = torch.full_like(lse1, -1e4)  # a sink no key beats: the two-part answer
    torch.testing.assert_close(A.merge_lse([(o1, lse1), (o2, lse2)], sink), merged, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- flex


def _dense_mask_mod(bm, qlen, kvlen):
    b, h = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    qi = torch.arange(qlen)[:, None].expand(qlen, kvlen)
    ki = torch.arange(kvlen)[None, :].expand(qlen, kvlen)
    return bm.mask_mod(b, h, qi, ki)


@pytest.mark.parametrize("window", [None, 5, 200])
def test_flex_block_lists_cover_the_mask(window):
    """Every block with a visible entry is listed; a block listed as full is visible everywhere."""
    B = A.FLEX_BLOCK
    for kp, n, pos0 in ((3, 9, 0), (127, 2, 0), (130, 33, 0), (600, 140, 0), (400, 20, 7)):
        tree = random_tree(n, 50, random.Random(kp))
        past = pos0 + kp
        ctx = A.TreeVerification(tree, past, flex_compile=False)
        bm = A.flex_block_mask(ctx, kp, kp + n, window, pos0, torch.device("cpu"))
        qpad = -(-n // B) * B
        vis = _dense_mask_mod(bm, qpad, kp + n)
        num, idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
        fnum, fidx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
        for qb in range(qpad // B):
            partial = set(idx[qb, : num[qb]].tolist())
            full = set(fidx[qb, : fnum[qb]].tolist())
            assert not partial & full
            rows = vis[qb * B: (qb + 1) * B]
            for kb in range(-(-(kp + n) // B)):
                blk = rows[:, kb * B: (kb + 1) * B]
                if blk.any():
                    assert kb in partial | full, (kp, n, qb, kb)
                if kb in full:
                    assert blk.all(), (kp, n, qb, kb)


@pytest.mark.parametrize("window", [None, 4, 150])
def test_flex_equals_dense_reference(window):
    fn = A.split_attention("flex_attention")
    for seed, (kp, n, pos0, heads) in enumerate(((5, 9, 0, (4, 2)), (140, 33, 0, (4, 4)), (300, 70, 3, (8, 1)))):
        tree = random_tree(n, 50, random.Random(seed))
        past = pos0 + kp
        q, k, v = _inputs(*heads, kp, n, seed)
        with A.tree_verification(tree, past, flex_compile=False):
            out, _ = fn(_module(), q, k, v, None, scaling=D ** -0.5, sliding_window=window)
        torch.testing.assert_close(out.double(), reference(q, k, v, tree, past, pos0, window, D ** -0.5),
                                   atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_flex_reuses_one_kernel_across_rounds(request):
    """Compiled flex (CPU inductor, ~30 s): right, and after the key length turns symbolic no recompile per round."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    fn = A.split_attention("flex_attention")
    graphs = []
    torch._dynamo.reset()  # dynamo's automatic-dynamic record is per code object: leave none behind either
    request.addfinalizer(torch._dynamo.reset)
    for seed, (kp, n) in enumerate(((40, 9), (57, 17), (300, 33), (301, 100), (700, 120), (1500, 64))):
        tree = random_tree(n, 50, random.Random(seed))  # every n here pads to one 128-query bucket
        q, k, v = _inputs(4, 2, kp, n, seed)
        with A.tree_verification(tree, kp, flex_compile=True):
            out, _ = fn(_module(), q, k, v, None, scaling=D ** -0.5)
        torch.testing.assert_close(out.double(), reference(q, k, v, tree, kp, 0, None, D ** -0.5), atol=1e-5, rtol=0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[2], graphs  # rounds 4-6 (new lengths, new trees) reuse the compiled kernel


# --------------------------------------------------------------------------- through the engine


def _prompts(vocab, lengths=(3, 17)):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


@pytest.mark.parametrize("model_type,attn", [("qwen3", "sdpa"), ("llama", "eager")])
def test_split_and_dense_generation_equal_hf_greedy(model_type, attn, monkeypatch):
    vocab = 12  # random drafts are accepted several deep
    target = tiny_model(model_type, seed=3, attn_implementation=attn, vocab_size=vocab)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=1, attn_implementation=attn)
    for ids in _prompts(vocab):
        ref = hf_greedy(target, ids, 20)
        for mode in ("split", "dense", "auto"):
            for budget in (3, 40):
                res = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=20,
                                      tree_attention=mode)
                assert res.output_ids == ref, (mode, budget)
    assert target.config._attn_implementation == attn  # each one-shot generate() put the model back
    # under split no dense mask is ever built
    monkeypatch.setattr("ddtree.engine.target.tree_attention_mask", lambda *a, **k: pytest.fail("dense mask built"))
    res = ddtree.generate(target, None, ids, max_new_tokens=20, proposer=ScriptedProposer(ref, vocab, seed=0),
                          tree_attention="split")
    assert res.output_ids == ref and max(res.acceptance_lengths) >= 4


def test_sliding_window_target_is_lossless():
    """Sliding layers keep full history in the session; the split attention applies each node's window."""
    vocab = 16
    target = tiny_model("qwen3", seed=5, attn_implementation="sdpa", vocab_size=vocab, use_sliding_window=True,
                        sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    assert any(t == "sliding_attention" for t in target.config.layer_types)
    for ids in _prompts(vocab, (2, 13)):
        ref = hf_greedy(target, ids, 24)
        for seed in range(2):
            res = ddtree.generate(target, None, ids, max_new_tokens=24,
                                  proposer=ScriptedProposer(ref, vocab, seed=seed))
            assert res.output_ids == ref
            assert max(res.acceptance_lengths) > 4  # trees deeper than the window


@pytest.mark.slow
def test_flex_target_is_lossless():
    """flex_attention target through the engine (~30 s here: transformers compiles its own flex prefill path)."""
    vocab = 12
    target = tiny_model("qwen3", seed=3, attn_implementation="sdpa", vocab_size=vocab, num_hidden_layers=2)
    ids = _prompts(vocab, (5,))[0]
    ref = hf_greedy(target, ids, 14)
    target.set_attn_implementation("flex_attention")
    with ddtree.Engine(target, None, proposer=ScriptedProposer(ref, vocab, seed=3)) as engine:
        assert target.config._attn_implementation == "ddtree_flex"  # the tree implementation wrapping flex
        res = engine.generate(ids, max_new_tokens=14)
    assert res.output_ids == ref and max(res.acceptance_lengths) >= 3
    assert target.config._attn_implementation == "flex_attention"  # put back when the engine closes


def test_one_host_read_per_round():
    """A DDTree round reads the device once (the walk); prefill and the first token add one more.

    The tree is built and walked as on a GPU (torch ops on the device: the engine option device_path="host_tree"); a
    CPU's default C build and walk read the drafter's top-k and the target's choices on purpose (there it is no
    transfer)."""
    from ddtree.testing.dispatch import DispatchCount

    vocab = 12
    target = tiny_model("qwen3", seed=3, attn_implementation="sdpa", vocab_size=vocab, num_hidden_layers=2)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=1)
    ids = _prompts(vocab, (6,))[0]
    ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=4, device_path="host_tree")
    for record in (False, True):  # the per-round diagnosis records: one read at the end of the generation
        with DispatchCount() as c:
            res = ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=24, record=record,
                                  device_path="host_tree")
        assert c.total(c.syncs, exclude=()) == res.rounds + 1 + record, dict(c.sync_names)


def test_walk_reads_once_and_matches_the_path():
    tree = random_tree(40, 6, random.Random(2))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        choice = torch.randint(0, 6, (40,), generator=g)
        w = walk(tree, choice)
        par, tok = tree.parents.tolist(), tree.tokens.tolist()
        assert w.path_list == w.path.tolist() and w.path_list[0] == 0
        for a, b in zip(w.path_list, w.path_list[1:], strict=False):
            assert par[b] == a and tok[b] == int(choice[a])
        end = w.path_list[-1]
        assert all(not (par[j] == end and tok[j] == int(choice[end])) for j in range(40))  # no consistent child
        assert w.tokens == [tok[j] for j in w.path_list[1:]] + [int(choice[end])]
    chain = chain_tree(torch.tensor(1), torch.tensor([2, 3, 4]))
    w = walk(chain, torch.tensor([2, 3, 0, 0]))
    assert w.path_list == [0, 1, 2] and w.tokens == [2, 3, 0]


def test_config_accepts_every_registered_tree_implementation():
    """Validation reads the engine's table (one source): each split name is a valid target backend for a tree."""
    for name, base in A.SPLIT_IMPLEMENTATIONS.items():
        if base in V.ATTENTION_PACKAGES:
            continue  # needs a CUDA package: refused on this machine for that reason, tested in test_config
        V.check_attention("attention.target", name, method="ddtree", for_target=True, device="cpu", dtype="float32")


def test_hybrid_target_split_and_dense_equal_hf_greedy():
    """qwen3_5_text (GDN + attention): split attention composes with ddtree.engine.gdn verification hook."""
    vocab = 12
    target = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=vocab)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=2)
    for ids in _prompts(vocab):
        ref = hf_greedy(target, ids, 16)
        for mode in ("split", "dense", "auto"):
            res = ddtree.generate(target, drafter, ids, method="ddtree", budget=24, max_new_tokens=16,
                                  tree_attention=mode)
            assert res.output_ids == ref, mode


def test_softcapped_sliding_target_dflash_lossless_and_ddtree_refused():
    """Gemma 2 (sliding layers, soft-capped logits): chains roll back exactly; trees are refused with a fix."""
    target = tiny_model("gemma2", seed=1, attn_implementation="eager", vocab_size=64, sliding_window=4)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, attn_implementation="eager")
    ids = _prompts(64, (9,))[0]
    assert ddtree.generate(target, drafter, ids, method="dflash", max_new_tokens=16).output_ids == \
        hf_greedy(target, ids, 16)
    with pytest.raises(ddtree.ConfigError, match="method=dflash"):
        ddtree.generate(target, drafter, ids, method="ddtree", max_new_tokens=4)


def test_auto_dense_mask_buffer_equals_a_fresh_mask_every_round():
    """auto on CPU keeps one mask buffer across rounds; each round's view equals the mask built from scratch."""
    from ddtree.engine.target import TargetSession
    from ddtree.engine.tree import tree_attention_mask

    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=16)
    session = TargetSession(target, tree_attention="auto", capacity=8)  # short: the buffer must grow
    assert session.dense_auto
    session.prefill(torch.tensor([[1, 2, 3]]))
    rng = random.Random(4)
    for n in (9, 3, 17, 17, 5, 30):
        tree = random_tree(n, 16, rng)
        mask = session._dense_mask(tree)
        assert torch.equal(mask, tree_attention_mask(tree, session.length, target.dtype))
        session.length += rng.randint(1, 4)  # a commit of some accepted tokens


def test_auto_uses_split_where_dense_would_be_wrong_or_costly():
    from ddtree.engine.target import TargetSession

    sliding = tiny_model("qwen3", seed=5, attn_implementation="sdpa", vocab_size=16, use_sliding_window=True,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    assert not TargetSession(sliding, tree_attention="auto").dense_auto
    assert TargetSession(tiny_model("qwen3", seed=0, attn_implementation="sdpa"), tree_attention="auto").dense_auto
