"""Engine options are resolved once per Engine (ddtree.engine.options): two engines in one process with different
options each take the path they were built for, call after call, and each still equals HF greedy decoding."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine import host, tree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.options import EngineOptions, current, scoped
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model


def test_two_engines_with_different_options_each_take_their_own_path(monkeypatch):
    """One engine on the CPU's host branches, one on a CUDA run's path (device_path=True), generate calls
    interleaved: the C tree build runs in the first engine's calls only (counted), and both outputs equal HF
    greedy. The environment (DDTREE_DEVICE_PATH set after they are built) changes neither."""
    built = []
    real = tree._best_first_host
    monkeypatch.setattr(tree, "_best_first_host", lambda *a, **k: built.append(1) or real(*a, **k))
    model = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12)
    drafter = DFlashDrafter.random_for_target(model.config, block_size=8, seed=3)
    ids = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(1))
    want = hf_greedy(model, ids, 14)
    cpu = ddtree.Engine(model, drafter, method="ddtree", budget=24)
    gpu_like = ddtree.Engine(model, drafter, method="ddtree", budget=24, device_path=True)
    assert cpu.options.device_path == frozenset() and gpu_like.options.device_path == frozenset(host.HOST_BRANCHES)
    monkeypatch.setenv("DDTREE_DEVICE_PATH", "1")  # read when an engine is built, not by one already built
    for engine, takes_host_tree in ((cpu, True), (gpu_like, False), (cpu, True), (gpu_like, False)):
        built.clear()
        out = engine.generate(ids, max_new_tokens=14).output_ids
        assert out == want
        assert bool(built) == takes_host_tree, (engine.options, len(built))
    assert EngineOptions.resolve().device_path == frozenset(host.HOST_BRANCHES)  # a new engine's: the environment's
    cpu.close(), gpu_like.close()


def test_options_fall_back_to_the_scope_then_the_environment(monkeypatch):
    for k in ("DDTREE_DEVICE_PATH", "DDTREE_KERNELS", "DDTREE_FLEX_COMPILE", "DDTREE_COMPILE", "DDTREE_COMPILE_BACKEND",
              "DDTREE_HOST_MALLOC"):
        monkeypatch.delenv(k, raising=False)
    assert current() == EngineOptions() == EngineOptions.resolve()
    monkeypatch.setenv("DDTREE_KERNELS", "composite")
    monkeypatch.setenv("DDTREE_COMPILE", "0")
    monkeypatch.setenv("DDTREE_DEVICE_PATH", "host_tree")
    monkeypatch.setenv("DDTREE_FLEX_COMPILE", "1")
    env = EngineOptions.resolve()
    assert (env.kernels, env.auto_compile, env.device_path, env.flex_compile) == ("composite", False,
                                                                                 {"host_tree"}, True)
    assert current() == EngineOptions()  # outside a scope: the library's defaults; the environment is read by resolve
    with host.device_path("gdn_step"):
        inner = EngineOptions.resolve(kernels="strict")
    assert inner.device_path == {"host_tree", "gdn_step"} and inner.kernels == "strict"
    assert EngineOptions.resolve(device_path=False).device_path == frozenset()  # an argument beats the environment
    with pytest.raises(ValueError, match="device_path: unknown branch"):
        EngineOptions.resolve(device_path="nonsense")
    with pytest.raises(ValueError, match="kernels='fast'"):
        EngineOptions.resolve(kernels="fast")


def test_closing_the_last_engine_restores_the_gdn_classes():
    """The GDN class patch is held by each engine on a hybrid: it stays while one is open and the classes get their
    own forwards back when the last one closes (or when a one-call generate returns); a patch installed before the
    first engine (someone else's) is left in place."""
    import gc

    from ddtree.engine import gdn

    gc.collect()  # bindings other tests left behind let go when collected
    assert gdn.holders() == 0
    if gdn.is_installed():
        gdn.uninstall()
    originals = {cls: cls.__dict__["forward"] for cls in gdn.target_classes()}
    assert originals
    model = tiny_model("qwen3_5_text", seed=6, attn_implementation="sdpa", vocab_size=12)
    ids = torch.randint(0, 12, (1, 5), generator=torch.Generator().manual_seed(1))
    first = ddtree.Engine(model, method="ar", budget=None)
    second = ddtree.Engine(model, method="ar", budget=None)
    assert gdn.is_installed() and gdn.holders() == 2
    assert all(cls.__dict__["forward"] is not f for cls, f in originals.items())
    first.close()
    first.close()  # idempotent: one release per engine
    assert gdn.is_installed() and gdn.holders() == 1
    assert second.generate(ids, max_new_tokens=3).output_ids == hf_greedy(model, ids, 3)
    second.close()
    assert not gdn.is_installed() and gdn.holders() == 0
    assert all(cls.__dict__["forward"] is f for cls, f in originals.items())
    ddtree.generate(model, None, ids, method="ar", budget=None, max_new_tokens=2)
    assert not gdn.is_installed()
    gdn.install()  # installed by someone else first: theirs to undo
    with ddtree.Engine(model, method="ar", budget=None):
        pass
    assert gdn.is_installed()
    gdn.uninstall()


def test_the_environment_is_read_once_where_the_options_are_resolved(monkeypatch):
    """DDTREE_HOST_MALLOC=0 (which overrides a setting that asks) is read with the other variables, when the options
    are resolved, not again when the allocator is set up; `ddtree.generate()` takes the same options as `Engine`."""
    monkeypatch.setenv("DDTREE_HOST_MALLOC", "0")
    off = EngineOptions.resolve(tune_host_allocator=True)
    assert off.tune_host_allocator and off.host_malloc_off
    monkeypatch.setenv("DDTREE_HOST_MALLOC", "1")  # later changes do not reach resolved options
    assert not host.allocator_wanted(off)
    assert host.allocator_wanted(EngineOptions.resolve()) and not host.allocator_wanted(EngineOptions())
    with scoped(off):  # a scope's options are what a new engine resolves from, the environment not read again
        assert EngineOptions.resolve() == off
    model = tiny_model("qwen3", seed=2, vocab_size=12)
    drafter = DFlashDrafter.random_for_target(model.config, block_size=4, seed=1)
    ids = torch.randint(0, 12, (1, 5), generator=torch.Generator().manual_seed(0))
    got = ddtree.generate(model, drafter, ids, method="ddtree", budget=8, max_new_tokens=6, device_path=True,
                          kernels="composite", tune_host_allocator=False)
    assert got.output_ids == hf_greedy(model, ids, 6)
    with pytest.raises(ValueError, match="kernels='fast'"):
        ddtree.generate(model, drafter, ids, method="ddtree", budget=8, max_new_tokens=6, kernels="fast")


def test_options_are_passed_to_what_an_engine_builds_and_its_kernel_checks_are_its_own():
    """An Engine hands its resolved options to its target binding and its proposer (no read back from a scope), and
    holds its own fused-op checks (ddtree.engine.kernels.KernelChecks), entered around its calls: two engines with
    kernels=auto and kernels=strict each run under theirs, call after call, outputs equal to HF greedy."""
    from ddtree.engine import kernels
    from ddtree.engine.proposers import ARProposer

    seen = []

    class Recording(ARProposer):
        def propose(self, state):
            seen.append(kernels.active())
            return super().propose(state)

    model = tiny_model("qwen3", seed=2, vocab_size=12)
    drafter = DFlashDrafter.random_for_target(model.config, block_size=4, seed=1)
    ids = torch.randint(0, 12, (1, 5), generator=torch.Generator().manual_seed(0))
    tree_engine = ddtree.Engine(model, drafter, method="ddtree", budget=8, device_path=["host_tree"])
    assert tree_engine.binding.options is tree_engine.options is tree_engine.proposer.options
    tree_engine.close()
    auto = ddtree.Engine(model, method="ar", budget=None, proposer=Recording(), kernels="auto")
    strict = ddtree.Engine(model, method="ar", budget=None, proposer=Recording(), kernels="strict")
    assert (auto.kernel_checks.setting, strict.kernel_checks.setting) == ("auto", "strict")
    want = hf_greedy(model, ids, 4)
    for engine in (auto, strict, auto):
        seen.clear()
        assert engine.generate(ids, max_new_tokens=4).output_ids == want
        assert seen and all(c is engine.kernel_checks for c in seen)
    assert kernels.active() not in (auto.kernel_checks, strict.kernel_checks)  # outside: the process's
    auto.close(), strict.close()


def test_the_engines_arguments_come_in_groups_and_generate_takes_the_same():
    """Engine's keywords: the method's settings (engine.settings, a DraftSettings), how its rounds run, and the options
    (engine.options: an EngineOptions whole, its fields as keywords over it); `ddtree.generate()` takes every one."""
    import dataclasses
    import inspect

    from ddtree.engine.methods import DraftSettings

    engine_args = inspect.signature(ddtree.Engine.__init__).parameters
    assert set(engine_args) - {"self"} <= set(inspect.signature(ddtree.generate).parameters)
    assert all(p.kind is p.KEYWORD_ONLY for name, p in engine_args.items() if name not in ("self", "target", "drafter"))
    assert {f.name for f in dataclasses.fields(DraftSettings)} <= set(engine_args)
    assert {f.name for f in dataclasses.fields(EngineOptions)} - {"host_malloc_off"} <= set(engine_args)
    model = tiny_model("qwen3", seed=2, vocab_size=12)
    drafter = DFlashDrafter.random_for_target(model.config, block_size=4, seed=1)
    ids = torch.randint(0, 12, (1, 5), generator=torch.Generator().manual_seed(0))
    whole = EngineOptions(device_path=frozenset({"host_tree"}), kernels="composite")
    with ddtree.Engine(model, drafter, method="ddtree", budget=8, options=whole, kernels="auto") as engine:
        assert engine.options == dataclasses.replace(whole, kernels="auto")  # a keyword given overrides the whole
        assert (engine.settings.budget, engine.settings.options) == (8, engine.options)
        assert engine.proposer.options is engine.options
    got = ddtree.generate(model, drafter, ids, method="ddtree", budget=8, max_new_tokens=6, options=whole)
    assert got.output_ids == hf_greedy(model, ids, 6)
