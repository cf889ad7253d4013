"""The batched round (`Engine.generate_many`, ddtree.engine.batch): every stream lossless whatever the others are.

References are independent: Hugging Face greedy `generate` of each prompt alone (T = 0); at T > 0 the engine's AR
baseline of each prompt alone (the keyed noise makes every method's committed tokens the target's own samples)."""

from __future__ import annotations

import pytest
import torch
from batch_support import per_round_at, toy_pair

from ddtree.engine.drafter.dflash2 import Candidates, DFlash2Drafter
from ddtree.engine.drafter.model import DFlashDrafter
from ddtree.engine.loop import Engine
from ddtree.errors import ConfigError
from ddtree.tiny import tiny_model

STOP = 2


@pytest.fixture(scope="module")
def toy_pure():
    return toy_pair("toy_pure", prompts=7)


@torch.no_grad()
def hf_greedy(model, ids: torch.Tensor, n: int, stop: int | None = None) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0,
                         min_new_tokens=None if stop is not None else n)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_every_stream_equals_greedy_decoding_of_its_prompt_alone(toy_pure, method):
    """7 prompts of different lengths through 3 slots: streams join as others end (a stop token, at different
    rounds), accept different lengths per round; each output is HF greedy decoding of its prompt alone."""
    target, drafter, prompts = toy_pure
    with Engine(target, None if method == "ar" else drafter, method=method, budget=16, compile="false") as engine:
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 32, STOP)
        assert r.prompt_len == ids.shape[1] and r.streams <= 3
    if method != "ar":  # the trained pair accepts several tokens a round: the tree paths are exercised
        assert sum(r.tau for r in results) / len(results) > 2.5
    assert results[-1].queued_s > results[0].queued_s  # the last prompt waited for a slot


def test_the_batched_round_builds_trees_in_c_on_a_cpu_unless_the_options_turn_it_off(toy_pure, monkeypatch):
    """On a CPU the batched DDTree round builds every stream's tree in one C call (the single-stream engine's host
    build), and in torch ops (a GPU's code) under device_path="host_tree"; either way each stream is greedy
    decoding of its prompt alone."""
    from ddtree.engine import batch_tree, tree

    if not hasattr(tree._hosttree, "batch_best_first"):
        pytest.skip("the C tree build is not compiled here")
    target, drafter, prompts = toy_pure
    calls = []
    real = batch_tree._batch_best_first_host
    monkeypatch.setattr(batch_tree, "_batch_best_first_host", lambda *a: calls.append(1) or real(*a))
    for device_path, in_c in ((False, True), ("host_tree", False)):
        calls.clear()
        with Engine(target, drafter, method="ddtree", budget=16, compile="false", device_path=device_path) as engine:
            results = engine.generate_many(prompts[:3], concurrency=2, max_new_tokens=12)
        assert [r.output_ids for r in results] == [hf_greedy(target, ids, 12) for ids in prompts[:3]]
        assert bool(calls) == in_c, device_path


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "qwen3_moe", "llama"])
def test_sliding_windows_sinks_moe_and_mla_targets_batched(model_type):
    """gpt_oss (sliding window 8 with sinks: contexts run past it), DeepSeek-V3 (MLA, MoE), Qwen3-MoE, Llama."""
    attn = "eager" if model_type == "gpt_oss" else "sdpa"
    target = tiny_model(model_type, attn_implementation=attn)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 11, 3, 9)]
    with Engine(target, drafter, method="ddtree", budget=8, compile="false") as engine:
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=20)
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 20)


