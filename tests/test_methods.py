"""Every method with a real (random) DFlash drafter reproduces HF greedy decoding exactly."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.output_check import Validator
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

CASES = [(t, a) for t in ("qwen3", "llama") for a in ("eager", "sdpa")]
# the fast suite: both families, both attentions, both vocabularies; the rest of the grid in make test-slow
FAST = {(12, "qwen3", "eager"), (96, "llama", "sdpa")}
GRID = [pytest.param(v, t, a, marks=() if (v, t, a) in FAST else pytest.mark.slow) for v in (96, 12) for t, a in CASES]


def _prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (1, 6, 19)]


@pytest.mark.parametrize("vocab,model_type,attn", GRID)
def test_all_methods_equal_hf_greedy(model_type, attn, vocab):
    target = tiny_model(model_type, seed=2, attn_implementation=attn, vocab_size=vocab)
    drafters = {bs: DFlashDrafter.random_for_target(target.config, block_size=bs, seed=bs, num_layers=1,
                                                    attn_implementation=attn) for bs in (2, 4, 16)}
    new = 20
    deepest = 0
    validator = Validator(target, max_new_tokens=new)  # fp32: every verdict is exact
    for ids in _prompts(vocab):
        ref = hf_greedy(target, ids, new)
        ref_check, _ = validator.check(ids, ref)
        assert ref_check.ok
        for bs, drafter in drafters.items():
            res = ddtree.generate(target, drafter, ids, method="dflash", max_new_tokens=new)
            assert res.output_ids == ref, f"dflash block {bs}"
            assert validator.verdict(ids, res.output_ids, ref, ref_check).verdict == "exact"
            for budget in (1, 2, 7, 64):
                res = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=new)
                assert res.output_ids == ref, f"ddtree block {bs} budget {budget}"
                assert validator.verdict(ids, res.output_ids, ref, ref_check).verdict == "exact"
                deepest = max(deepest, max(res.acceptance_lengths))
    if vocab == 12:
        assert deepest >= 3  # small vocabulary: random drafts are accepted more than one deep


def test_method_table_checks_what_each_method_reads():
    """One table decides: the drafter it needs, the budget it reads (only DDTree), the block size it drafts."""
    from ddtree.engine.methods import METHODS, check_method_args
    from ddtree.errors import ConfigError

    assert [m for m in METHODS if METHODS[m].verifies_tree] == ["ddtree", "mtp", "eagle3"]  # a tree when topk > 1
    check_method_args("ar", has_drafter=False, budget=0, block_size=1)  # AR reads neither
    check_method_args("dflash", has_drafter=True, budget=0, block_size=None)
    refused = [("ddtree", False, 64, None, "drafter"), ("dflash", False, None, None, "drafter"),
               ("ddtree", True, 0, None, "budget"), ("dflash", True, None, 1, "drafter.block_size"),
               ("medusa", True, 64, None, "method")]
    for name, has, budget, block, setting in refused:
        with pytest.raises(ConfigError) as e:
            check_method_args(name, has_drafter=has, budget=budget, block_size=block)
        assert e.value.setting == setting and e.value.fix


def test_the_table_is_uniform_and_agrees_with_its_proposers():
    """Every row's make_proposer takes (target, drafter, DraftSettings); compilable and the drafter kind agree with
    the proposer class it builds; reads_budget is one rule (MTP's chain ignores the budget, its tree reads it)."""
    import inspect

    from ddtree.engine import methods as M
    from ddtree.engine import proposers as P
    from ddtree.engine.drafter.eagle3 import Eagle3Proposer

    built = {"ar": P.ARProposer, "dflash": P.DFlashProposer, "ddtree": P.DDTreeProposer, "mtp": P.MTPProposer,
             "eagle3": Eagle3Proposer}
    assert set(built) == set(M.METHODS)
    for name, m in M.METHODS.items():
        assert list(inspect.signature(m.make_proposer).parameters) == ["target", "drafter", "s"], name
        assert m.compilable == built[name].compilable, name
        assert (m.drafter_kind == M.DFLASH) == issubclass(built[name], P.DrafterBlock), name
    assert M.COMPILABLE_METHOD_NAMES == M.METHOD_NAMES
    assert [M.reads_budget(n) for n in ("ar", "dflash", "ddtree")] == [False, False, True]
    assert not M.reads_budget("mtp", 1) and M.reads_budget("mtp", 2) and not M.reads_budget("nope")
    assert not M.reads_budget("eagle3", 1) and M.reads_budget("eagle3", 2)
