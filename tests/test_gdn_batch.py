"""The tree-exact GDN over a batch of streams (a BatchTree in one forward, ddtree.engine.gdn; the batched commit)
against each stream alone.

Reference for every check: per stream, the single-stream TargetSession (prefill, verify of the stream's own tree,
commit of its path), whose verification tests/test_gdn_tree.py holds to per-path sequential forwards. The batched
forward is stood up here by hand as the batched session drives it: the prefilled caches stacked into one cache of
N rows (attention rows concatenated, GDN states seated with copy_linear_states), a 4-D additive mask per stream,
positions = committed length + depth. Tiny hybrids keep ddtree.tiny's slow GDN decay so the state carries memory.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ddtree.engine import gdn
from ddtree.engine.batch_tree import BatchTree
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import DraftTree
from ddtree.engine.verification import tree_verification
from ddtree.tiny import tiny_model

VOCAB = 96
PROMPT = 9
TOL = 1e-4  # fp32 logits (as tests/test_gdn_tree.py)
STATE_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def patched():
    """The GDN patch installed (a TargetSession holds it itself; a test without one installs it here)."""
    was_installed = gdn.is_installed()
    gdn.install()
    yield
    if not was_installed:
        gdn.uninstall()


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, attn_implementation="sdpa", vocab_size=VOCAB)


# --------------------------------------------------------------------------- trees


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _ancestors(parents: list[int]) -> list[set[int]]:
    anc: list[set[int]] = []
    for i, p in enumerate(parents):
        anc.append(({i} | anc[p]) if p >= 0 else {i})
    return anc


def _path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _random_tree(n: int, gen: torch.Generator, p_deep: float) -> list[int]:
    parents = [-1]
    for i in range(1, n):
        deep = torch.rand((), generator=gen).item() < p_deep
        parents.append(i - 1 if deep else int(torch.randint(0, i, (), generator=gen)))
    return parents


def _batch_tree(rows: list[tuple[list[int], list[int]]], width: int) -> BatchTree:
    """(parents, tokens) per stream, padded to `width` nodes: a padding node is a child of the root at depth 1 with
    token 0 (BatchTree's layout), built on the host here, independently of the engine."""
    n = len(rows)
    tokens = torch.zeros(n, width, dtype=torch.long)
    parents = torch.zeros(n, width, dtype=torch.long)
    depths = torch.ones(n, width, dtype=torch.long)
    valid = torch.zeros(n, width, dtype=torch.bool)
    ancestors = torch.zeros(n, width, width, dtype=torch.bool)
    for b, (par, tok) in enumerate(rows):
        size = len(par)
        full = par + [0] * (width - size)
        tokens[b, :size] = torch.tensor(tok)
        parents[b] = torch.tensor(full)
        depths[b, :size] = torch.tensor(_depths(par))
        valid[b, :size] = True
        for i, anc in enumerate(_ancestors(full)):
            ancestors[b, i, sorted(anc)] = True
    depths[:, 0] = 0
    return BatchTree(tokens, parents, depths, valid, torch.tensor([len(p) for p, _ in rows]), ancestors,
                     depth_bound=int(depths.max()))


def _draft_tree(parents: list[int], tokens: list[int]) -> DraftTree:
    depth = _depths(parents)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth),
                     is_chain=parents == [-1, *range(len(parents) - 1)], depth_bound=max(depth))


# --------------------------------------------------------------------------- the batched forward, stood up by hand