@pytest.mark.parametrize("model_type,method", [("qwen3", "ar"), ("gpt_oss", "ddtree")])
def test_prompts_joining_at_once_prefill_in_one_forward(model_type, method):
    """Four prompts of different lengths fill the slots in one target forward (left-padded to the longest), the two
    queued ones join together as their slots free; on a pure and a sliding-window target (window 8 with sinks,
    prompts past it) every stream is still HF greedy decoding of its prompt alone."""
    attn = "eager" if model_type == "gpt_oss" else "sdpa"
    target = tiny_model(model_type, attn_implementation=attn)
    drafter = None if method == "ar" else DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 13, 3, 9, 11, 6)]
    prefills = []  # (batch, width) of each forward that keeps one row of logits: a prefill's

    def seen(module, args, kwargs, out):
        if kwargs.get("logits_to_keep") == 1:
            prefills.append(tuple(kwargs["input_ids"].shape))

    reads = []  # (batch, context rows) of each drafter forward

    def read(module, args, kwargs, out):
        ctx = args[1] if len(args) > 1 else kwargs.get("context_features")
        reads.append((args[0].shape[0], 0 if ctx is None else ctx.shape[1]))

    hook = target.register_forward_hook(seen, with_kwargs=True)
    dhook = drafter.register_forward_hook(read, with_kwargs=True) if drafter is not None else None
    try:
        with Engine(target, drafter, method=method, budget=8, compile="false") as engine:
            results = engine.generate_many(prompts, concurrency=4, max_new_tokens=12)
    finally:
        hook.remove()
        if dhook is not None:
            dhook.remove()
    if drafter is not None:
        with Engine(target, drafter, method=method, budget=8, compile="false") as engine:
            alone = [engine.generate(p, max_new_tokens=12) for p in prompts]
    assert prefills[0] == (4, 13)
    assert sum(b for b, _ in prefills) == len(prompts)  # each prompt prefilled once
    if method == "ar":  # one token a round: the first four streams end together, the last two join at once
        assert prefills == [(4, 13), (2, 11)]
    else:  # the drafter reads the four prompts in one forward (right-padded to the longest), then drafts as alone
        assert reads[0] == (4, 13)
        for one, r in zip(alone, results, strict=True):
            assert r.acceptance_lengths == one.acceptance_lengths
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 12)
        assert r.ttft_s > 0 and r.prompt_len == ids.shape[1]


def test_a_round_dispatches_the_same_ops_at_one_stream_and_at_eight(toy_pure):
    """Ops per round (draft, tree, verify, commit) do not grow with the streams: no loop over them. And generate_many
    with one slot at T = 0 is the one-stream engine's generate (the same results, its rounds). Counted on the path a
    CUDA run takes (device_path="host_tree": a CPU's C tree build reads its logits on the host)."""
    target, drafter, prompts = toy_pure
    with Engine(target, drafter, method="ddtree", budget=16, compile="false", device_path="host_tree") as engine:
        per_round = {n: per_round_at(engine, prompts[0], n, 24, 16) for n in (1, 8)}
    assert per_round[8] == per_round[1]
    assert per_round[1][1] == 1  # one host read a round, for every stream together
    # and at one stream no more kernel ops than the one-stream engine's round, as a GPU runs it (its device path)
    from ddtree.engine.host import device_path
    from ddtree.testing.dispatch import DispatchCount

    with device_path(), Engine(target, drafter, method="ddtree", budget=16, compile="false") as engine:
        engine.generate(prompts[0], max_new_tokens=24)
        with DispatchCount() as c:
            res = engine.generate(prompts[0], max_new_tokens=24)
    assert per_round[1][0] <= c.total(c.kernel_ops, exclude=("prefill", "other")) / res.rounds
    with Engine(target, drafter, method="ddtree", budget=16, compile="false") as engine:
        one = engine.generate_many(prompts[:2], concurrency=1, max_new_tokens=24)
        assert [r.to_dict() | {"queued_s": 0, "ttft_s": 0, "decode_s": 0, "stage_seconds": 0, "total_s": 0,
                               "tokens_per_s": 0} for r in one] == [
            engine.generate(p, max_new_tokens=24).to_dict() | {"queued_s": 0, "ttft_s": 0, "decode_s": 0,
                                                                "stage_seconds": 0, "total_s": 0, "tokens_per_s": 0}
            for p in prompts[:2]]


def test_refusals_are_one_line(toy_pure):
    target, drafter, prompts = toy_pure
    with Engine(target, drafter, method="ddtree", budget=16, compile="false") as engine:
        with pytest.raises(ConfigError, match="concurrency"):
            engine.generate_many(prompts, concurrency=0)
    with Engine(target, drafter, method="ddtree", budget=16, compile="false", scoring="marginal") as engine:
        assert engine.generate_many(prompts[:1], concurrency=2, max_new_tokens=4)[0].num_new_tokens == 4
    from ddtree.engine.proposers import ARProposer

    with Engine(target, None, method="ar", proposer=ARProposer(), compile="false") as engine:  # not the method's own
        with pytest.raises(ConfigError, match="custom proposer"):
            engine.generate_many(prompts[:2], concurrency=2)
    with Engine(target, drafter, method="dflash", compile="false") as engine:
        with pytest.raises(ConfigError, match="budget=auto"):
            engine.generate_many(prompts[:2], concurrency=2, budget="auto")


