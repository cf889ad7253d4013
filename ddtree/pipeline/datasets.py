"""Benchmark prompts from the Hugging Face hub (or a local copy of their records), in the papers' formats.

A hub dataset is described in conf/dataset/<name>.yaml: its id, configuration, split, the field used
as prompt id, and a prompt `template` (str.format over the record's fields, plus conditional
`sections`); a dataset with several user turns (MT-Bench) names the field holding them
(`turns_field`). `max_samples` rows are drawn like the DFlash/DDTree benchmark scripts do:
when the split has more rows, the first `max_samples` of `datasets.Dataset.shuffle(seed)`, a numpy
`default_rng(seed).permutation` of the row indices; otherwise every row, in order.

Rows come from `datasets.load_dataset` (cached under HF_DATASETS_CACHE; HF_DATASETS_OFFLINE=1 or
HF_HUB_OFFLINE=1 read the cache only), from `dataset.path` (a JSONL file of records with the same
fields: the way to run offline without a cache), or, in code and tests, from a list of records.

    python -m ddtree.pipeline.datasets gsm8k mt_bench            # cache them, print the first prompt of each
    python -m ddtree.pipeline.datasets gsm8k --out data/         # also write data/gsm8k.jsonl (use as dataset.path=)
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree.errors import ConfigError
from ddtree.pipeline.prompts import Prompt, load_prompts, read_jsonl, text_lines

if TYPE_CHECKING:
    from ddtree.pipeline.schema import DatasetConfig

# the paper's dataset order (its tables and plots); others follow alphabetically
PAPER_ORDER = ("math500", "gsm8k", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe_bench_lite",
               "mt_bench", "alpaca")


def dataset_rank(name: str) -> tuple[int, str]:
    """Sort key: the paper's datasets in its order, then any other by name."""
    return (PAPER_ORDER.index(name), name) if name in PAPER_ORDER else (len(PAPER_ORDER), name)


LOCAL_DATASETS = ("tiny", "jsonl")


def dataset_label(ds: DatasetConfig) -> str:
    """The name records carry: the dataset's own, or a plain prompt file's name (dataset=jsonl)."""
    return Path(ds.path).stem if ds.name == "jsonl" and ds.path else ds.name
_FORMATTER = string.Formatter()


# ---------------------------------------------------------------- checks (no data is read)


