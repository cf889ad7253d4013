"""Lossless under any float32 matmul precision a user sets: the tree-exact GDN's decays under TF32.

`torch.set_float32_matmul_precision("high")` (TF32 on a GPU) rounds a float32 matmul's inputs to 10 mantissa bits.
The GDN decays are exponents of differences of path sums of hundreds: rounded before the difference is taken, they
move by ~0.1 (ddtree.engine.gdn's docstring). `ddtree.testing.tf32.TF32` emulates TF32 on the CPU (every float32
mm / bmm / baddbmm / addmm with rounded inputs, a linear layer's included). References: float64 path sums computed
from their definition, the per-path sequential forward, HF greedy decoding in IEEE float32.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import ddtree
from ddtree.engine import gdn as tree_gdn
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.kernels import gdn as kgdn
from ddtree.testing.reference import hf_greedy
from ddtree.testing.tf32 import TF32, rounded
from ddtree.tiny import tiny_model


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_the_emulation_rounds_to_ten_mantissa_bits():
    x = torch.tensor([1.0, 1 + 2 ** -12, 1 + 2 ** -10 + 2 ** -12, 300.07, -300.07])
    assert rounded(x).tolist() == [1.0, 1.0, 1 + 2 ** -10, 300.0, -300.0]
    a, b = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), torch.randn(16, 4)
    with TF32() as mode:
        got = a @ b
    assert mode.calls == 2 and torch.equal(got, rounded(a) @ rounded(b)) and not torch.equal(got, a @ b)


def _chain_decays(n: int, heads: int, gen: torch.Generator):
    """A chain of n nodes (every node its predecessors' descendant) with gates of hundreds: (ab, A, the decay map
    and mask, buffers)."""
    meta = tree_gdn.meta._meta_buffers(n, 4, torch.device("cpu"))
    anc = torch.ones(n, n, dtype=torch.bool).tril_()
    meta.x_ancestors.copy_(anc.t())
    meta.y_ancestors.copy_(anc.t())
    torch.where(anc, meta.zero, meta.hidden, out=meta.mask_tree)
    ab = torch.empty(1, n, 2, heads)
    ab[:, :, 0].uniform_(-300.0, 300.0, generator=gen)  # a + dt: softplus of it 0 .. 300 (forget, or remember)
    ab[:, :, 1].uniform_(-3.0, 3.0, generator=gen)  # -b
    A = torch.rand(heads, generator=gen) + 0.5
    gates = torch.zeros(1, heads, 2 * n + 2)
    gates[..., n], gates[..., 2 * n + 1] = A, 1.0
    return ab, A, anc, meta.decay_map, meta.decay_mask, gates, torch.empty(1, heads, 6 * n + 3), torch.empty(heads, n, n + 1)


def _decays_in_float64(ab, A, anc):
    sp = F.softplus(ab[0, :, 0].double()).t()  # (heads, n)
    log_beta = -F.softplus(ab[0, :, 1].double()).t()
    c = -A.double()[:, None] * (sp[:, None, :] * anc.double()).sum(-1)  # (heads, n): c_i over the path root..i
    inner = torch.where(anc, c[:, :, None] - c[:, None, :] + log_beta[:, None, :], float("-inf"))
    return torch.cat([c[..., None], inner], dim=-1).exp()


def test_decays_under_tf32_equal_ieee_float32():
    gen = torch.Generator().manual_seed(3)
    ab, A, anc, dmap, dmask, gates, xy, decays = _chain_decays(16, 4, gen)
    kgdn.decays(ab, torch.zeros(()), dmap, dmask, gates, xy, decays)
    ieee = decays.clone()
    # (float32: X . Y is a difference of path sums of thousands here, ~1e-4 relative in any float32 order)
    torch.testing.assert_close(ieee.double(), _decays_in_float64(ab, A, anc), rtol=2e-4, atol=1e-30)
    with TF32() as mode:
        kgdn.decays(ab, torch.zeros(()), dmap, dmask, gates, xy, decays)
    assert mode.calls > 0  # the map's matmul ran under the emulation
    assert torch.equal(decays, ieee)  # exact: the split mm and the elementwise exponents are TF32-proof


@functools.cache
def _forgetful_hybrid():
    """A tiny hybrid whose GDN gates are hundreds for some tokens and ~0 for others (forget / remember, A = 1):
    path sums of hundreds whose differences are small."""
    model = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data.zero_()
        if name.endswith("in_proj_a.weight"):
            p.data.mul_(300.0)
    return model


def test_tree_logits_under_tf32_are_the_paths_logits():
    """Tree verification under TF32 equals each path's sequential forward under TF32 to TF32's own noise (~3e-4
    here: the projections' and attention's matmuls); decays rounded before their differences were ~3e-3 off."""
    import test_gdn_tree as T

    model = _forgetful_hybrid()
    tree_gdn.install()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 12, (1, 9), generator=gen)
    cache = T._prefill(model, prompt)
    with TF32():
        for parents in T._trees(seed=2).values():
            tokens = torch.randint(0, 12, (1, len(parents)), generator=gen)
            logits = T._verify(model, copy.deepcopy(cache), tokens, parents, prompt.shape[1])
            assert T._per_path_error(model, cache, tokens, parents, logits) <= 1e-3


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_the_hybrid_is_lossless_under_tf32(method):
    model = _forgetful_hybrid()
    g = torch.Generator().manual_seed(4)
    for bs in (4, 16):
        drafter = DFlashDrafter.random_for_target(model.config, block_size=bs, seed=bs, attn_implementation="sdpa")
        for n in (3, 14):
            ids = torch.randint(0, 12, (1, n), generator=g)
            ref = hf_greedy(model, ids, 16)  # IEEE float32
            with TF32():
                for budget in ((2, 7, 48) if method == "ddtree" else (None,)):
                    got = ddtree.generate(model, drafter, ids, method=method, budget=budget, max_new_tokens=16)
                    assert got.output_ids == ref, (method, bs, n, budget)