def test_an_eagle3_chain_batched_drafts_as_it_does_alone():
    """method=eagle3 (topk 1): each stream greedy decoding of its prompt alone, and drafted as the one-stream engine
    drafts it (the same acceptance, round by round). Its tree (topk > 1): tests/test_batch_heads.py."""
    from eagle3_support import fitted_drafter

    target = tiny_model("qwen3", attn_implementation="sdpa")
    drafter = fitted_drafter(target, steps=20)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 9, 3, 12)]
    with Engine(target, drafter, method="eagle3", steps=3, topk=1, compile="false") as engine:
        alone = [engine.generate(p, max_new_tokens=20) for p in prompts]
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=20)
    for ids, one, r in zip(prompts, alone, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 20)
        assert r.acceptance_lengths == one.acceptance_lengths


def test_hybrid_targets_batched_dflash_ddtree_and_the_mtp_chain():
    """A tiny Qwen3.5 hybrid (Gated DeltaNet with a slow decay): DDTree and the MTP chain batched, every stream greedy
    decoding of its prompt alone and drafted round by round as alone (the MTP head fitted so drafts get accepted)."""
    from mtp_support import fitted_head

    target = tiny_model("qwen3_5_text", attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 12, 3, 9)]
    refs = [hf_greedy(target, ids, 20) for ids in prompts]
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    head = fitted_head(target, steps=20)
    for draft, kw in ((drafter, dict(method="ddtree", budget=8)), (head, dict(method="mtp", steps=3, topk=1))):
        with Engine(target, draft, compile="false", **kw) as engine:
            alone = [engine.generate(p, max_new_tokens=20) for p in prompts]
            results = engine.generate_many(prompts, concurrency=3, max_new_tokens=20)
        for ref, one, r in zip(refs, alone, results, strict=True):
            assert r.output_ids == ref
            assert r.acceptance_lengths == one.acceptance_lengths
    assert max(r.tau for r in results) > 1.5  # the fitted head's drafts are accepted: rollback is exercised


def test_at_t_above_0_every_method_commits_what_ar_sampling_commits(toy_pure):
    """Keyed noise (seed, stream, position): the committed tokens are the target's own samples, so every method and
    every concurrency gives AR sampling's output for the same seed, token for token (fp32); another seed differs."""
    target, drafter, prompts = toy_pure
    kw = dict(temperature=0.9, max_new_tokens=24, stop_token_ids=[STOP], seed=7)
    with Engine(target, None, method="ar", compile="false") as engine:
        ar = [r.output_ids for r in engine.generate_many(prompts[:4], concurrency=1, **kw)]
        other = [r.output_ids for r in engine.generate_many(prompts[:4], concurrency=4, **{**kw, "seed": 8})]
    assert other != ar
    for method, conc in (("dflash", 3), ("ddtree", 4), ("ddtree", 1)):
        with Engine(target, drafter, method=method, budget=16, compile="false") as engine:
            results = engine.generate_many(prompts[:4], concurrency=conc, **kw)
        assert [r.output_ids for r in results] == ar, (method, conc)
        assert sum(r.tau for r in results) / len(results) > 1.5  # drafts accepted at T > 0 (coupled)


def test_budget_auto_chooses_per_round_losslessly_and_the_diagnosis_shows_it(toy_pure):
    """budget="auto": each round's draft (no draft, the chain, a DDTree budget) chosen for the live streams; every
    output still greedy decoding alone; the controller's record reaches ddtree.diagnose's table against the load."""
    from ddtree.pipeline.diagnose.analysis import diagnose
    from ddtree.pipeline.diagnose.records import JobData

    target, drafter, prompts = toy_pure
    from ddtree.testing.dispatch import DispatchCount

    with (Engine(target, drafter, method="ddtree", budget="auto", compile="false", device_path="host_tree") as engine,
          DispatchCount() as c):
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    # one host read a round, the controller's ranks carried by the walk's (on the path a CUDA run takes: a CPU's C
    # tree build reads its logits on the host)
    assert c.total(c.syncs, exclude=("prefill", "other")) == results[0].load_budget["rounds"]
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 32, STOP)
    load = results[0].load_budget
    assert load["rounds"] >= max(r.rounds for r in results)  # the batch's rounds: each stream took part in some
    chosen = {label for row in load["loads"].values() for label in row["choices"]}
    assert len(chosen) >= 2 and chosen <= {"ar", "chain", "ddtree:4", "ddtree:8", "ddtree:16", "ddtree:32", "ddtree:64"}
    doc = diagnose([JobData("job", "ddtree", "auto", {"method": "ddtree", "load_budget": [load]}, [])])
    assert {r["streams"] for r in doc["load"]} == {int(k) for k in load["loads"]}
    assert sum(r["rounds"] for r in doc["load"]) == load["rounds"]


