"""The batched round's fp32 grid (issue 45): every method on a pure-attention and a hybrid Gated DeltaNet target, at
concurrency 4 and 8, 10 prompts of different lengths each (streams end at different rounds, slots free up and are
taken again, the last batch runs with free slots; budget=auto: a draft chosen every round): every stream is HF
greedy decoding of its prompt alone.

The trained toy pairs (assets/toy_pure: Qwen3 + DFlash; assets/toy: a Qwen3.5 hybrid + DFlash and DFlash2) accept
several tokens a round, so the trees' accepted paths and the rollback of what they reject are exercised; the head
methods (MTP on the hybrid, EAGLE-3 on Qwen3) run with heads fitted so their drafts are accepted. Slow (`make
test-slow`); the fast suite runs the same properties at concurrency 3 (tests/test_batch.py, test_batch_heads.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batch_support import toy_pair

from ddtree.engine.drafter.model import DFlashDrafter
from ddtree.engine.loop import Engine
from ddtree.tiny import tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NEW = 24
CONCURRENCY = (4, 8)


@torch.no_grad()
def hf_greedy(model, ids: torch.Tensor, n: int, stop: int | None) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0,
                         min_new_tokens=None if stop is not None else n)
    return out[0, ids.shape[1]:].tolist()


def _toy(name: str, drafter: str):
    return (*toy_pair(name, drafter, prompts=10), 2)


def _random_prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 120, (1, n), generator=gen) for n in (5, 12, 3, 9, 7, 14, 4, 10, 6, 11)]


@pytest.fixture(scope="module")
def pairs():
    """name -> (target, its drafter or head, prompts, stop token or None), built on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            if name == "pure":
                built[name] = _toy("toy_pure", "drafter")
            elif name == "hybrid":
                built[name] = _toy("toy", "drafter")
            elif name == "hybrid_dflash2":
                target, _, prompts, stop = get("hybrid")
                built[name] = (target, DFlashDrafter.from_pretrained(ROOT / "assets" / "toy" / "drafter2",
                                                                     dtype=torch.float32), prompts, stop)
            elif name == "hybrid_mtp":
                from mtp_support import fitted_head

                target = tiny_model("qwen3_5_text", attn_implementation="sdpa")
                built[name] = target, fitted_head(target, steps=20), _random_prompts(), None
            elif name == "qwen3_eagle3":
                from eagle3_support import fitted_drafter

                target = tiny_model("qwen3", attn_implementation="sdpa")
                built[name] = target, fitted_drafter(target, steps=40), _random_prompts(), None
        return built[name]

    return get


CASES = [
    ("pure", dict(method="ar")), ("pure", dict(method="dflash")), ("pure", dict(method="ddtree", budget=16)),
    ("hybrid", dict(method="ar")), ("hybrid", dict(method="dflash")), ("hybrid", dict(method="ddtree", budget=16)),
    ("pure", dict(method="ddtree", budget="auto")), ("hybrid", dict(method="ddtree", budget="auto")),
    ("hybrid_dflash2", dict(method="ddtree", budget=16)),  # pair scoring (the drafter's selector)
    ("hybrid_dflash2", dict(method="dflash")),  # the selector's walk
    ("hybrid_mtp", dict(method="mtp", steps=3, topk=1)), ("hybrid_mtp", dict(method="mtp", steps=3, topk=2, budget=8)),
    ("qwen3_eagle3", dict(method="eagle3", steps=3, topk=1)),
    ("qwen3_eagle3", dict(method="eagle3", steps=3, topk=2, budget=6)),
]


@pytest.mark.parametrize("pair,kw", CASES, ids=[f"{p}-{'-'.join(f'{v}' for v in kw.values())}" for p, kw in CASES])
def test_every_stream_of_the_grid_is_greedy_decoding_alone(pairs, pair, kw):
    target, draft, prompts, stop = pairs(pair)
    refs = [hf_greedy(target, ids, NEW, stop) for ids in prompts]
    seen = []
    with Engine(target, None if kw["method"] == "ar" else draft, compile="false", **kw) as engine:
        for conc in CONCURRENCY:
            results = engine.generate_many(prompts, concurrency=conc, max_new_tokens=NEW,
                                           stop_token_ids=None if stop is None else [stop])
            for i, (ref, r) in enumerate(zip(refs, results, strict=True)):
                assert r.output_ids == ref, (pair, kw, conc, i)
            assert max(r.streams for r in results) == conc
            seen += results
    if kw["method"] != "ar":  # drafts accepted (budget=auto: in some call): the paths and their rollback exercised
        assert max(max(r.acceptance_lengths) for r in seen) >= 3
