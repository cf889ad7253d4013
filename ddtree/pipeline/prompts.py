"""Prompts: a local JSONL file or the built-in tiny set, and how a conversation becomes input ids."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ddtree.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    turns: tuple[str, ...]  # user messages; each later turn follows the model's previous answer


# Offline smoke prompts (ASCII, so the tiny character tokenizer covers them).
TINY_PROMPTS: tuple[Prompt, ...] = (
    Prompt("tiny-0", ("Write a short poem about the sea.",)),
    Prompt("tiny-1", ("What is 12 times 7?", "Now divide that by 3.")),
    Prompt("tiny-2", ("Give three tips for writing clear Python code.",)),
    Prompt("tiny-3", ("Explain speculative decoding in one sentence.",)),
    Prompt("tiny-4", ("List the first five prime numbers.",)),
    Prompt("tiny-5", ("def fibonacci(n):",)),
)


def text_lines(p: Path, setting: str = "dataset.path") -> list[tuple[int, str]]:
    """(line number, line) of every non-blank line of a UTF-8 text file; a file in another encoding is a
    ConfigError naming the first bad byte, not a UnicodeDecodeError."""
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(setting, f"{p.name} is not UTF-8 text (line {lineno}: byte 0x{data[e.start]:02x})",
                          f"convert it, e.g. iconv -f latin1 -t utf-8 {p.name} > fixed.jsonl") from None
    return [(i, ln) for i, ln in enumerate(text.removeprefix("\ufeff").splitlines(), 1) if ln.strip()]


def read_jsonl(path: str | Path) -> list[Prompt]:
    """Parse and check a prompt file: one {"id": str|int, "turns": [str, ...]} object per line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("dataset.path", f"no such file: {p}", "pass dataset.path=<an existing .jsonl file>")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, line in text_lines(p):
        where = f"{p.name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("dataset.path", f"{where} is not valid JSON ({e.msg}, column {e.colno})",
                              'fix that line: each line must be {"id": ..., "turns": ["..."]}') from None
        if not isinstance(obj, dict) or "id" not in obj or "turns" not in obj:
            raise ConfigError("dataset.path", f"{where} lacks 'id' or 'turns'",
                              'each line must be {"id": ..., "turns": ["..."]}')
        turns = obj["turns"]
        if isinstance(turns, str):
            turns = [turns]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ConfigError("dataset.path", f"{where}: 'turns' must be a non-empty list of non-empty strings",
                              'write e.g. "turns": ["Hello"]')
        pid = str(obj["id"])
        if pid in seen:
            raise ConfigError("dataset.path", f"{where}: duplicate id '{pid}'", "give every line its own id")
        seen.add(pid)
        prompts.append(Prompt(pid, tuple(turns)))
    if not prompts:
        raise ConfigError("dataset.path", f"{p} holds no prompts", "add one JSON object per line")
    return prompts


def load_prompts(name: str, path: str | None = None, *, max_samples: int | None = None,
                 shuffle_seed: int | None = None) -> list[Prompt]:
    prompts = list(TINY_PROMPTS) if name == "tiny" else read_jsonl(path)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(prompts)
    return prompts[:max_samples] if max_samples else prompts


def fingerprint(prompts: list[Prompt]) -> str:
    """A short hash of the prompts actually used (part of a job's identity for resume)."""
    h = hashlib.sha256(json.dumps([[p.id, list(p.turns)] for p in prompts]).encode())
    return h.hexdigest()[:16]


def encode(tokenizer, messages: list[dict[str, str]], *, chat_template: bool, enable_thinking: bool = False) -> list[int]:
    """Token ids for a conversation ending in a user message, ready for the assistant's answer."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("dataset.chat_template", "the tokenizer has no chat template",
                              "use dataset.chat_template=false to encode the prompt as raw text")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
        # the template already wrote any BOS token
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])