def test_budget_auto_learns_smaller_trees_from_the_rounds_of_a_bigger_one(toy_pure, monkeypatch):
    """Rounds of DDTree-16 also measure DDTree-4 (its tree is the first 4 pops of the same search): the smaller
    option's correction learns without one round of its own; per stream it never keeps more than the round did, and
    its tokens a round come near what a DDTree-4 engine commits on the same prompts (its rounds start elsewhere)."""
    from ddtree.engine import batch
    from ddtree.engine.adaptive import Choice, LoadBudget, RooflineCost

    target, drafter, prompts = toy_pure
    four, sixteen = Choice("tree", 4), Choice("tree", 16)
    # a stated cost where DDTree-16 is the best of {4, 16, AR} at these loads: only it runs
    lb = LoadBudget([4, 16], block_size=drafter.config.block_size, chain=False, refresh_every=0,
                    cost=RooflineCost.stated("qwen3_6_27b", "h200"))
    seen = []
    observe = lb.observe

    def spy(choice, **kw):
        seen.append((kw["accepted"], (kw.get("others") or {}).get(four)))
        return observe(choice, **kw)

    monkeypatch.setattr(lb, "observe", spy)
    monkeypatch.setattr(batch, "RANK_EVERY", 1)  # every round carries its ranks
    with Engine(target, drafter, method="ddtree", budget="auto", compile="false") as engine:
        engine.load_budget = lb
        engine.generate_many(prompts, concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    with Engine(target, drafter, method="ddtree", budget=4, compile="false") as engine:
        alone = engine.generate_many(prompts, concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    assert {r.choice for r in lb.history} == {sixteen} and all(cf is not None for _, cf in seen)
    assert all(1 <= c <= k for kept, cf in seen for k, c in zip(kept, cf, strict=True))
    assert lb._ratio[four][1] > 0 and lb.correction(four) != 1.0
    tau4 = sum(sum(r.acceptance_lengths) for r in alone) / sum(r.rounds for r in alone)
    measured = [c for _, cf in seen for c in cf]
    assert sum(measured) / len(measured) == pytest.approx(tau4, rel=0.25)


def test_budget_auto_weighs_the_tokens_outputs_keep_and_reads_prompts_into_the_drafter_only_to_draft(toy_pure):
    """budget="auto"'s bookkeeping, against the outputs: a round's recorded tokens are those the outputs kept (all
    rounds together: every new token but each stream's first, which its prefill gives); a run of AR rounds never
    runs the drafter (a joined prompt reaches it before the first drafted round); the first drafted round after AR
    rounds reads what they queued and is not measured as the round's cost; the outputs stay greedy decoding alone."""
    from ddtree.engine.adaptive import AR, Choice, LoadBudget

    target, drafter, prompts = toy_pure
    calls = []
    hook = drafter.register_forward_hook(lambda *_: calls.append(1))
    script = [AR, AR, AR, Choice("chain", drafter.block_size - 1), Choice("tree", 8), AR, Choice("tree", 16)]

    reads = []  # (the drafter's read of joined prompts, charged as a join: the round's previous round)

    class Scripted(LoadBudget):  # the rule's bookkeeping, its choices scripted
        def choose(self, streams, rows=None, queued=False):
            super().choose(streams, rows, queued)
            rec = self.history[-1]
            rec.choice = script[rec.round % len(script)]
            return rec.choice

        def joined(self, choice, seconds, *, rows):
            if self.history[-1].tokens is None:  # (within a round: its drafter read)
                reads.append(self.history[-2].choice)
            super().joined(choice, seconds, rows=rows)

    try:
        for controller, drafts in ((LoadBudget([], block_size=drafter.block_size, chain=False), False),
                                   (Scripted([8, 16], block_size=drafter.block_size), True)):
            calls.clear()
            with Engine(target, drafter, method="ddtree", budget="auto", compile="false") as engine:
                engine.load_budget = controller
                results = engine.generate_many(prompts, concurrency=3, max_new_tokens=24, stop_token_ids=[STOP])
            for ids, r in zip(prompts, results, strict=True):
                assert r.output_ids == hf_greedy(target, ids, 24, STOP)
            history = controller.history
            assert sum(r.tokens for r in history) == sum(len(r.output_ids) - 1 for r in results)
            assert bool(calls) == drafts
            if drafts:
                switch = [r for r in history[1:] if r.choice.drafted and history[r.round - 1].choice == AR]
                steady = [r for r in history[1:] if r.choice.drafted and history[r.round - 1].choice.drafted]
                assert switch and steady
                assert all(r.seconds == 0 for r in switch) and all(r.seconds > 0 for r in steady)
                # a read after drafted rounds is a join's cost; after AR rounds, of what they queued: the switch's
                assert reads and all(c.drafted for c in reads)
    finally:
        hook.remove()


def test_budget_auto_charges_joins_to_the_round_that_freed_the_slots_and_prices_the_tail_at_its_rows(toy_pure):
    """budget="auto" with a queue: rounds run while prompts wait are told so (their joins are counted); a round's
    joins (the target's prefills, the drafter's read of them) are charged to the option whose round freed the slots,
    never the call's first fill; the tail, once it dropped its free slots, is weighed at the rows it computes."""
    from ddtree.engine.adaptive import LoadBudget

    target, drafter, prompts = toy_pure
    seen, joins = [], []

    class Spy(LoadBudget):
        def choose(self, streams, rows=None, queued=False):
            seen.append((streams, rows, queued))
            return super().choose(streams, rows, queued)

        def joined(self, choice, seconds, *, rows):
            joins.append((len(self.history), choice, seconds, rows, sum(r.tokens is not None for r in self.history)))
            super().joined(choice, seconds, rows=rows)

    controller = Spy([8], block_size=drafter.block_size)
    with Engine(target, drafter, method="ddtree", budget="auto", compile="false") as engine:
        engine.load_budget = controller
        results = engine.generate_many(prompts * 2, concurrency=4, max_new_tokens=24, stop_token_ids=[STOP])
    for ids, r in zip(prompts * 2, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 24, STOP)
    assert seen[0] == (4, 4, True) and seen[-1][2] is False  # the queue ran dry before the last round
    queued = [q for _, _, q in seen]
    assert queued == sorted(queued, reverse=True)  # (waiting, then not)
    assert any(rows < 4 for _, rows, _ in seen)  # the tail, at its rows
    charged = [j for j in joins if j[2] > 0]
    assert charged and all(rows == 4 for _, _, _, rows, _ in charged)
    assert all(observed >= 1 for *_, observed in charged)  # (never the call's first fill)
    # (the last round's option; the drafter's read: the drafted round's own, chosen just before it)
    assert all(c == controller.history[n - 1].choice for n, c, *_ in charged)
    assert any(controller.join_cost(controller._band(4), c) > 0 for c in controller.options)


@pytest.fixture(scope="module")
def toy_dflash2():
    """The shipped hybrid toy target (Gated DeltaNet + attention) and its trained DFlash2 drafter (assets/toy/drafter2:
    convolutions around both sublayers, a candidate selector), 5 prompts."""
    return toy_pair("toy", "drafter2", prompts=5)


DFLASH2_CASES = [("ddtree", None, "PairTreeProposer"), ("ddtree", "marginal", "DFlash2MarginalProposer"),
                 ("dflash", None, "DFlash2ChainProposer")]


@pytest.mark.parametrize("method,scoring,proposer", DFLASH2_CASES)
def test_a_dflash2_drafter_batched_drafts_as_it_does_alone(toy_dflash2, method, scoring, proposer):
    """DDTree with pair scores (scoring=auto: pair for a DFlash2 drafter) and with marginal scores, and the selector's
    chain (method=dflash), 5 prompts through 3 slots: each stream greedy decoding of its prompt alone, drafted round by
    round as the one-stream engine drafts it (the same acceptance lengths); ops a round the same at 1 and 4 streams
    (counted on the path a CUDA run takes, device_path="host_tree": a CPU's C tree build reads its logits on the
    host)."""

    target, drafter, prompts = toy_dflash2
    with Engine(target, drafter, method=method, budget=16, compile="false", scoring=scoring) as engine:
        assert type(engine.proposer).__name__ == proposer
        alone = [engine.generate(p, max_new_tokens=40, stop_token_ids=[STOP]) for p in prompts]
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=40, stop_token_ids=[STOP])
    with Engine(target, drafter, method=method, budget=16, compile="false", scoring=scoring,
                device_path="host_tree") as engine:
        per_round = {n: per_round_at(engine, prompts[1], n, 24, 16) for n in (1, 4)}
    for ids, one, r in zip(prompts, alone, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 40, STOP)
        assert r.acceptance_lengths == one.acceptance_lengths
    assert sum(r.tau for r in results) / len(results) > 3  # the trained pair: long paths accepted
    assert per_round[4] == per_round[1] and per_round[1][1] == 1, per_round


def test_batched_pair_trees_are_each_streams_own(toy_dflash2):
    """batch_pair_tree row i is the one-stream pair_tree of stream i's candidates, node for node (its node set the
    budget best paths of the from-scratch reference); and at T > 0 the DFlash2 chain batched commits what AR sampling
    commits (keyed noise: the selector's sampled walk coupled to the target's samples, drafts accepted)."""
    from ddtree.engine.selector import batch_pair_tree, pair_logprobs, pair_tree
    from ddtree.testing.dflash2 import pair_paths_reference
    from ddtree.testing.reference import tree_paths

    target, drafter, prompts = toy_dflash2
    short = DFlash2Drafter.random_for_target(target.config, block_size=4, seed=7, selector_top_k=4, selector_rank=8)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 3, target.config.hidden_size, generator=g)
    logits = short.head_logits(target.get_output_embeddings(), hidden)
    roots = torch.tensor([5, 9, 5])
    with torch.no_grad():
        for budget in (1, 6, 25):
            cands = short.candidates(logits, hidden)
            tree = batch_pair_tree(roots, cands, budget)
            for i in range(3):  # stream i's candidates alone (its rows of the batched ones: the same inputs)
                cand = Candidates.of_outputs(tuple(f[i] for f in cands.outputs()), cands.pred)
                one, _ = pair_tree(roots[i], pair_logprobs(cand, roots[i]), cand.ids, budget)
                row = tree.row(i)
                for field in ("tokens", "parents", "depths", "scores"):
                    assert torch.equal(getattr(row, field), getattr(one, field)), (budget, i, field)
                assert set(tree_paths(row)) == pair_paths_reference(short, logits[i], hidden[i], int(roots[i]), budget)
    kw = dict(temperature=0.9, max_new_tokens=24, stop_token_ids=[STOP], seed=7)
    with Engine(target, None, method="ar", compile="false") as engine:
        ar = [r.output_ids for r in engine.generate_many(prompts[:4], concurrency=4, **kw)]
    with Engine(target, drafter, method="dflash", compile="false") as engine:
        results = engine.generate_many(prompts[:4], concurrency=3, **kw)
    assert [r.output_ids for r in results] == ar
    assert sum(r.tau for r in results) / len(results) > 1.5


