"""The batched round's EAGLE-2 trees of the head methods (method=mtp and method=eagle3 with topk > 1): every slot's
expansion in the same batched ops, then each stream's `budget` best nodes.

References are independent: Hugging Face greedy `generate` of each prompt alone; the one-stream engine's acceptance
round by round (its tree is built by its own proposer, one stream at a time); at T > 0 the batched AR baseline with
the same seed (keyed noise: every method commits the target's own samples)."""

from __future__ import annotations

import json

import pytest
import torch
from batch_support import per_round_at

from ddtree.engine.loop import Engine
from ddtree.tiny import tiny_model

NEW = 20


@torch.no_grad()
def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _prompts(lengths=(5, 12, 3, 9, 7)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 120, (1, n), generator=gen) for n in lengths]


@pytest.fixture(scope="module")
def hybrid_head():
    """A tiny Qwen3.5 hybrid (Gated DeltaNet, slow decay) with an MTP head fitted so its drafts get accepted."""
    from mtp_support import fitted_head

    target = tiny_model("qwen3_5_text", attn_implementation="sdpa")
    return target, fitted_head(target, steps=20)


@pytest.fixture(scope="module")
def qwen3_eagle3():
    from eagle3_support import fitted_drafter

    target = tiny_model("qwen3", attn_implementation="sdpa")
    return target, fitted_drafter(target, steps=40)


def _same_as_alone(target, draft, method: str, topk: int, budget: int, prompts) -> list:
    """generate_many at concurrency 3 against each prompt alone: HF greedy's tokens and the one-stream engine's
    acceptance lengths, round by round."""
    with Engine(target, draft, method=method, steps=3, topk=topk, budget=budget, compile="false") as engine:
        alone = [engine.generate(p, max_new_tokens=NEW) for p in prompts]
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=NEW)
    for ids, one, r in zip(prompts, alone, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, NEW), (method, topk, budget)
        assert r.acceptance_lengths == one.acceptance_lengths, (method, topk, budget)
        assert r.streams <= 3 and r.budget == budget
    return results


@pytest.mark.parametrize("topk,budget", [(2, 8), (3, 40)])  # a tree cut by its budget; the whole pool (21 nodes)
def test_mtp_trees_batched_on_a_hybrid_are_the_one_stream_trees(hybrid_head, topk, budget):
    """method=mtp, topk 2 and 3, 5 prompts of different lengths through 3 slots on a hybrid target: each stream is
    greedy decoding of its prompt alone, accepting what the one-stream engine accepts every round."""
    target, head = hybrid_head
    results = _same_as_alone(target, head, "mtp", topk, budget, _prompts())
    assert max(max(r.acceptance_lengths) for r in results) >= 3  # branches accepted past depth 1: rollback exercised


def test_an_eagle3_tree_batched_is_the_one_stream_tree(qwen3_eagle3):
    """method=eagle3, topk 2 on a pure-attention Qwen3: as method=mtp's trees."""
    target, drafter = qwen3_eagle3
    results = _same_as_alone(target, drafter, "eagle3", 2, 6, _prompts((5, 9, 3, 12)))
    assert max(max(r.acceptance_lengths) for r in results) >= 2


def test_a_head_tree_round_dispatches_the_same_ops_at_one_stream_and_at_four(hybrid_head):
    """Ops per round (draft, tree, verify, commit) of the MTP tree do not grow with the streams, and one host read a
    round serves them all. (batch.generate_many directly: Engine.generate_many with one slot at T = 0 runs the
    one-stream round.)"""

    target, head = hybrid_head
    prompt = _prompts((6,))[0]
    with Engine(target, head, method="mtp", steps=3, topk=2, budget=8, compile="false") as engine:
        per_round = {n: per_round_at(engine, prompt, n, 12, 8) for n in (1, 4)}
    assert per_round[4] == per_round[1]
    assert per_round[1][1] == 1


def test_a_head_tree_at_t_above_0_commits_what_ar_sampling_commits(hybrid_head):
    """T > 0: the tree is the head's (deterministic), the target's choices keyed samples: every stream commits what
    AR sampling with the same seed commits, token for token."""
    target, head = hybrid_head
    prompts = _prompts((5, 12, 3, 9))
    kw = dict(temperature=0.8, max_new_tokens=16, seed=3)
    with Engine(target, None, method="ar", compile="false") as engine:
        ar = [r.output_ids for r in engine.generate_many(prompts, concurrency=2, **kw)]
    with Engine(target, head, method="mtp", steps=3, topk=2, budget=8, compile="false") as engine:
        results = engine.generate_many(prompts, concurrency=3, **kw)
    assert [r.output_ids for r in results] == ar
    assert max(max(r.acceptance_lengths) for r in results) >= 2


@pytest.mark.slow  # a CLI subprocess, ~15-20 s on a shared CPU: make test-slow
def test_an_mtp_tree_job_runs_batched_through_the_cli(cli, tmp_path):
    """`python -m ddtree.run model=tiny_qwen3_5 method=mtp mtp.topk=2 concurrency=2` (the tiny hybrid and its random
    head, every other setting at its default): the job runs batched and every output matches the baseline's."""
    job = tmp_path / "job"
    proc = cli("model=tiny_qwen3_5", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "method=mtp",
               "mtp.topk=2", "concurrency=2", "tracking=none", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    assert (s["method"], s["mtp"]["topk"], s["concurrency"], s["match_rate"]) == ("mtp", 2, 2, 1.0)
    assert s["throughput_tok_s"] > 0