def template_fields(template: str | None, setting: str = "dataset.template") -> list[str]:
    """The field names a template reads, in order; a malformed template is a ConfigError."""
    if not template:
        return []
    try:
        names = [f for _, f, _, _ in _FORMATTER.parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError(setting, f"is not a valid template ({e})",
                          "write fields as {name} and literal braces as {{ and }}") from None
    out = []
    for name in names:
        if not name or not name.isidentifier():
            raise ConfigError(setting, f"uses '{{{name}}}', which is not a field name",
                              "use {field} with a record field's name; literal braces are {{ and }}")
        if name not in out:
            out.append(name)
    return out


def record_fields(ds: DatasetConfig) -> list[str]:
    """The record fields a hub dataset's prompts are built from (what a local copy must have)."""
    names = [] if not ds.turns_field else [ds.turns_field]
    for name in template_fields(ds.template):
        if name not in ds.sections and name != "turn" and name not in names:
            names.append(name)
    for key, sec in ds.sections.items():
        for name in [sec.when, *template_fields(sec.then, f"dataset.sections.{key}.then"),
                     *template_fields(sec.otherwise, f"dataset.sections.{key}.otherwise")]:
            if name not in names:
                names.append(name)
    return names


def check_dataset(ds: DatasetConfig) -> None:
    """Every dataset setting that can be checked without reading data (called by config.validate)."""
    if ds.max_samples is not None and ds.max_samples < 1:
        raise ConfigError("dataset.max_samples", f"must be >= 1, got {ds.max_samples}", "use null for all prompts")
    if ds.hub is None:
        if ds.name not in LOCAL_DATASETS and not ds.path:
            raise ConfigError("dataset.name", f"unknown value '{ds.name}'",
                              "use tiny, jsonl, or a benchmark config (dataset=gsm8k, ...) that sets dataset.hub")
        if ds.name != "tiny":  # a prompt file; its name is the label records and reports carry (dataset=toy)
            if not ds.path:
                raise ConfigError("dataset.path", "is required for dataset=jsonl", "pass dataset.path=<file.jsonl>")
            read_jsonl(ds.path)  # parses, and so checks, every line
        return
    if ds.name in LOCAL_DATASETS:
        raise ConfigError("dataset.name", f"'{ds.name}' is a local dataset, but dataset.hub={ds.hub} is set",
                          "use dataset.hub=null, or give the hub dataset its own name")
    if not ds.template and not ds.turns_field:
        raise ConfigError("dataset.template", f"is not set for the hub dataset '{ds.name}'",
                          "set dataset.template (e.g. '{question}'), or dataset.turns_field for multi-turn records")
    fields = template_fields(ds.template)
    if "turn" in fields and not ds.turns_field:
        raise ConfigError("dataset.template", "uses {turn}, which only exists with dataset.turns_field",
                          "name the record field instead, or set dataset.turns_field")
    record_fields(ds)  # checks every section's templates
    if ds.path is not None and not Path(ds.path).expanduser().is_file():
        raise ConfigError("dataset.path", f"no such file: {Path(ds.path).expanduser()}",
                          f"pass dataset.path=<a .jsonl of {ds.name} records>, or dataset.path=null to use the hub")


# ---------------------------------------------------------------- formatting


def _render(template: str, fields: Mapping[str, Any], setting: str, ds: DatasetConfig) -> str:
    try:
        return _FORMATTER.vformat(template, (), fields)
    except KeyError as e:
        have = ", ".join(sorted(k for k in fields if not k.startswith("_"))) or "none"
        raise ConfigError(setting, f"reads the field {e}, which the {ds.name} record lacks (it has: {have})",
                          "use a field the records have, or pass dataset.path=<.jsonl with that field>") from None
    except (IndexError, ValueError, AttributeError) as e:
        raise ConfigError(setting, f"cannot format a {ds.name} record ({e})",
                          "write fields as {name} and literal braces as {{ and }}") from None


def format_turns(ds: DatasetConfig, record: Mapping[str, Any]) -> tuple[str, ...]:
    """The user turns of one record under the dataset's prompt format."""
    fields: dict[str, Any] = dict(record)
    for key, sec in ds.sections.items():
        piece = sec.then if record.get(sec.when) else sec.otherwise
        fields[key] = _render(piece, record, f"dataset.sections.{key}", ds)
    if ds.turns_field:
        if ds.turns_field not in record:
            have = ", ".join(sorted(record)) or "none"
            raise ConfigError("dataset.turns_field", f"'{ds.turns_field}' is not a field of the {ds.name} "
                              f"record (it has: {have})", "set dataset.turns_field to the field holding the turns")
        raw = record[ds.turns_field]
        turns = [raw] if isinstance(raw, str) else list(raw)
        if ds.template:
            turns = [_render(ds.template, {**fields, "turn": t}, "dataset.template", ds) for t in turns]
    else:
        turns = [_render(ds.template, fields, "dataset.template", ds)]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ConfigError("dataset.template", f"gives an empty user turn for a {ds.name} record",
                          "check the template and the record's fields")
    return tuple(turns)


def sample_indices(n: int, max_samples: int | None, seed: int | None) -> list[int]:
    """Row indices as the authors' scripts pick them: `Dataset.shuffle(seed).select(range(k))` when
    there are more rows than max_samples (a numpy default_rng(seed) permutation), else all in order."""
    if max_samples is None or n <= max_samples:
        return list(range(n))
    if seed is None:
        return list(range(max_samples))
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).permutation(n)[:max_samples]]


