"""upstream-gdn-tree: the authors' DDTree / DFlash loops on hybrid GDN targets equal greedy decoding.

Runs on tests/compat_fixtures/upstream_checkout, a stand-in written in the shape of their ddtree.py /
dflash.py (same functions, signatures, 4.x call style and cache compaction), on a tiny slow-decay
Qwen3.5 hybrid. The drafter is an oracle that ranks the target's true token second at every third
position, so trees branch and their accepted paths leave the flat order: a GDN verified or rolled
back naively would go wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import copy_checkout

import compat
from compat.patches import upstream_gdn_tree
from ddtree.engine import gdn as tree_gdn
from ddtree.tiny import tiny_model
from ddtree.upstream.loader import load_upstream

STAND_IN = Path(__file__).resolve().parent / "compat_fixtures" / "upstream_checkout"
PROMPT, NEW, BLOCK = 8, 20, 5


pytestmark = pytest.mark.usefixtures("clean_compat")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return copy_checkout("upstream_checkout", tmp_path)


@pytest.fixture(scope="module")
def hybrid():
    # vocab < hidden size: the oracle can make the drafter's logits anything it wants
    return tiny_model("qwen3_5_text", seed=1, attn_implementation="sdpa", vocab_size=48)


class OracleDrafter(torch.nn.Module):
    """Their drafter interface; drafts `sequence`, but ranks the truth second at every third position."""

    def __init__(self, target, sequence: list[int]):
        super().__init__()
        self.sequence, self.target_layer_ids = sequence, [1]
        self.register_buffer("pinv", torch.linalg.pinv(target.lm_head.weight.detach()))

    @property
    def device(self):
        return self.pinv.device

    def forward(self, target_hidden, noise_embedding, position_ids, past_key_values=None, **kwargs):
        rows = []
        for p in position_ids[0, -noise_embedding.shape[1]:].tolist():
            truth = self.sequence[p] if p < len(self.sequence) else 0
            logits = torch.full((self.pinv.shape[1],), -4.0)
            logits[truth] = 3.0
            logits[(truth + 1) % 40 if p % 3 == 0 else truth] = 4.0
            rows.append(self.pinv @ logits)
        return torch.stack(rows)[None]


def greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, target(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0].tolist()


def _run(up, target, seed: int, method: str):
    ids = torch.randint(0, 40, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    full = greedy(target, ids, NEW + BLOCK)
    mask = next(t for t in range(47, 0, -1) if t not in full)  # their output filter drops the mask id
    fn = up.ddtree_generate if method == "ddtree" else up.dflash_generate
    kw = {"tree_budget": 10} if method == "ddtree" else {}
    out = fn(model=OracleDrafter(target, full), target=target, input_ids=ids, mask_token_id=mask,
             max_new_tokens=NEW, block_size=BLOCK, stop_token_ids=None, temperature=0.0, **kw)
    return out, full[PROMPT : PROMPT + NEW]


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_upstream_gdn_tree_hybrid_equals_greedy(checkout, hybrid, method):
    up = load_upstream(checkout)
    statuses = {e["id"]: e["status"] for e in up.patches}
    assert statuses["upstream-gdn-tree"] == "applied" and "gdn-tree-verify" not in statuses
    for seed in range(2):
        out, expected = _run(up, hybrid, seed, method)
        assert out.output_ids[0, PROMPT:].tolist() == expected, (method, seed, out.acceptance_lengths)
        assert max(out.acceptance_lengths) >= (BLOCK if method == "ddtree" else 3)  # deep, branching acceptance
    # nothing of the call is left on the target
    assert not hybrid._forward_pre_hooks and not hybrid._forward_hooks
    assert upstream_gdn_tree._SESSION.get() is None


def test_upstream_gdn_tree_control_without_the_patch(checkout, hybrid):
    up = load_upstream(checkout, skip=["upstream-gdn-tree"])
    with pytest.raises(RuntimeError, match="does not track past states"):  # a recurrent state cannot be cropped
        _run(up, hybrid, 0, "ddtree")


def test_upstream_gdn_tree_gets_the_engine_gdn_from_the_loader(checkout, hybrid):
    """compat may not import the engine: without the loader's provider the row is skipped-absent."""
    statuses = {e["id"]: e["status"] for e in compat.apply(engine="upstream")}
    assert statuses["upstream-gdn-tree"] == "skipped-absent"
    assert upstream_gdn_tree.VERSIONS == tree_gdn.VERSIONS  # the row's gate is the engine GDN's verified range
    was_installed = tree_gdn.is_installed()
    tree_gdn.uninstall()  # the native engine installs it for itself; their loop must install it too
    try:
        up = load_upstream(checkout)  # the provider handed over: the row applies
        assert {e["id"]: e["status"] for e in up.patches}["upstream-gdn-tree"] == "applied"
        out, expected = _run(up, hybrid, 0, "dflash")
        assert out.output_ids[0, PROMPT:].tolist() == expected and tree_gdn.is_installed()
    finally:
        if not was_installed:
            tree_gdn.uninstall()


def _patched(fn) -> bool:
    return getattr(fn, "_self_compat_patch", None) == "upstream-gdn-tree"


def test_upstream_gdn_tree_wraps_their_functions_and_reverts(checkout):
    up = load_upstream(checkout)
    entry = next(e for e in up.patches if e["id"] == "upstream-gdn-tree")
    assert entry["status"] == "applied" and "_ddtree_upstream.ddtree" in entry["detail"]
    names = ("ddtree_generate", "build_ddtree_tree", "compact_dynamic_cache", "dflash_generate")
    assert all(_patched(getattr(up.ddtree, n)) for n in names)
    assert up.ddtree.dflash_generate is up.dflash.dflash_generate  # their `from dflash import` copy
    compat.revert()
    assert not any(_patched(getattr(up.ddtree, n)) for n in names) and not _patched(up.dflash.dflash_generate)
    assert up.ddtree.dflash_generate is up.dflash.dflash_generate


def test_upstream_gdn_tree_leaves_pure_attention_targets_alone(checkout):
    up = load_upstream(checkout)
    target = tiny_model("qwen3", seed=1, attn_implementation="sdpa", vocab_size=48)
    assert not upstream_gdn_tree.gdn_hybrid(target, tree_gdn)
    out, expected = _run(up, target, 0, "ddtree")
    assert out.output_ids[0, PROMPT:].tolist() == expected
