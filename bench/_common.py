"""What every benchmark shares: the pairs it loads, the one stop-token rule, timing, and its JSON record.

    from _common import load_pair, timed, Record

A benchmark script in bench/ imports this module by name (Python puts the script's folder on sys.path);
nothing imports one benchmark script from another. Each run writes one record, docs/bench/<bench>.json
by default (`--json PATH` elsewhere, `--json -` for none), in the schema `python -m ddtree.docs` renders into
docs/benchmarks.md:

    {"schema": 1, "bench": NAME, "title": ..., "description": ..., "command": ..., "commit": ...,
     "machine": ..., "date": ..., "params": {...},
     "tables": [{"title": ..., "columns": [...], "rows": [[cell, ...], ...], "formats": {column: spec}}]}

A cell is a string, a number, null, or a timing {"median": m, "min": a, "max": b, "n": k} (rendered
"m (a–b)"); `formats` gives a column's number format ("{:.2f}", "{:.2f}x").
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # measure the checkout this file sits in, not whichever ddtree is installed
    sys.path.insert(0, str(ROOT))

from ddtree.noise import quiet_library_noise  # noqa: E402

quiet_library_noise()  # torchao's and torch's import noise (transformers imports torchao), as the CLIs drop it

import torch  # noqa: E402

# benchmarks measure what `python -m ddtree.run` runs: on a CPU target its engines tune glibc's malloc thresholds
# (host_allocator=true); a library Engine does that only when asked, and this asks for every Engine of a benchmark
os.environ.setdefault("DDTREE_HOST_MALLOC", "1")

BENCH_DIR = ROOT / "docs" / "bench"
SCHEMA = 1
TRAINED = {"toy": "toy (hybrid Qwen3.5 + trained DFlash)", "toy_pure": "toy_pure (Qwen3 + trained DFlash)"}


# ---------------------------------------------------------------- pairs

@dataclass
class Pair:
    """A target, its DFlash drafter, prompts ([1, P] token tensors) and the stop tokens of the answers workload."""

    name: str
    target: torch.nn.Module
    drafter: Any
    prompts: list[torch.Tensor]
    hybrid: bool
    stops: list[int] = field(default_factory=list)  # empty: no stop token (exactly max_new_tokens per prompt)


def stop_tokens(tokenizer, target) -> list[int]:
    """The stop tokens `python -m ddtree.run` uses, so a benchmark decodes what a run decodes."""
    from ddtree.pipeline.conversation import stop_token_ids

    return stop_token_ids(tokenizer, target)


def load_pair(name: str = "toy", n_prompts: int = 48, *, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> Pair | None:
    """A shipped trained pair (assets/<name>: target + DFlash drafter) and its first n held-out prompts, each
    through the chat template as `ddtree.run` encodes them; None when the pair is not built."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.engine.drafter import DFlashDrafter

    home = ROOT / "assets" / name
    if not ((home / "target" / "config.json").exists() and (home / "drafter" / "config.json").exists()):
        return None
    target = AutoModelForCausalLM.from_pretrained(home / "target", dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(home / "target")
    rows = [json.loads(x) for x in (home / "prompts.jsonl").read_text().splitlines() if x.strip()][:n_prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"].to(device) for r in rows]
    drafter = DFlashDrafter.from_pretrained(home / "drafter", dtype=dtype, device=device)
    hybrid = "linear_attention" in (getattr(target.config.get_text_config(), "layer_types", None) or ())
    return Pair(TRAINED.get(name, name), target, drafter, prompts, hybrid=hybrid, stops=stop_tokens(tok, target))


def random_pair(n_prompts: int = 4, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                prompt_len: int = 24, **shape: Any) -> Pair:
    """A tiny random pure-attention Qwen3 (default 6 x 192, vocab 1024) and a random drafter (block 16): tau is
    about 1 (acceptance is meaningless), costs are not. No stop token."""
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.tiny import tiny_model

    cfg = dict(vocab_size=1024, hidden_size=192, intermediate_size=576, num_hidden_layers=6, num_attention_heads=6,
               num_key_value_heads=3, head_dim=32, max_position_embeddings=4096)
    cfg.update(shape)
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", dtype=dtype, **cfg).to(device)
    target.generation_config.eos_token_id = None  # no stop for transformers' generate either
    drafter = DFlashDrafter.random_for_target(target.config, block_size=16).to(device=device, dtype=dtype)
    high = min(1000, cfg["vocab_size"])
    prompts = [torch.randint(4, high, (1, prompt_len), generator=torch.Generator().manual_seed(i)).to(device)
               for i in range(n_prompts)]
    return Pair("random Qwen3 + random DFlash", target, drafter, prompts, hybrid=False)


# ---------------------------------------------------------------- timing

@dataclass(frozen=True)
class Spread:
    """The median of several measurements and their range."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def scaled(self, k: float) -> Spread:
        return Spread(self.median * k, self.min * k, self.max * k, self.n)

    def cell(self, digits: int = 3) -> dict:
        return {"median": round(self.median, digits), "min": round(self.min, digits), "max": round(self.max, digits),
                "n": self.n}


def device_sync(device: str | torch.device | None) -> Callable[[], None]:
    """A function that waits for the device's queued work (nothing on a CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def timed(fn: Callable[[], Any], repeats: int, *, warmup: int = 1, sync: Callable[[], None] = lambda: None) -> Spread:
    """Seconds per call of fn: `warmup` untimed calls, then `repeats` timed ones, the device synced around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return Spread.of(times)


# ---------------------------------------------------------------- provenance

def machine() -> str:
    """CPU model, cores, load, GPU, torch/transformers versions and torch threads, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                 if x.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        tf = version("transformers")
    except PackageNotFoundError:
        tf = "absent"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores (load average {load}){gpu}; torch {torch.__version__}, "
            f"transformers {tf}, {torch.get_num_threads()} torch thread(s)")


def git_commit() -> str:
    """The checkout's short commit, with "+dirty" when tracked files differ from it; "unknown" outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    threads = os.environ.get("OMP_NUM_THREADS")
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join([f"OMP_NUM_THREADS={threads}"] * bool(threads) + ["python", str(script), *sys.argv[1:]])


# ---------------------------------------------------------------- the record

def add_json_arg(ap, bench: str) -> None:
    ap.add_argument("--json", default=str(BENCH_DIR / f"{bench}.json"),
                    help=f"where to write the JSON record (default docs/bench/{bench}.json; '-' for none)")


def params(args, **extra: Any) -> dict:
    """A record's settings: the script's arguments (not where the record goes) and what it worked out."""
    return {k: v for k, v in vars(args).items() if k != "json"} | extra


@dataclass
class Record:
    """One benchmark run: its tables, written as JSON with the command, commit, machine and date."""

    bench: str
    title: str
    description: str = ""
    params: dict = field(default_factory=dict)
    tables: list[dict] = field(default_factory=list)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              formats: dict[str, str] | None = None, note: str = "") -> None:
        t = {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}
        if formats:
            t["formats"] = dict(formats)
        if note:
            t["note"] = note
        self.tables.append(t)

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "bench": self.bench, "title": self.title, "description": self.description,
                "command": command_line(), "commit": git_commit(), "machine": machine(),
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "params": self.params,
                "tables": self.tables}

    def write(self, path: str | None) -> Path | None:
        """Write the record to `path` ('-' or None: nowhere) and say where; `make docs` renders it."""
        if not path or path == "-":
            return None
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.as_dict(), indent=1, ensure_ascii=False) + "\n")
        print(f"# record: {out} (make docs renders docs/benchmarks.md from docs/bench/)")
        return out