def _build_prompts(ds: DatasetConfig, rows: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[Prompt]:
    prompts, seen = [], set()
    for i, rec in zip(indices, rows, strict=True):
        pid = rec.get(ds.id_field) if ds.id_field else None
        pid = str(i) if pid is None else str(pid)  # default: the row's index in the split
        if pid in seen:  # ids are labels in samples.jsonl: keep them unique
            pid = f"{pid}#{i}"
        seen.add(pid)
        prompts.append(Prompt(pid, format_turns(ds, rec)))
    return prompts


def prompts_from_records(ds: DatasetConfig, records: Sequence[Mapping[str, Any]]) -> list[Prompt]:
    """The sampled, formatted prompts of a hub dataset from its rows (in the split's order)."""
    indices = sample_indices(len(records), ds.max_samples, ds.shuffle_seed)
    return _build_prompts(ds, [records[i] for i in indices], indices)


# ---------------------------------------------------------------- loading


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """A local copy of a hub dataset: one JSON object (a record with the hub's fields) per line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("dataset.path", f"no such file: {p}", "pass dataset.path=<an existing .jsonl file>")
    out = []
    for lineno, line in text_lines(p):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("dataset.path", f"{p.name} line {lineno} is not valid JSON ({e.msg}, column {e.colno})",
                              "fix that line: one JSON object per line") from None
        if not isinstance(obj, dict):
            raise ConfigError("dataset.path", f"{p.name} line {lineno} is not a JSON object",
                              "write one record ({\"field\": value, ...}) per line")
        out.append(obj)
    if not out:
        raise ConfigError("dataset.path", f"{p} holds no records", "add one JSON object per line")
    return out


def _offline() -> bool:
    flags = (os.environ.get(k, "").strip().lower() for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    return any(v in ("1", "true", "yes", "on") for v in flags)


def _how_to_provide(ds: DatasetConfig) -> str:
    fields = ", ".join(record_fields(ds) + ([ds.id_field] if ds.id_field else []))
    return (f"run `python -m ddtree.pipeline.datasets {ds.name} --out DIR` once where the hub is reachable (it caches the "
            f"data and writes DIR/{ds.name}.jsonl), then pass dataset.path=DIR/{ds.name}.jsonl; any .jsonl with "
            f"one record per line and the fields {fields} works")


def load_hub(ds: DatasetConfig, cache_dir: str | None = None):
    """The split as a `datasets.Dataset` (cached; offline it reads the cache or raises ConfigError)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("dataset", f"dataset={ds.name} needs the 'datasets' package, which is not installed",
                          f"pip install datasets, or {_how_to_provide(ds)}") from None
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    kw: dict[str, Any] = {"split": ds.split or "train", "cache_dir": cache_dir}
    if ds.data_files:
        kw["data_files"] = list(ds.data_files)
    if ds.revision:
        kw["revision"] = ds.revision
    try:
        return datasets.load_dataset(ds.hub, ds.subset, **kw)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, DatasetNotFoundError, ...)
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        where = f"{ds.hub}" + (f" ({ds.subset})" if ds.subset else "") + f" split {kw['split']}"
        if _offline():
            problem = f"{where} is not in the local datasets cache, and the hub is off (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE)"
        else:
            problem = f"could not load {where}: {type(e).__name__}: {first[:200]}"
        raise ConfigError("dataset", problem, _how_to_provide(ds)) from None


def load_dataset_prompts(ds: DatasetConfig, records: Sequence[Mapping[str, Any]] | None = None, *,
                         cache_dir: str | None = None) -> list[Prompt]:
    """The prompts a job runs: built-in (tiny), a prompt file (jsonl), or a hub dataset in its format.

    `records` stands in for the hub dataset's rows (tests, notebooks); `dataset.path` for a local copy.
    """
    if ds.hub is None:
        return load_prompts(ds.name, ds.path, max_samples=ds.max_samples, shuffle_seed=ds.shuffle_seed)
    if records is None and ds.path:
        records = read_records(ds.path)
    if records is not None:
        return prompts_from_records(ds, records)
    data = load_hub(ds, cache_dir)
    indices = sample_indices(len(data), ds.max_samples, ds.shuffle_seed)
    return _build_prompts(ds, list(data.select(indices)), indices)  # only the rows used are decoded


# ---------------------------------------------------------------- CLI: cache / export


def _dataset_config(name: str) -> DatasetConfig:
    from omegaconf import OmegaConf

    from ddtree.pipeline.schema import CONF_DIR, DatasetConfig

    f = CONF_DIR / "dataset" / f"{name}.yaml"
    if not f.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml"))
        raise ConfigError("dataset", f"unknown option '{name}'", f"use one of: {', '.join(names)}")
    node = OmegaConf.merge(OmegaConf.structured(DatasetConfig), OmegaConf.load(f))
    return OmegaConf.to_object(node)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m ddtree.pipeline.datasets", description="Cache hub benchmarks and "
                                 "optionally export their records as JSONL for offline machines (dataset.path=).")
    ap.add_argument("names", nargs="+", help="dataset configs, e.g. gsm8k math500 mt_bench")
    ap.add_argument("--out", type=Path, default=None, help="write OUT/<name>.jsonl: every record, all fields")
    args = ap.parse_args(argv)
    try:
        for name in args.names:
            ds = _dataset_config(name)
            if ds.hub is None:
                raise ConfigError("dataset", f"'{name}' is not a hub dataset", "name a benchmark config such as gsm8k")
            data = load_hub(ds)
            prompts = load_dataset_prompts(ds)
            print(f"{name}: {ds.hub} {ds.split}: {len(data)} rows, {len(prompts)} prompts "
                  f"(max_samples={ds.max_samples}, shuffle_seed={ds.shuffle_seed})")
            print("  first prompt, turn 1: " + prompts[0].turns[0][:300].replace("\n", "\n  "))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                target = args.out / f"{name}.jsonl"
                with target.open("w", encoding="utf-8") as f:
                    for row in data:
                        f.write(json.dumps(row, default=str) + "\n")
                print(f"  wrote {target} (use dataset={name} dataset.path={target})")
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