def test_budget_auto_over_a_dflash2_drafter_walks_and_builds_pair_trees(toy_dflash2):
    """budget="auto" with pair scoring: a round's chain is the selector's walk, its trees pair trees at the chosen
    budget; every stream still greedy decoding of its prompt alone."""
    target, drafter, prompts = toy_dflash2
    with Engine(target, drafter, method="ddtree", budget="auto", compile="false") as engine:
        results = engine.generate_many(prompts, concurrency=3, max_new_tokens=40, stop_token_ids=[STOP])
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 40, STOP)
    chosen = {label for row in results[0].load_budget["loads"].values() for label in row["choices"]}
    assert chosen - {"ar"}, chosen  # drafted rounds (which: the controller's choice, from measured seconds)


# ---------------------------------------------------------------- the compiled batched round (compile=true)

def _compiled(target, drafter, method, budget=16, backend="eager", **kw):
    return Engine(target, None if method == "ar" else drafter, method=method, budget=budget, compile="true",
                  compile_backend=backend, **kw)


# (fast: DDTree here; AR and DFlash compiled batched on the hybrid below)
@pytest.mark.parametrize("method,budget", [pytest.param("ar", None, marks=pytest.mark.slow),
                                           pytest.param("dflash", None, marks=pytest.mark.slow), ("ddtree", 16),
                                           pytest.param("ddtree", "auto", marks=pytest.mark.slow)])