class _Batch:
    """N streams in one cache of N rows: attention rows padded to the longest stream (hidden by the mask), GDN states
    seated per slot; each stream's own committed length."""

    def __init__(self, model, sessions: list[TargetSession]):
        self.model = model
        n = len(sessions)
        self.cache = DynamicCache(config=model.config)
        self.lengths = [s.length for s in sessions]
        assert len(set(self.lengths)) == 1, "stand-up: prompts of equal length"
        for i, layer in enumerate(self.cache.layers):
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.update(torch.cat([s.cache.layers[i].keys for s in sessions]),
                             torch.cat([s.cache.layers[i].values for s in sessions]))
        for slot, s in enumerate(sessions):
            gdn.copy_linear_states(s.cache, self.cache, slot, streams=n)

    def _attention_layers(self):
        return [layer for layer in self.cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]

    def verify(self, tree: BatchTree, method: str = "chunk") -> torch.Tensor:
        n, width = tree.tokens.shape
        kv = self._attention_layers()[0].keys.shape[-2]
        visible = torch.zeros(n, width, kv + width, dtype=torch.bool)
        for b in range(n):
            visible[b, :, : self.lengths[b]] = True
        visible[:, :, kv:] = tree.ancestors
        mask = torch.zeros(n, 1, width, kv + width).masked_fill(~visible[:, None], torch.finfo(torch.float32).min)
        pos = torch.tensor(self.lengths)[:, None] + tree.depths
        with torch.inference_mode(), tree_verification(tree, method=method):
            out = self.model(input_ids=tree.tokens, position_ids=pos, cache=self.cache, use_cache=True,
                             attention_mask={"full_attention": mask, "linear_attention": None})
        self.kv, self.width = kv, width
        return out.logits

    def commit(self, paths: list[list[int]]) -> None:
        """Attention rows kept per stream (the test's own bookkeeping), GDN states by commit_linear_states_batch."""
        longest = max(len(p) for p in paths)
        padded = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths])
        lengths = torch.tensor([len(p) for p in paths])
        new = [length + len(p) for length, p in zip(self.lengths, paths, strict=True)]
        for layer in self._attention_layers():
            rows = []
            for b, p in enumerate(paths):
                keep = list(range(self.lengths[b])) + [self.kv + i for i in p]
                keep += [keep[-1]] * (max(new) - len(keep))  # padding rows: hidden by the next mask
                rows.append(torch.tensor(keep))
            index = torch.stack(rows)[:, None, :, None]
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1,
                                                               layer.values.shape[-1]))
        with torch.inference_mode():
            gdn.commit_linear_states_batch(self.cache, padded, lengths)
        self.lengths = new

    def states(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.conv_states[0][b], layer.recurrent_states[0][b]) for layer in self.cache.layers
                if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _states(session: TargetSession) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.conv_states[0][0], layer.recurrent_states[0][0]) for layer in session.cache.layers
            if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _assert_states(batch: _Batch, sessions: list[TargetSession], what: str) -> None:
    for b, s in enumerate(sessions):
        for layer, ((c, r), (rc, rr)) in enumerate(zip(batch.states(b), _states(s), strict=True)):
            err = max((c.float() - rc.float()).abs().max().item(), (r.float() - rr.float()).abs().max().item())
            assert err <= STATE_TOL, f"{what}: stream {b}, GDN layer {layer}: state error {err:.2e}"


@contextlib.contextmanager
def _triton_kernels(calls: dict[str, int]):
    """The GDN layer's fused ops run by their Triton kernels (Triton's interpreter on a CPU), counted in `calls`."""
    from ddtree.engine.kernels import FusedOp
    from ddtree.engine.kernels import gdn as kernels

    real = {name: getattr(kernels, name) for name in calls}
    for name in calls:
        def run(*args, _op=FusedOp.registry[f"gdn_{name}"], _name=name):
            calls[_name] += 1
            return _op.run_triton(*args)
        setattr(kernels, name, run)
    try:
        yield
    finally:
        for name, op in real.items():
            setattr(kernels, name, op)


def _run_rounds(model_type: str, method: str, rounds: list[list[tuple[list[int], list[int], list[int]]]],
                width_extra: int = 0, seed: int = 0, batch_context=contextlib.nullcontext) -> None:
    """rounds: per round, per stream (parents, tokens, accepted path). Every stream's valid logits and committed
    states against its own TargetSession. batch_context: entered around the batched forward only."""
    model = _model(model_type)
    gen = torch.Generator().manual_seed(seed)
    n = len(rounds[0])
    sessions = [TargetSession(model) for _ in range(n)]
    for s in sessions:
        s.prefill(torch.randint(0, VOCAB, (1, PROMPT), generator=gen))
    batch = _Batch(model, sessions)
    for r, streams in enumerate(rounds):
        width = max(len(p) for p, _, _ in streams) + width_extra
        tree = _batch_tree([(p, t) for p, t, _ in streams], width)
        with batch_context():
            logits = batch.verify(tree, method)
        for b, (s, (parents, tokens, path)) in enumerate(zip(sessions, streams, strict=True)):
            draft = _draft_tree(parents, tokens)
            ref = s.verify(draft)[0]
            err = (logits[b, : len(parents)] - ref).abs().max().item()
            assert err <= TOL, f"{model_type}/{method} round {r} stream {b}: logit error {err:.2e}"
            s.commit(draft, torch.tensor(path))
        batch.commit([path for _, _, path in streams])
        _assert_states(batch, sessions, f"{model_type}/{method} round {r}")


def _tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=gen).tolist()


