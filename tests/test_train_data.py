"""Training stage `data`: the sequences the drafter learns from (chat spans, the target's own answers, hub chat data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_support import _pipeline_cfg, _target, _target_dir, _tiny_tokenizer
from transformers import AutoModelForCausalLM

from ddtree.train.config import to_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_text_sequences_span_the_assistant_turns(tmp_path: Path):
    from ddtree.train.data import read_sequences, text_sequences

    tok = _tiny_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello you"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]},
            {"text": "plain text row"}]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text_sequences(tok, str(src), tmp_path, log=lambda _: None)
    chat, plain = read_sequences(tmp_path / "sequences.jsonl")
    answers = [tok.decode(chat["input_ids"][s:e]) for s, e in chat["spans"]]
    assert answers == ["hello you<|im_end|>", "ok<|im_end|>"]
    assert plain["spans"] == [[1, len(plain["input_ids"])]]


def test_generated_answers_are_the_targets_greedy_output(tmp_path: Path):
    from ddtree.pipeline.prompts import encode
    from ddtree.train.data import generate_sequences, read_sequences

    tok = _tiny_tokenizer()
    target = _target()
    prompts = [{"id": i, "turns": [t]} for i, t in enumerate(["abc", "xyz", "hello there", "q"])]
    prompts.append({"id": "multi", "turns": ["one", "two"]})
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    stats = generate_sequences(target, tok, str(src), tmp_path, max_new_tokens=12, batch_size=2,
                               log=lambda _: None)
    recs = {r["id"]: r for r in read_sequences(tmp_path / "sequences.jsonl")}
    assert stats["sequences"] == 6 and set(recs) == {"0", "1", "2", "3", "multi#0", "multi#1"}
    for p in prompts[:4]:
        ids = encode(tok, [{"role": "user", "content": p["turns"][0]}], chat_template=True)
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=0)[0].tolist()
        ref = ref[:ref.index(tok.eos_token_id, len(ids)) + 1] if tok.eos_token_id in ref[len(ids):] else ref
        rec = recs[str(p["id"])]
        assert rec["input_ids"] == ref and rec["spans"] == [[len(ids), len(ref)]]


def test_hub_chat_dataset_answers_regenerated_by_the_target(tmp_path: Path):
    """data.source=hub reads a chat dataset through `datasets` (a local json file here: nothing downloaded)."""
    from ddtree.pipeline.prompts import encode
    from ddtree.train.config import HubDataConfig
    from ddtree.train.data import hub_prompts, read_sequences, text_sequences
    from ddtree.train.pipeline import run

    rows = [{"id": "a", "conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "their xyz"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"},
                                          {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"}]}]
    src = tmp_path / "chat.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hub = HubDataConfig(path="json", data_files=[str(src)], cache_dir=str(tmp_path / "cache"))
    assert [(p.id, p.turns) for p in hub_prompts(hub)] == [("a", ("abc",)), ("b", ("hello", "more"))]

    tok = _tiny_tokenizer()
    text_sequences(tok, None, tmp_path / "own", hub=hub, log=lambda _: None)  # regenerate=false: their answers
    own = read_sequences(tmp_path / "own" / "sequences.jsonl")
    assert [[tok.decode(r["input_ids"][s:e]) for s, e in r["spans"]] for r in own] == [
        ["their xyz<|im_end|>"], ["hi there<|im_end|>", "ok<|im_end|>"]]

    cfg = _pipeline_cfg(tmp_path, "hub", stages=["data"], **{
        "tracking.backend": "none", "data.source": "hub", "data.max_new_tokens": 6, "data.batch_size": 2,
        "data.hub": {"path": "json", "data_files": [str(src)], "cache_dir": str(tmp_path / "cache")}})
    run(to_train_config(cfg))
    recs = {r["id"]: r for r in read_sequences(tmp_path / "hub" / "data" / "sequences.jsonl")}
    assert set(recs) == {"a", "b#0", "b#1"}
    target = AutoModelForCausalLM.from_pretrained(_target_dir(tmp_path)).eval()
    ids = encode(tok, [{"role": "user", "content": "abc"}], chat_template=True)
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=0)[0].tolist()
    ref = ref[:ref.index(tok.eos_token_id, len(ids)) + 1] if tok.eos_token_id in ref[len(ids):] else ref
    assert recs["a"]["input_ids"] == ref and recs["a"]["spans"] == [[len(ids), len(ref)]]