def test_the_compiled_batched_round_equals_the_eager_one_and_greedy_decoding(toy_pure, dynamo_clean, method, budget):
    """compile=true (dynamo tracing, fullgraph): the toy pair's 7 prompts through 3 slots (joins between rounds, stop
    tokens at different rounds, free slots at the end) give HF greedy decoding of each prompt alone and the eager
    batched round's acceptance lengths; the round is one graph per plan, none traced again across calls with other
    prompts (budget=auto: a graph per choice, compiled on its first use, a bounded number), one graph call and one
    host read a round; results say compiled."""
    from torch._dynamo.utils import counters

    from ddtree.testing.dispatch import DispatchCount

    target, drafter, prompts = toy_pure
    kw = dict(concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    with Engine(target, None if method == "ar" else drafter, method=method, budget=budget or 16,
                compile="false") as engine:
        eager = engine.generate_many(prompts, **kw)
    with _compiled(target, drafter, method, budget or 16) as engine:
        results = engine.generate_many(prompts, **kw)
        graphs = counters["stats"]["unique_graphs"]
        assert not counters["graph_break"], dict(counters["graph_break"])
        if budget == "auto":  # a graph per (choice, the drafter's context width): bounded by the candidates
            assert 1 <= graphs <= 2 * 7
            again = engine.generate_many(prompts[::-1], **kw)
        else:
            assert graphs == 1  # every round of every stream: one graph
            with torch._dynamo.config.patch(error_on_recompile=True):
                again = engine.generate_many(prompts[::-1], **kw)
                with DispatchCount() as c:  # 3 like streams: the rounds are the batch's
                    same = engine.generate_many([prompts[0]] * 3, concurrency=3, max_new_tokens=24)
            assert counters["stats"]["unique_graphs"] == graphs
            rounds = same[0].rounds
            assert c.graphs["verify"] == rounds and sum(c.graphs.values()) == rounds  # a round: one graph call
            assert c.total(c.syncs, exclude=("prefill", "other")) == rounds == c.sync_names["tolist"]  # one read
    for ids, r, e, a in zip(prompts, results, eager, again[::-1], strict=True):
        assert r.output_ids == e.output_ids == a.output_ids == hf_greedy(target, ids, 32, STOP)
        if budget != "auto":  # (auto: the choices follow measured seconds)
            assert r.acceptance_lengths == e.acceptance_lengths
        assert (r.round, r.round_note, r.round_fallback) == ("compiled", None, False)
    if method != "ar":
        assert sum(r.tau for r in results) / len(results) > 2.5


@pytest.mark.parametrize("method,kw", [("ddtree", {}), ("dflash", {}), ("ar", {}),
                                       ("ddtree", dict(temperature=0.8, seed=3))])
def test_the_compiled_batched_round_on_a_hybrid_target_and_at_t_above_0(dynamo_clean, method, kw):
    """The tiny Qwen3.5 hybrid (tree-exact Gated DeltaNet inside the graph: its verification, its commit) compiled:
    DDTree, DFlash and AR equal HF greedy and the eager batched round's drafts; at T > 0 the compiled round commits
    the eager round's keyed samples. The backend overwrites each graph's outputs at the next compiled call, as CUDA
    graph trees reuse their pool: nothing of a round's graph is read after the next one but the clones
    `CompiledRound` makes under CUDA graphs (on here as on CUDA)."""
    from test_compile import _pool_backend

    from ddtree.engine import batch

    target = tiny_model("qwen3_5_text", attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 12, 3, 9)]
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    args = dict(concurrency=3, max_new_tokens=20, **kw)
    with Engine(target, None if method == "ar" else drafter, method=method, budget=8, compile="false") as e:
        eager = e.generate_many(prompts, **args)
    with _compiled(target, drafter, method, budget=8) as engine:
        engine.batch_static = batch.CompiledRound(target.device, backend=_pool_backend())
        engine.batch_static.cudagraphs = True  # as mode="reduce-overhead" sets it on CUDA
        results = engine.generate_many(prompts, **args)
    for ids, r, ref in zip(prompts, results, eager, strict=True):
        assert r.round == "compiled" and r.round_note is None, r.round_note
        assert r.output_ids == ref.output_ids and r.acceptance_lengths == ref.acceptance_lengths, method
        if not kw:
            assert r.output_ids == hf_greedy(target, ids, 20)


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3"])
def test_the_compiled_batched_round_on_sliding_sinks_mla_and_moe_targets(dynamo_clean, model_type):
    """The batched round traces targets the one-stream compiled round refuses (the model's own forward: gpt_oss's
    sliding window with sinks, DeepSeek-V3's MLA and MoE), as compile=auto on CUDA runs it: HF greedy, one graph."""
    from torch._dynamo.utils import counters

    from ddtree.engine import batch

    target = tiny_model(model_type, attn_implementation="eager" if model_type == "gpt_oss" else "sdpa")
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 11, 3, 9)]
    with Engine(target, drafter, method="ddtree", budget=8, compile="false") as engine:
        engine.binding.ensure()
        results = batch.generate_many(engine, prompts, 3, 0.0, 20, None, 0, 8,
                                      compiled=batch.CompiledRound(engine.binding.device, "eager"))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for ids, r in zip(prompts, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 20)


