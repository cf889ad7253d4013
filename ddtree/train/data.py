"""Stage 1, data: token sequences whose assistant parts the drafter learns to predict.

A sequence record is {"id", "input_ids": [...], "spans": [[start, end], ...]}: spans are the
token ranges the target wrote (its answers, eos included); anchors are drawn only there.

Sources: the target answering prompts itself (greedy or sampled; what it will be asked to do
at inference), or given texts (chat messages or raw text).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import encode, read_jsonl

SEQUENCES = "sequences.jsonl"
PARTIAL = "sequences.jsonl.partial"


def read_sequences(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_prompts(path: str, setting: str):
    """The run pipeline's prompt file format, with errors naming this stage's setting."""
    try:
        return read_jsonl(path)
    except ConfigError as e:
        raise ConfigError(setting, e.problem, e.fix) from None


def stop_ids(tokenizer, model) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return sorted(ids)


@torch.no_grad()
def generate_answers(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     stop_token_ids: list[int], pad_token_id: int, generator_seed: int = 0) -> list[list[int]]:
    """The target's answers to prompts of equal token length, cut after the first stop token."""
    assert len({len(p) for p in prompts}) == 1, "batch prompts of one length (no padding)"
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    kw = dict(do_sample=False)
    if temperature > 0:
        torch.manual_seed(generator_seed)
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=stop_token_ids, pad_token_id=pad_token_id, **kw)
    answers = []
    stops = set(stop_token_ids)
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:cut])
    return answers


def generate_sequences(model, tokenizer, prompts_path: str, out_dir: Path, *, max_samples: int | None = None,
                       max_new_tokens: int = 256, temperature: float = 0.0, batch_size: int = 16,
                       chat_template: bool = True, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Answer every prompt turn with the target; resumable (a partial file keeps finished records).

    A multi-turn prompt gives one record per turn; later turns see the target's earlier answers.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(prompts_path, "data.prompts")[:max_samples or None]
    partial = out_dir / PARTIAL
    done = {r["id"] for r in read_sequences(partial)} if partial.exists() else set()
    stops = stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stops, pad_token_id=pad)
    t0, n_new, n_tok = time.perf_counter(), 0, 0

    with open(partial, "a") as f:
        def emit(rid: str, prompt_ids: list[int], answer: list[int]) -> None:
            nonlocal n_new, n_tok
            rec = {"id": rid, "input_ids": prompt_ids + answer,
                   "spans": [[len(prompt_ids), len(prompt_ids) + len(answer)]]}
            f.write(json.dumps(rec) + "\n")
            n_new, n_tok = n_new + 1, n_tok + len(answer)

        # single-turn prompts: batched by token length
        single = [p for p in prompts if len(p.turns) == 1 and p.id not in done]
        by_len: dict[int, list[tuple[str, list[int]]]] = {}
        for p in single:
            ids = encode(tokenizer, [{"role": "user", "content": p.turns[0]}], chat_template=chat_template)
            by_len.setdefault(len(ids), []).append((p.id, ids))
        batches = [g[i:i + batch_size] for _, g in sorted(by_len.items()) for i in range(0, len(g), batch_size)]
        for b, batch in enumerate(batches):
            answers = generate_answers(model, [ids for _, ids in batch], generator_seed=seed + b, **gen)
            for (rid, ids), ans in zip(batch, answers, strict=True):
                emit(rid, ids, ans)
            f.flush()
            if (b + 1) % 10 == 0 or b + 1 == len(batches):
                dt = time.perf_counter() - t0
                log(f"data: {n_new} answers, {n_tok / dt:.0f} tokens/s ({b + 1}/{len(batches)} batches)")

        # multi-turn prompts: one record per turn, turns in order
        for p in prompts:
            if len(p.turns) == 1:
                continue
            messages: list[dict] = []
            for t, turn in enumerate(p.turns):
                rid = f"{p.id}#{t}"
                messages.append({"role": "user", "content": turn})
                ids = encode(tokenizer, messages, chat_template=chat_template)
                ans = generate_answers(model, [ids], generator_seed=seed + t, **gen)[0]
                if rid not in done:
                    emit(rid, ids, ans)
                text = tokenizer.decode([x for x in ans if x not in stops], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
            f.flush()
    os.replace(partial, out_dir / SEQUENCES)
    records = read_sequences(out_dir / SEQUENCES)
    stats = {"sequences": len(records), "answer_tokens": sum(e - s for r in records for s, e in r["spans"]),
             "tokens": sum(len(r["input_ids"]) for r in records), "seconds": time.perf_counter() - t0}
    return stats


def _chat_spans(tokenizer, messages: list[dict]) -> tuple[list[int], list[list[int]]]:
    """Token ids of a whole conversation and the span of each assistant turn (through its eos)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = list(tokenizer(full, add_special_tokens=False)["input_ids"])
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        start = len(tokenizer(head, add_special_tokens=False)["input_ids"])
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        end = len(tokenizer(upto, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id in ids[start:end]:  # the template's tail after eos is not the answer
            end = start + ids[start:end].index(tokenizer.eos_token_id) + 1
        if end - start >= 2:
            spans.append([start, end])
    return ids, spans


def text_sequences(tokenizer, texts_path: str, out_dir: Path, *, max_samples: int | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """Records from given texts: chat rows ({"messages"}) train on assistant turns, raw rows ({"text"}) on all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n = skipped = 0
    tmp = out_dir / PARTIAL
    with open(texts_path) as src, open(tmp, "w") as f:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            if max_samples and n >= max_samples:
                break
            row = json.loads(line)
            if "messages" in row:
                ids, spans = _chat_spans(tokenizer, row["messages"])
            elif "text" in row:
                ids = list(tokenizer(row["text"])["input_ids"])
                spans = [[1, len(ids)]] if len(ids) >= 3 else []
            else:
                raise ConfigError("data.texts", f"line {lineno} has neither 'messages' nor 'text'",
                                  'write {"messages": [...]} or {"text": "..."} per line')
            if not spans:
                skipped += 1
                continue
            f.write(json.dumps({"id": str(row.get("id", f"text-{lineno}")), "input_ids": ids, "spans": spans}) + "\n")
            n += 1
    os.replace(tmp, out_dir / SEQUENCES)
    log(f"data: {n} sequences from {texts_path} ({skipped} without a usable span)")
    return {"sequences": n, "skipped": skipped}
