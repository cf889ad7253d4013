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
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import Prompt, encode, read_jsonl
from ddtree.train.config import HubDataConfig

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


def generate_sequences(model, tokenizer, prompts: str | list[Prompt], out_dir: Path, *, max_samples: int | None = None,
                       max_new_tokens: int = 256, temperature: float = 0.0, batch_size: int = 16,
                       chat_template: bool = True, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Answer every prompt turn with the target; resumable (a partial file keeps finished records).

    A multi-turn prompt gives one record per turn; later turns see the target's earlier answers.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(prompts, str | Path):
        prompts = read_prompts(str(prompts), "data.prompts")
    prompts = prompts[:max_samples or None]
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
    return {**sequence_stats(read_sequences(out_dir / SEQUENCES)), "seconds": time.perf_counter() - t0}


def generation_order(prompt_ids: list[str]) -> Callable[[dict], tuple]:
    """The sort key of the order generate_sequences writes records in: single-turn prompts by token
    length then prompt order (its batches), then multi-turn prompts turn by turn."""
    index = {pid: i for i, pid in enumerate(prompt_ids)}

    def key(rec: dict) -> tuple:
        if rec["id"] in index:
            return 0, rec["spans"][0][0], index[rec["id"]], 0
        pid, _, turn = rec["id"].rpartition("#")  # a multi-turn record is <prompt id>#<turn>
        return 1, 0, index[pid], int(turn)

    return key


def sequence_stats(records: list[dict]) -> dict:
    return {"sequences": len(records), "answer_tokens": sum(e - s for r in records for s, e in r["spans"]),
            "tokens": sum(len(r["input_ids"]) for r in records)}


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


def _text_rows(texts_path: str | None, hub: HubDataConfig | None) -> Iterator[tuple[int, dict]]:
    """(row number, row) of a JSONL file, or of a hub dataset with its chat normalised to {"messages"}."""
    if hub is not None:
        for i, row in enumerate(hub_rows(hub), 1):
            yield i, {"id": row.get("id", row.get("prompt_id", f"hub-{i}")), "messages": chat_messages(row, hub)}
        return
    with open(texts_path) as src:
        for lineno, line in enumerate(src, 1):
            if line.strip():
                yield lineno, json.loads(line)


def text_sequences(tokenizer, texts_path: str | None, out_dir: Path, *, hub: HubDataConfig | None = None,
                   max_samples: int | None = None, log: Callable[[str], None] = print) -> dict:
    """Records from given texts: chat rows ({"messages"}) train on assistant turns, raw rows ({"text"}) on all.

    The rows come from a JSONL file (`texts_path`) or from a hub chat dataset with its own answers.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    n = skipped = 0
    tmp = out_dir / PARTIAL
    with open(tmp, "w") as f:
        for lineno, row in _text_rows(texts_path, hub):
            if max_samples and n >= max_samples:
                break
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
    log(f"data: {n} sequences from {texts_path or hub.path} ({skipped} without a usable span)")
    return {"sequences": n, "skipped": skipped}


# ---------------------------------------------------------------- chat datasets through `datasets`

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
          "bot": "assistant", "system": "system"}


def hub_rows(hub: HubDataConfig):
    """The dataset's rows (streamed from the hub cache or the given data files)."""
    import datasets

    try:
        return datasets.load_dataset(hub.path, hub.name, split=hub.split, data_files=hub.data_files,
                                     revision=hub.revision, cache_dir=hub.cache_dir)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError("data.hub.path", f"cannot load {hub.path} ({hub.split}): {first[:200]}",
                          "pass a hub id (or json with data.hub.data_files=[...]) and an existing split") from None


def chat_messages(row: dict, hub: HubDataConfig) -> list[dict]:
    """A row's conversation as [{"role", "content"}], from "messages" (role/content) or "conversations" (from/value)."""
    field_name = hub.messages_field or next((k for k in ("messages", "conversations") if k in row), None)
    turns = row.get(field_name) if field_name else None
    if not isinstance(turns, list):
        raise ConfigError("data.hub.messages_field", f"row has no chat list (fields: {sorted(row)[:8]})",
                          "pass data.hub.messages_field=<the field holding the conversation>")
    out = []
    for t in turns:
        role = _ROLES.get(str(t.get("role", t.get("from", ""))).lower())
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            raise ConfigError("data.hub.messages_field", f"a turn is not role/content or from/value: {str(t)[:80]}",
                              "point data.hub.messages_field at a list of chat turns")
        out.append({"role": role, "content": content})
    return out


def hub_prompts(hub: HubDataConfig) -> list[Prompt]:
    """Prompts (the user turns, in order) of a chat dataset: the target writes the answers (regenerate)."""
    prompts = []
    for i, row in enumerate(hub_rows(hub)):
        turns = tuple(m["content"] for m in chat_messages(row, hub) if m["role"] == "user")
        if turns:
            prompts.append(Prompt(str(row.get("id", row.get("prompt_id", f"hub-{i}"))), turns))
    return prompts