def test_the_compiled_batched_round_falls_back_eagerly_with_its_reason(toy_pure, monkeypatch, caplog):
    """Where the batched round does not compile (an MTP head's chain), it runs eagerly and says why; compile=auto on
    a CPU runs it eagerly (as the one-stream round); a compiled round that fails (a fault injected at the graph's
    call) is logged and the call rerun eagerly, the results exact and marked a fallback, the engine eager from then."""
    from mtp_support import fitted_head

    from ddtree.engine import batch

    target, drafter, prompts = toy_pure
    with Engine(target, drafter, method="ddtree", budget=16, compile="auto") as engine:  # (a CPU)
        r = engine.generate_many(prompts[:2], concurrency=2, max_new_tokens=8)[0]
        assert r.round == "eager" and "CUDA only" in r.round_note and not r.round_fallback
    hybrid = tiny_model("qwen3_5_text", attn_implementation="sdpa")
    with Engine(hybrid, fitted_head(hybrid, steps=2), method="mtp", steps=2, topk=1, compile="true",
                compile_backend="eager") as engine:
        r = engine.generate_many([torch.tensor([[5, 6, 7]]), torch.tensor([[9, 8]])], concurrency=2,
                                 max_new_tokens=6)[0]
        assert r.round == "eager" and "head" in r.round_note and r.round_fallback

    def broken(self, run, plan):
        raise RuntimeError("injected: no graph")

    monkeypatch.setattr(batch.CompiledRound, "__call__", broken)
    with _compiled(target, drafter, "ddtree") as engine:
        results = engine.generate_many(prompts[:3], concurrency=2, max_new_tokens=16, stop_token_ids=[STOP])
        assert "compiled batched round failed (RuntimeError: injected: no graph)" in caplog.text
        for ids, r in zip(prompts, results, strict=False):
            assert r.output_ids == hf_greedy(target, ids, 16, STOP)
            assert r.round == "eager" and "injected" in r.round_note and r.round_fallback
        assert engine.generate_many(prompts[:2], concurrency=2, max_new_tokens=4)[0].round == "eager"


