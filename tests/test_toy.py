"""The shipped toy pair (assets/toy): its corpus, tokenizer and losslessness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_support import ASSETS, _toy_module
from transformers import AutoModelForCausalLM

from ddtree.engine.drafter import DFlashDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


def test_toy_corpus_is_deterministic_and_holds_prompts_out():
    corpus = _toy_module("corpus")
    a = corpus.build(num_train=600, num_valid=20, num_prompts=18, num_train_prompts=50, seed=3)
    b = corpus.build(num_train=600, num_valid=20, num_prompts=18, num_train_prompts=50, seed=3)
    assert a == b
    held = {p["turns"][0] for p in a["prompts"]}
    assert len(held) == 18 and len({p["category"] for p in a["prompts"]}) == 9
    assert not held & {r["messages"][0]["content"] for r in a["train"] + a["valid"]}
    assert len(a["train_prompts"]) == 50 and not held & {p["turns"][0] for p in a["train_prompts"]}


def test_toy_tokenizer_chat_template(tmp_path: Path):
    corpus, tokenizer = _toy_module("corpus"), _toy_module("tokenizer")
    data = corpus.build(num_train=300, num_valid=10, num_prompts=9, num_train_prompts=10)
    tok = tokenizer.train_tokenizer([tokenizer.render(r["messages"]) for r in data["train"]], vocab_size=400)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    msgs = data["train"][0]["messages"]
    text = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.render(msgs[:1]) + "<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|mask|>") == 3
    ids = tok(tokenizer.render(msgs), add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == tokenizer.render(msgs)


@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="assets/toy not built (make toy)")
def test_shipped_toy_pair_is_lossless():
    from transformers import AutoTokenizer

    import ddtree
    from ddtree.pipeline.prompts import encode, read_jsonl

    target = AutoModelForCausalLM.from_pretrained(ASSETS / "target").eval()
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    drafter = DFlashDrafter.from_pretrained(ASSETS / "drafter")
    drafter.check_compatible(target)
    assert sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()) <= 20 * 2**20
    prompt = read_jsonl(ASSETS / "prompts.jsonl")[0]
    ids = torch.tensor([encode(tok, [{"role": "user", "content": prompt.turns[0]}], chat_template=True)])
    ar = ddtree.generate(target, None, ids, method="ar", max_new_tokens=40, stop_token_ids=[tok.eos_token_id])
    assert ar.output_ids[-1] == tok.eos_token_id  # the toy target ends its answers
    tree = ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=40,
                           stop_token_ids=[tok.eos_token_id])
    assert tree.output_ids == ar.output_ids and tree.tau > 2