def _three_streams(seed: int) -> list[list[tuple[list[int], list[int], list[int]]]]:
    """Three rounds of three streams of different shapes: a bushy tree, a chain deeper than the conv kernel, a lone
    root (all padding); then a deep tree, a wide one, a chain, paths of different lengths (the root alone too); then
    roots alone."""
    gen = torch.Generator().manual_seed(seed)
    bushy = _random_tree(12, gen, p_deep=0.3)
    deep = _random_tree(14, gen, p_deep=0.85)
    wide = [-1] + [0] * 6 + [1, 1, 2, 8]
    chain = [-1, *range(6)]
    deepest = max(range(len(deep)), key=lambda i: _depths(deep)[i])
    return [
        [(bushy, _tokens(12, gen), _path_to(bushy, 11)), (chain, _tokens(7, gen), [0, 1, 2, 3, 4, 5]),
         ([-1], _tokens(1, gen), [0])],
        [(deep, _tokens(14, gen), _path_to(deep, deepest)), (wide, _tokens(11, gen), [0]),
         (chain[:5], _tokens(5, gen), [0, 1, 2, 3, 4])],
        [([-1], _tokens(1, gen), [0]) for _ in range(3)],  # a round of roots alone (T = 1: an AR round)
    ]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("method", gdn.METHODS)
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_three_streams_each_equal_their_own_session(model_type, method):
    """N = 3, trees of different shapes and sizes per stream (padding nodes), three rounds: every stream's logits and
    committed GDN states equal its own single-stream session's."""
    _run_rounds(model_type, method, _three_streams(seed=3))


@pytest.mark.slow
def test_the_triton_kernels_over_a_batch_of_streams():
    """The batched forward with the layer's fused ops run by their Triton kernels (what a GPU runs; Triton's
    interpreter here), against each stream's own session on the composites."""
    from ddtree.testing.triton import interpreter

    calls = dict.fromkeys(("decays", "conv", "qk_norm", "delta_rule", "gated_norm"), 0)
    with interpreter() as device:
        if device != "cpu":
            pytest.skip("the stand-up runs on the CPU (a GPU runs the kernels in tests/test_kernels_gdn.py)")
        _run_rounds("qwen3_5_text", "chunk", _three_streams(seed=3)[:1],
                    batch_context=functools.partial(_triton_kernels, calls))
    assert min(calls.values()) >= 3, calls  # every op, every GDN layer


def test_one_stream_with_padding():
    """N = 1: a tree padded by three nodes, a chain next round."""
    gen = torch.Generator().manual_seed(5)
    tree = _random_tree(10, gen, p_deep=0.6)
    rounds = [[(tree, _tokens(10, gen), _path_to(tree, 9))], [([-1, 0, 1, 2], _tokens(4, gen), [0, 1, 2])]]
    _run_rounds("qwen3_5_text", "chunk", rounds, width_extra=3)


def test_a_path_of_length_zero_keeps_its_slot_and_a_free_slot_is_zero():
    """A free slot (zero state, committed with length 0) stays zero; the stream beside it is exact; zero/copy of a
    slot (the lead's seating) move one row only."""
    model = _model("qwen3_5_text")
    gen = torch.Generator().manual_seed(9)
    session = TargetSession(model)
    session.prefill(torch.randint(0, VOCAB, (1, PROMPT), generator=gen))
    other = TargetSession(model)
    other.prefill(torch.randint(0, VOCAB, (1, PROMPT), generator=gen))
    batch = _Batch(model, [session, other])
    with torch.inference_mode():
        gdn.zero_linear_states(batch.cache, 1)
    assert all(not c.any() and not r.any() for c, r in batch.states(1))
    parents = [-1, 0, 1, 0, 3, 4]
    tokens = _tokens(6, gen)
    tree = _batch_tree([(parents, tokens), ([-1], [7])], 6)
    logits = batch.verify(tree)
    draft = _draft_tree(parents, tokens)
    assert (logits[0] - session.verify(draft)[0]).abs().max().item() <= TOL
    session.commit(draft, torch.tensor([0, 3, 4, 5]))
    paths = torch.tensor([[0, 3, 4, 5], [0, 0, 0, 0]])
    with torch.inference_mode():
        gdn.commit_linear_states_batch(batch.cache, paths, torch.tensor([4, 0]))
    assert all(not c.any() and not r.any() for c, r in batch.states(1))
    for (c, r), (rc, rr) in zip(batch.states(0), _states(session), strict=True):
        assert (c - rc).abs().max() <= STATE_TOL and (r - rr).abs().max() <= STATE_TOL
    with torch.inference_mode():  # seat stream 0's committed state in slot 1: both rows the same now
        gdn.copy_linear_states(session.cache, batch.cache, 1)
    for (c0, r0), (c1, r1) in zip(batch.states(0), batch.states(1), strict=True):
        assert (c0 - c1).abs().max() <= STATE_TOL and (r0 - r1).abs().max() <= STATE_TOL
    with torch.inference_mode():  # several slots at once
        gdn.zero_linear_states(batch.cache, torch.tensor([0, 1]))
    assert all(not c.any() and not r.any() for b in (0, 1) for c, r in batch.states(b))


def test_batch_and_single_commits_refuse_each_others_verification():
    model = _model("qwen3_5_text")
    session = TargetSession(model)
    session.prefill(torch.arange(1, PROMPT + 1)[None])
    batch = _Batch(model, [session])
    batch.verify(_batch_tree([([-1, 0], [3, 4])], 2))
    with pytest.raises(RuntimeError, match="commit_linear_states_batch"):
        gdn.commit_linear_states(batch.cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"path \[N, L\]"):
        gdn.commit_linear_states_batch(batch.cache, torch.tensor([0, 1]), torch.tensor([2]))