@pytest.mark.slow
def test_the_compiled_batched_round_under_inductor(toy_pure, dynamo_clean):
    """As a user's compile=true runs it (inductor's generated code, on this CPU: about a minute of compiling): DDTree
    on the toy pair equals HF greedy and compiles one graph."""
    from torch._dynamo.utils import counters

    target, drafter, prompts = toy_pure
    with _compiled(target, drafter, "ddtree", backend=None) as engine:
        results = engine.generate_many(prompts[:4], concurrency=3, max_new_tokens=24, stop_token_ids=[STOP])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for ids, r in zip(prompts, results, strict=False):
        assert r.round == "compiled" and r.output_ids == hf_greedy(target, ids, 24, STOP)


def test_the_compiled_batched_round_with_a_dflash2_drafter(toy_dflash2, dynamo_clean):
    """A DFlash2 drafter's pair trees (its selector in the graph: the proposer's batch_tree) through the compiled
    batched round on the hybrid toy: HF greedy, the eager round's drafts, one graph."""
    from torch._dynamo.utils import counters

    target, drafter, prompts = toy_dflash2
    kw = dict(concurrency=3, max_new_tokens=32, stop_token_ids=[STOP])
    with Engine(target, drafter, method="ddtree", budget=16, compile="false") as engine:
        eager = engine.generate_many(prompts, **kw)
    with _compiled(target, drafter, "ddtree") as engine:
        assert type(engine.proposer).__name__ == "PairTreeProposer"
        results = engine.generate_many(prompts, **kw)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for ids, r, e in zip(prompts, results, eager, strict=True):
        assert r.round == "compiled" and r.output_ids == hf_greedy(target, ids, 32, STOP)
        assert r.acceptance_lengths == e.acceptance_lengths


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_the_batch_tail_drops_its_free_slots_losslessly(toy_pure, method, monkeypatch):
    """Once no prompt is left and at most half the slots hold a stream, the live slots close up (every slot tensor
    keeps their rows): each stream still greedy decoding of its prompt alone, drafted round by round as alone."""
    from ddtree.engine import batch

    target, drafter, prompts = toy_pure
    seen = []
    compact = batch.BatchRun.compact

    def spy(self):
        before = self.slots
        compact(self)
        seen.append((before, self.slots))

    monkeypatch.setattr(batch.BatchRun, "compact", spy)
    draft = drafter if method != "ar" else None
    with Engine(target, draft, method=method, budget=8, compile="false") as engine:
        results = engine.generate_many(prompts, concurrency=6, max_new_tokens=32, stop_token_ids=[STOP])
        alone = [engine.generate(p, max_new_tokens=32, stop_token_ids=[STOP]) for p in prompts]
    assert seen and all(after < before for before, after in seen)
    for ids, one, r in zip(prompts, alone, results, strict=True):
        assert r.output_ids == hf_greedy(target, ids, 32, STOP)
        assert r.acceptance_lengths == one.acceptance_lengths
