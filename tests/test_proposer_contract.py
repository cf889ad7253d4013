"""The Proposer contract (ddtree.engine.proposers.Proposer): a proposer defined here alone, declaring what it does,
gets the per-round diagnosis, the compiled round (compile=true on the CPU, traced by dynamo) and its caches sized
from its declared max_nodes; nothing in the loop or the compiler knows its class. Reference: HF greedy `generate`."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine.proposers import Proposer
from ddtree.engine.tree import best_first_tree, tree_of_tensors
from ddtree.errors import ConfigError
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

VOCAB, L, BUDGET, NEW = 12, 4, 6, 16


class BigramProposer(Proposer):
    """A drafter of this test's own: a fixed random bigram table; each round L rows (the root's row, then the row of
    each argmax), drafted as the best-first tree of `budget` nodes."""

    diagnoses = True
    compilable = True
    best_first = True

    def __init__(self, budget: int = BUDGET, seed: int = 0):
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
        self.budget = budget
        self.block_size = L + 1
        self.max_nodes = budget + 1
        self.capacities: list[int] = []

    def reset(self, capacity: int) -> None:
        self.capacities.append(capacity)

    def propose(self, state):
        rows, tok = [], int(state.root)
        for _ in range(L):
            rows.append(self.table[tok])
            tok = int(rows[-1].argmax())
        self.last_logits = torch.stack(rows).to(state.root.device)
        if self.tree_tensors is not None:  # the compiled round's graph of the tree build
            return tree_of_tensors(*self.tree_tensors(state.root, self.last_logits, self.budget))
        return best_first_tree(state.root, torch.log_softmax(self.last_logits, -1), self.budget)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3", seed=6, attn_implementation="sdpa", vocab_size=VOCAB)


@pytest.mark.parametrize("compile", ["false", "true"])
def test_a_proposer_of_the_callers_gets_diagnosis_compilation_and_cache_sizing(target, compile):
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    prop = BigramProposer()
    with ddtree.Engine(target, None, method="ddtree", budget=BUDGET, proposer=prop, compile=compile,
                       compile_backend="eager") as engine:
        assert (engine.static is not None) == (compile == "true")
        assert (prop.tree_tensors is not None) == (compile == "true")  # attached where it declares best_first
        res = engine.generate(ids, max_new_tokens=NEW)
    assert res.output_ids == hf_greedy(target, ids, NEW)  # lossless either way
    assert prop.capacities == [9 + NEW + BUDGET + 2]  # prompt + new tokens + max_nodes + 1
    assert res.diagnosis and len(res.diagnosis["depth"]) == res.rounds  # a record per round
    assert res.block_size == L + 1 and max(res.acceptance_lengths) > 1


def test_the_defaults_are_a_root_only_proposer_without_diagnosis_or_compiled_round(target):
    class Plain(BigramProposer):
        diagnoses = compilable = best_first = False

    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    res = ddtree.generate(target, None, ids, method="ddtree", budget=BUDGET, proposer=Plain(), max_new_tokens=8)
    assert res.output_ids == hf_greedy(target, ids, 8) and res.diagnosis is None
    with pytest.raises(ConfigError, match="^compile: .*custom proposer's trees may vary"):
        ddtree.Engine(target, None, method="ddtree", budget=BUDGET, proposer=Plain(), compile="true")
    assert Proposer().max_nodes == 1 and not Proposer().needs_features and Proposer().static_form is None


def test_get_models_keeps_an_mtp_head_in_the_cache_it_is_given(compose):
    """pipeline.models.get_models loads each drafter kind of the methods table into the cache passed (the MTP branch
    used to write the process-global MODELS whatever cache it got)."""
    from ddtree.pipeline import config_checks, models

    rc = config_checks.validate(compose("device=cpu", "model=tiny_qwen3_5", "method=mtp", "drafter=none",
                                        "tracking=none", hydra_node=False))
    before = (models.MODELS.drafter, models.MODELS.drafter_key)
    cache = models.ModelCache()
    target, _, head = models.get_models(rc, "cpu", cache)
    assert head is not None and cache.drafter is head and cache.target is target and cache.drafter_key
    assert (models.MODELS.drafter, models.MODELS.drafter_key) == before  # the global cache untouched
    assert models.get_models(rc, "cpu", cache)[2] is head  # loaded once per cache


def test_messages_name_the_settings_and_say_when_nothing_was_measured(cli, tmp_path):
    """`method.steps=3` names where a method's own settings live; budget=auto with max_new_tokens=1 says no round ran
    instead of 'tau 0.00 (predicted 1.00)'; outside a terminal a job's progress is one line, not a bar per frame."""
    from ddtree.pipeline.autobudget import outcome_line
    from ddtree.pipeline.console import Progress

    proc = cli("method.steps=3", f"hydra.run.dir={tmp_path / 'j'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: method.steps: 'method' is a single value, not a group of settings: no such setting — a method's own "
        "settings: mtp.steps, mtp.topk, mtp.seed, eagle3.steps, eagle3.topk (python -m ddtree.run --cfg job prints every "
        "setting)"]
    line = outcome_line({"predicted_tau": 1.0, "predicted_speedup": 0.9, "measured_tau": None,
                         "measured_speedup": None})
    assert "no decoding round ran" in line and "tau 0.00" not in line
    assert outcome_line({"predicted_tau": 2.0, "predicted_speedup": 1.5, "measured_tau": 1.8,
                         "measured_speedup": 1.2}).startswith("budget=auto outcome: tau 1.80 (predicted 2.00)")
    out = tmp_path / "log.txt"
    with out.open("w") as f:  # a file, as under nohup or SLURM
        bar = Progress(range(3), "job-a", "prompt", file=f)
        for _ in bar:
            bar.set_postfix(tau="1.50")
    assert bar.bar is None and out.read_text().splitlines() == [out.read_text().splitlines()[0]]
    assert out.read_text().startswith("job-a: 3 prompts in ") and out.read_text().rstrip().endswith("tau 1.50")


def test_library_bars_are_off_in_a_log_only(tmp_path, monkeypatch):
    """Outside a terminal transformers' own bars (weight loading) are off too; on a terminal they stay."""
    from transformers.utils import logging as hf_logging

    from ddtree.pipeline.console import library_bars_off_outside_a_terminal

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")

    class Tty:
        def isatty(self) -> bool:
            return True

    hf_logging.enable_progress_bar()  # (an in-process job of an earlier test may have turned them off)
    try:
        assert not library_bars_off_outside_a_terminal(Tty()) and hf_logging.is_progress_bar_enabled()
        with (tmp_path / "log").open("w") as f:
            assert library_bars_off_outside_a_terminal(f) and not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