def test_trees_on_an_empty_cache_of_two_rows(patched):
    """The very first tokens as trees (no state rows yet: zeros): each stream's path logits and committed states
    equal the upstream forward of its path alone on an empty cache."""
    model = _model("qwen3_next")
    gen = torch.Generator().manual_seed(11)
    rows = [([-1, 0, 1, 1, 3, 4, 5], _tokens(7, gen)), ([-1, 0, 0], _tokens(3, gen))]
    paths = [[0, 1, 3, 4, 5, 6], [0, 2]]
    tree = _batch_tree(rows, 7)
    cache = DynamicCache(config=model.config)
    mask = torch.zeros(2, 1, 7, 7).masked_fill(~tree.ancestors[:, None], torch.finfo(torch.float32).min)
    with torch.inference_mode(), tree_verification(tree):
        logits = model(input_ids=tree.tokens, position_ids=tree.depths, cache=cache, use_cache=True,
                       attention_mask={"full_attention": mask, "linear_attention": None}).logits
    with torch.inference_mode():
        gdn.commit_linear_states_batch(cache, torch.tensor([paths[0], paths[1] + [2] * 4]), torch.tensor([6, 2]))
    for b, ((_, tokens), path) in enumerate(zip(rows, paths, strict=True)):
        alone = DynamicCache(config=model.config)
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([tokens])[:, path], cache=alone, use_cache=True).logits[0]
        assert (logits[b, path] - ref).abs().max().item() <= TOL
        for layer, ref_layer in zip(cache.layers, alone.layers, strict=True):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                assert (layer.conv_states[0][b] - ref_layer.conv_states[0][0]).abs().max() <= STATE_TOL
                assert (layer.recurrent_states[0][b] - ref_layer.recurrent_states[0][0]).abs().max() <= STATE_TOL


def _layer_run(model, n: int):
    """(the first GDN layer, a cache of n rows prefilled with one prompt)."""
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.arange(1, PROMPT + 1)[None].expand(n, -1), cache=cache, use_cache=True)
    return layer, cache


def test_ops_per_layer_do_not_grow_with_the_streams(patched):
    """The batched layer dispatches the same ops at 1, 2 and 5 streams (no loop over streams)."""
    from ddtree.testing.dispatch import DispatchCount

    model = _model("qwen3_5_text")
    counts = []
    for n in (1, 2, 5):
        tree = _batch_tree([([-1, 0, 1, 0, 3, 1], [1, 2, 3, 4, 5, 6])] + [([-1, 0, 1], [7, 8, 9])] * (n - 1), 8)
        hidden = torch.randn(n, 8, model.config.hidden_size)
        with torch.inference_mode():
            layer, cache = _layer_run(model, n)
            with tree_verification(tree):
                layer(hidden, cache=cache)  # (the round's metadata, the cache's constants and buffers)
                counter = DispatchCount(stages=False, decompose=True)
                with counter:
                    layer(hidden, cache=cache)
        counts.append(counter.total(counter.ops, exclude=()))
    assert counts[0] == counts[1] == counts[2], counts


def test_the_batched_layer_compiles_without_graph_breaks():
    """tree_layer over a batch's TreeMeta is one graph (the compiled round's fixed-shape slots), equal to eager."""
    from torch._dynamo.utils import counters

    model = _model("qwen3_5_text")
    tree = _batch_tree([([-1, 0, 1, 0, 3, 1], [1, 2, 3, 4, 5, 6]), ([-1, 0, 1, 2], [1, 2, 3, 4]), ([-1], [5])], 6)
    hidden = torch.randn(3, 6, model.config.hidden_size)
    with torch.no_grad():
        layer, cache = _layer_run(model, 3)
        conv, state = cache.get_conv_state(layer.layer_idx, 0), cache.get_recurrent_state(layer.layer_idx, 0)
        with tree_verification(tree) as ctx:
            meta = gdn.tree_meta(ctx, layer.conv_kernel_size, hidden.device)
        consts = gdn.layer_consts(layer)
        channels = layer.conv1d.weight.shape[0]
        eager_bufs = gdn.new_buffers(layer, hidden, consts, channels)
        want = gdn.tree_layer(layer, hidden, conv, state, meta, consts, eager_bufs)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(gdn.tree_layer, fullgraph=True, backend="eager")
        bufs = gdn.new_buffers(layer, hidden, consts, channels)
        bufs.table = None  # (as the compiled round's buffers)
        got = compiled(layer, hidden, conv, state, meta, consts, bufs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bufs.deltas, eager_bufs.deltas, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
