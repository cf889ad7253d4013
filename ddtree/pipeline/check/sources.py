"""Where `python -m ddtree.check` gets another engine's outputs: a server (ddtree.pipeline.endpoint) or a JSONL
file, and how each answer becomes the token ids the verdict reads (the server's own ids, else the text
re-tokenized by the target's tokenizer, refused when it does not round-trip)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import Prompt, text_lines

REPEAT_SEP = "@"  # a repeated prompt's records carry "<prompt id>@<repeat>" (repeat 0 keeps the plain id)


@dataclass
class FileOutputs:
    """A file source: its prompts, and per prompt id the outputs of its turns (text or ids, as saved)."""

    prompts: list[Prompt]  # one per output: a repeat of a prompt is "<id>@<repeat>"
    outputs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # id -> [{"ids"|"text", "finish_reason"}]
    sha256: str = ""
    prompt_of: dict[str, tuple[str, int]] = field(default_factory=dict)  # output id -> (prompt id, repeat)

    @property
    def repeats(self) -> int:
        return 1 + max((k for _, k in self.prompt_of.values()), default=0)


def repeat_id(pid: str, k: int) -> str:
    return pid if k == 0 else f"{pid}{REPEAT_SEP}{k}"


def expand_repeats(prompts: list[Prompt], repeats: int) -> list[Prompt]:
    """Each prompt `repeats` times, as prompts of their own (one record per repeat, same turns)."""
    return [Prompt(repeat_id(p.id, k), p.turns) for p in prompts for k in range(repeats)]


def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) and (not v or not isinstance(v[0], int) or isinstance(v[0], bool)) else [v]


def read_output_file(path: str | Path, setting: str = "file.path") -> FileOutputs:
    """Parse a file of outputs: one {"id", "prompt" | "turns", "output_ids" | "output"[, "finish_reason", "repeat"]}
    a line.

    Multi-turn: "turns" lists the user turns and "output"/"output_ids" one answer per turn (a list of them).
    Samples of one prompt (T > 0): lines with the same id and prompt, told apart by "repeat" (0, 1, ...)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(setting, f"no such file: {p}", f"pass {setting}=<a .jsonl of saved outputs>")
    prompts: list[Prompt] = []
    outputs: dict[str, list[dict[str, Any]]] = {}
    prompt_of: dict[str, tuple[str, int]] = {}
    turns_of: dict[str, list[str]] = {}
    shape = '{"id": ..., "prompt": "...", "output": "..."} (or "turns": [...], "output_ids": [...])'
    for lineno, line in text_lines(p, setting):
        where = f"{p.name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(setting, f"{where} is not valid JSON ({e.msg}, column {e.colno})",
                              f"each line must be {shape}") from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise ConfigError(setting, f"{where} has no 'id'", f"each line must be {shape}")
        turns = obj.get("turns", obj.get("prompt"))
        turns = [turns] if isinstance(turns, str) else turns
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ConfigError(setting, f"{where}: 'prompt' (a string) or 'turns' (a list of strings) is missing or "
                              "empty", f"each line must be {shape}")
        if "output_ids" in obj:
            answers = _as_list(obj["output_ids"])
            ok = all(isinstance(a, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in a) for a in answers)
            kind = "ids"
        elif "output" in obj:
            answers = _as_list(obj["output"])
            ok = all(isinstance(a, str) for a in answers)
            kind = "text"
        else:
            raise ConfigError(setting, f"{where} has neither 'output' nor 'output_ids'", f"each line must be {shape}")
        if not ok:
            raise ConfigError(setting, f"{where}: '{'output_ids' if kind == 'ids' else 'output'}' must be "
                              f"{'a list of token ids (ints >= 0)' if kind == 'ids' else 'a string'} per turn",
                              f"each line must be {shape}")
        if len(answers) != len(turns):
            raise ConfigError(setting, f"{where}: {len(turns)} user turn(s) but {len(answers)} answer(s)",
                              "give one answer per turn")
        pid, k = str(obj["id"]), obj.get("repeat", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(setting, f"{where}: 'repeat' must be a whole number >= 0, got {k!r}",
                              "number the samples of one prompt 0, 1, 2, ...")
        key = repeat_id(pid, k)
        if key in outputs:
            raise ConfigError(setting, f"{where}: duplicate id '{pid}'" + (f" with repeat {k}" if k else ""),
                              "give every line its own id (samples of one prompt: its own 'repeat')")
        if turns_of.setdefault(pid, turns) != turns:
            raise ConfigError(setting, f"{where}: id '{pid}' was given another prompt on an earlier line",
                              "give every prompt its own id")
        finish = obj.get("finish_reason")
        finishes = finish if isinstance(finish, list) else [finish] * len(answers)
        prompts.append(Prompt(key, tuple(turns)))
        prompt_of[key] = (pid, k)
        outputs[key] = [{kind: a, "finish_reason": f} for a, f in zip(answers, finishes, strict=False)]
    if not prompts:
        raise ConfigError(setting, f"{p} holds no outputs", f"write one line per output: {shape}")
    return FileOutputs(prompts, outputs, hashlib.sha256(p.read_bytes()).hexdigest()[:16], prompt_of)


def stop_for(tokenizer, stops: list[int]) -> int | None:
    """The stop token appended where an engine stopped without returning it: the tokenizer's EOS if it is one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if eos in stops else (stops[0] if stops else None)


def output_token_ids(*, text: str | None, ids: list[int] | None, finish_reason: str | None, tokenizer,
                     stops: list[int], max_new_tokens: int, where: str, setting: str, fix: str,
                     vocab_size: int, reported: int | None = None) -> dict[str, Any]:
    """The ids the verdict reads, and how they were obtained.

    The engine's ids when it gave them; else its text, re-tokenized by the target's tokenizer (refused when
    decoding those ids does not give the text back). An output that stopped (finish_reason 'stop', or shorter
    than max_new_tokens with no reason given) without its stop token gets it appended: the check then asks
    whether the target chose to stop there."""
    got: dict[str, Any] = {"ids_from": "engine" if ids is not None else "text", "stop_appended": False}
    if ids is None:
        ids = list(tokenizer(text or "", add_special_tokens=False)["input_ids"])
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != (text or ""):
            raise ConfigError(setting, f"{where}: the target's tokenizer does not round-trip the text "
                              f"({(text or '')[:60]!r} -> {len(ids)} ids -> {back[:60]!r})", fix)
        if reported is not None and reported not in (len(ids), len(ids) + 1):  # + 1: a stop token it counted
            raise ConfigError(setting, f"{where}: the target's tokenizer does not round-trip the text: it reads "
                              f"{len(ids)} tokens where the engine generated {reported}", fix)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(setting, f"{where}: token id {bad} is outside the target's vocabulary ({vocab_size})",
                          "check that the engine served the same target (model=...)")
    stopped = finish_reason == "stop" or (finish_reason is None and len(ids) < max_new_tokens)
    if stopped and (not ids or ids[-1] not in stops) and len(ids) < max_new_tokens:
        stop = stop_for(tokenizer, stops)
        if stop is not None:
            ids = [*ids, stop]
            got["stop_appended"] = True
    got["output_ids"] = ids
    return got
