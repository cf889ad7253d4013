"""No process-global surprises from the library: nothing registered or patched at import, the allocator tuned
only when asked, and `Engine.close()` giving the user's model back as it was (state, implementation, outputs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ddtree
from ddtree.engine import gdn
from ddtree.engine.drafter import DFlashDrafter
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model


def test_importing_the_engine_registers_and_patches_nothing():
    code = ("import ddtree, ddtree.engine.attention, ddtree.engine.gdn, compat\n"
            "from transformers import AttentionInterface\n"
            "names = [k for k in AttentionInterface._global_mapping if k.startswith('ddtree')]\n"
            "assert not names, names\nassert not compat.report(), compat.report()\nprint('clean')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]


def _snapshot(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    forwards = {name: m.__dict__.get("_old_forward") for name, m in model.named_modules()}
    return (model.config._attn_implementation, {k: v.clone() for k, v in model.state_dict().items()}, logits,
            forwards)


@pytest.mark.parametrize(("model_type", "attn"), [("qwen3", "sdpa"), ("qwen3_5_text", "eager")])
def test_close_restores_the_model(model_type, attn):
    from accelerate.hooks import ModelHook, add_hook_to_module

    target = tiny_model(model_type, seed=3, attn_implementation=attn, vocab_size=96)
    for m in target.modules():  # as a device map leaves them: modules whose hook keeps their forward
        if type(m).__name__.endswith(("GatedDeltaNet", "Attention")):
            add_hook_to_module(m, ModelHook())
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    before = _snapshot(target, ids)
    with ddtree.Engine(target, drafter, method="ddtree", budget=8) as engine:
        assert target.config._attn_implementation != attn  # switched to the tree implementation wrapping it
        out = engine.generate(ids, max_new_tokens=12).output_ids
    assert out == hf_greedy(target, ids, 12)
    after = _snapshot(target, ids)
    assert after[0] == before[0] == attn
    assert after[1].keys() == before[1].keys() and all(torch.equal(after[1][k], before[1][k]) for k in before[1])
    assert torch.equal(after[2], before[2])
    assert after[3] == before[3]  # the hooked forwards are the ones accelerate saw
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        engine.generate(ids, max_new_tokens=2)


def test_one_shot_generate_leaves_the_model_as_it_found_it():
    """ddtree.generate() is one Engine, closed after its call: the implementation and hooked forwards are put back."""
    target = tiny_model("qwen3_5_text", seed=5, attn_implementation="sdpa", vocab_size=96)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    before = _snapshot(target, ids)
    out = ddtree.generate(target, drafter, ids, method="ddtree", budget=8, max_new_tokens=10).output_ids
    assert out == hf_greedy(target, ids, 10)
    after = _snapshot(target, ids)
    assert after[0] == before[0] == "sdpa" and after[3] == before[3] and torch.equal(after[2], before[2])


def test_another_engine_keeps_working_after_one_closes():
    target = tiny_model("qwen3_5_text", seed=4, attn_implementation="sdpa", vocab_size=96)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=2)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = target(input_ids=ids).logits
    first = ddtree.Engine(target, drafter, method="ddtree", budget=8)
    second = ddtree.Engine(target, drafter, method="dflash")
    first.close()
    import compat

    compat.revert()  # the GDN row taken away too: the next generation applies it again
    assert second.generate(ids, max_new_tokens=10).output_ids == hf_greedy(target, ids, 10)
    assert gdn.is_installed()
    second.close()  # bound after the first switch, it leaves the tree implementation: plain sdpa outside a tree
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, plain)
