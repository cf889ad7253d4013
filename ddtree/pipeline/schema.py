"""The typed run configuration (Hydra ConfigStore schema) and its validation.

Every check here runs before any model is loaded and raises `ConfigError(setting, problem, fix)`.
Heavy imports (torch, transformers) happen only for the checks that need them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddtree.errors import ConfigError
from ddtree.pipeline.datasets import check_dataset
from ddtree.pipeline.distributed import check_device_map

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

METHODS = ("ar", "dflash", "ddtree")
TREE_METHODS = ("ddtree",)  # methods that verify a branching tree (need a tree attention mask)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_KINDS = ("none", "pretrained", "random")
DATASETS = ("tiny", "jsonl")
TRACKERS = ("mlflow", "none")
ENGINES = ("native", "upstream")  # upstream: the DDTree authors' code (ddtree.upstream.engine)
BUILTIN_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
# backends that need a package beyond torch: backend -> (importable module, pip name)
ATTENTION_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                      "flash_attention_3": ("flash_attn_interface", "flash-attn-3")}
# tree-verifying implementations (ddtree.attention; the engine switches a tree method's target to the one
# wrapping its backend) -> the backend each wraps. Mirrors ddtree.engine.attention.SPLIT_IMPLEMENTATIONS.
SPLIT_ATTENTION = {"ddtree_split": "sdpa", "ddtree_split_eager": "eager", "ddtree_split_fa2": "flash_attention_2",
                   "ddtree_split_fa3": "flash_attention_3", "ddtree_flex": "flex_attention"}
TREE_BACKENDS = tuple(SPLIT_ATTENTION.values())  # backends a draft tree can be verified on
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


# ---------------------------------------------------------------- schema


@dataclass
class TinyModelConfig:
    """A random model built in-process with ddtree.testing.tiny.tiny_model (no download)."""

    model_type: str = "qwen3"
    seed: int = 0
    vocab_size: int = 128
    num_hidden_layers: int = 4


@dataclass
class ModelConfig:
    name: str = MISSING  # short label used in run names and messages
    name_or_path: str | None = None  # hub id or local dir; null for tiny models
    tiny: TinyModelConfig | None = None
    tokenizer: str | None = None  # defaults to name_or_path
    revision: str | None = None
    dtype: str = "auto"  # auto: the checkpoint's dtype (float32 for tiny models)
    trust_remote_code: bool = False
    hybrid: bool = False  # has linear-attention (recurrent) layers
    # null: the whole model on `device`; auto | balanced | balanced_low_0 | sequential | {module: device}:
    # accelerate splits its layers over the GPUs (see ddtree.pipeline.distributed)
    device_map: Any = None


@dataclass
class DrafterConfig:
    kind: str = "none"  # none | pretrained (hub id or dir) | random (DFlashDrafter.random_for_target)
    name_or_path: str | None = None
    target: str | None = None  # the target it was trained for; checked before loading (null: skip)
    block_size: int | None = None  # override; null: the checkpoint's (random: 16)
    dtype: str | None = None  # null: model.dtype
    revision: str | None = None
    # random drafters only
    num_layers: int = 1
    seed: int = 0
    target_layer_ids: list[int] | None = None


@dataclass
class AttentionConfig:
    target: str = "sdpa"
    drafter: str = "sdpa"


@dataclass
class PromptSection:
    """A conditional piece of a prompt template (see ddtree.pipeline.datasets.format_turns)."""

    when: str = MISSING  # a record field: `then` is used when it is non-empty, `otherwise` when not
    then: str = ""
    otherwise: str = ""


@dataclass
class DatasetConfig:
    name: str = "tiny"  # tiny (built-in prompts) | jsonl | a hub dataset's label (with `hub` set)
    path: str | None = None  # jsonl: {"id", "turns"} per line; hub datasets: local records with the hub's fields
    chat_template: bool = True  # false: encode the user turn as raw text
    enable_thinking: bool = False
    max_samples: int | None = None
    shuffle_seed: int | None = None  # null: file order
    # hub datasets (conf/dataset/<benchmark>.yaml), loaded with `datasets`; see ddtree.pipeline.datasets
    title: str | None = None  # display name in reports (null: name)
    hub: str | None = None  # Hugging Face dataset id
    subset: str | None = None  # its configuration (gsm8k: main)
    split: str | None = None
    data_files: list[str] | None = None  # files inside the hub repo (livecodebench)
    revision: str | None = None
    id_field: str | None = None  # the record field used as prompt id (null: the row index)
    turns_field: str | None = None  # a field holding a list of user turns (mt_bench: prompt)
    template: str | None = None  # str.format over the record's fields and `sections` ({turn} with turns_field)
    sections: dict[str, PromptSection] = field(default_factory=dict)


@dataclass
class TrackingConfig:
    backend: str = "mlflow"  # mlflow | none
    uri: str | None = None  # null: sqlite:///<runs_dir>/mlflow.db
    experiment: str = "ddtree"


@dataclass
class CompatConfig:
    enabled: bool = True
    only: list[str] | None = None  # apply only these patches (null: all that match)
    skip: list[str] = field(default_factory=list)


@dataclass
class UpstreamConfig:
    path: str | None = None  # engine=upstream: a checkout of the DDTree authors' repository (their ddtree.py, ...)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    method: str = "ddtree"  # set by the `method` group
    budget: int = 64  # DDTree node budget (excluding the root)
    temperature: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    baseline: bool = True  # also run AR on each prompt in the same job
    # reuse the AR baseline an earlier job of this process ran on the same prompts and settings (a sweep over
    # methods and budgets decodes each prompt with AR once, as the paper does); false: AR in every job
    baseline_reuse: bool = True
    force: bool = False  # rerun even if this config already finished in the tracking store
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    warmup: bool = True  # one untimed short generation per method after loading
    engine: str = "native"
    runs_dir: str = "runs"
    tags: dict[str, str] = field(default_factory=dict)  # extra MLflow tags (experiment configs set tags.experiment)


def _register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="ddtree_schema", node=RunConfig)
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))


_register()

# keys that do not change what a job computes: left out of its identity (resume)
NON_IDENTITY_KEYS = ("force", "runs_dir", "tracking", "tags", "baseline_reuse")


# ---------------------------------------------------------------- conversion


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), str(text))


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The composed DictConfig as a RunConfig; missing or mistyped values become ConfigError."""
    if isinstance(cfg, RunConfig):
        return cfg
    try:
        node = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), node)
        rc = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        msg = _first_line(getattr(e, "msg", None) or str(e))
        if type(e).__name__ == "MissingMandatoryValue":
            raise ConfigError(key, "is required but not set", f"pass {key}=<value>") from None
        raise ConfigError(key, msg) from None
    refuse_unknown_keys(rc)
    return rc


def refuse_unknown_keys(obj: Any, prefix: str = "", cli: str = "ddtree.run") -> None:
    """`+key=value` slips past the schema; a setting nothing reads is a typo, so say so."""
    names = {f.name for f in fields(obj)}
    for k, v in vars(obj).items():
        if k not in names:
            raise ConfigError(f"{prefix}{k}", "is not a setting", f"remove it (python -m {cli} --cfg job "
                              "prints every setting)")
        if is_dataclass(v):
            refuse_unknown_keys(v, f"{prefix}{k}.", cli)


def resolved_dict(cfg: DictConfig | RunConfig) -> dict[str, Any]:
    """The resolved config as plain data, without the hydra node."""
    if isinstance(cfg, RunConfig):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    d = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    d.pop("hydra", None)
    return d


def identity_dict(cfg: DictConfig | RunConfig) -> dict[str, Any]:
    """What decides a job's results: the resolved config minus output paths, force and tracking."""
    d = resolved_dict(cfg)
    for k in NON_IDENTITY_KEYS:
        d.pop(k, None)
    if d.get("method") not in TREE_METHODS:  # only a tree reads the budget: a budget sweep runs DFlash once
        d.pop("budget", None)
    return d


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ---------------------------------------------------------------- validation


def _choice(setting: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(setting, f"unknown value '{value}'", f"use one of: {', '.join(allowed)}")


def _is_tiny(cfg: RunConfig) -> bool:
    return cfg.model.tiny is not None


def registered_attention() -> tuple[str, ...]:
    """Every backend name transformers knows (imports transformers; only for unusual names)."""
    from transformers import AttentionInterface

    return tuple(sorted(set(BUILTIN_ATTENTION) | set(AttentionInterface._global_mapping)))


def drafter_attention() -> tuple[str, ...] | None:
    """The backends the DFlash drafter implements (imports torch; only for unusual names)."""
    from ddtree.engine.drafter.model import ATTN_IMPLEMENTATIONS

    return tuple(sorted(ATTN_IMPLEMENTATIONS))


def check_attention(setting: str, name: str, *, method: str, for_target: bool, device: str, dtype: str) -> None:
    if name not in BUILTIN_ATTENTION and name not in SPLIT_ATTENTION and name not in registered_attention():
        raise ConfigError(setting, f"unknown attention backend '{name}'",
                          f"use one of: {', '.join(registered_attention())}")
    if not for_target and name not in ("eager", "sdpa"):
        supported = drafter_attention()
        if supported is not None and name not in supported:
            raise ConfigError(setting, f"the DFlash drafter does not implement {name}",
                              f"use {setting}=sdpa (one of: {', '.join(supported)})")
    base = SPLIT_ATTENTION.get(name, name)
    if name in SPLIT_ATTENTION:  # registers the tree implementations with transformers before any load
        importlib.import_module("ddtree.engine.attention")
    if for_target and method in TREE_METHODS and base not in TREE_BACKENDS:
        raise ConfigError(setting, f"method={method} verifies a tree, which the engine does on "
                          f"{', '.join(TREE_BACKENDS)} only, not on '{name}'", "use attention=sdpa")
    if base in ATTENTION_PACKAGES:
        module, pip_name = ATTENTION_PACKAGES[base]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(setting, f"{name} needs the '{module}' package, which is not installed",
                              f"pip install {pip_name}, or use attention=sdpa")
        try:  # installed is not enough: a wheel built for another torch/CUDA fails on import
            importlib.import_module(module)
        except Exception as e:
            raise ConfigError(setting, f"'{module}' is installed but cannot be imported ({_first_line(e)})",
                              f"reinstall {pip_name} for this torch/CUDA, or use attention=sdpa") from None
        if device in ("cpu", "mps"):
            raise ConfigError(setting, f"{name} runs on CUDA only, but device={device}", "use attention=sdpa")
        if dtype == "float32":
            raise ConfigError(setting, f"{name} takes float16/bfloat16 only, but the dtype is float32",
                              "set model.dtype=bfloat16, or use attention=sdpa")


def _check_device(device: str) -> None:
    if not DEVICE_RE.match(device):
        raise ConfigError("device", f"'{device}' is not a device", "use cpu, cuda, cuda:N, mps or auto")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device} requested but CUDA is not available", "use device=cpu (or auto)")
        idx = int(device.split(":")[1]) if ":" in device else 0
        if idx >= torch.cuda.device_count():
            raise ConfigError("device", f"{device} does not exist ({torch.cuda.device_count()} GPU(s))",
                              "use device=cuda:0")


def _model_dtype(cfg: RunConfig) -> str:
    """The dtype a model will actually have, as it is known before loading."""
    if cfg.model.dtype == "auto":
        return "float32" if _is_tiny(cfg) else "auto"
    return cfg.model.dtype


def _basename(name: str) -> str:
    return name.rstrip("/").split("/")[-1].lower()


def _local_config_json(name_or_path: str, revision: str | None = None) -> dict | None:
    """config.json of a local dir, or of a hub repo already in the local cache. Never downloads."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        f = p / "config.json"
        return json.loads(f.read_text()) if f.is_file() else None
    if p.exists() or name_or_path.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        f = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # a malformed repo id or an unreadable cache: nothing to check against
        return None
    return json.loads(Path(f).read_text()) if isinstance(f, str) and Path(f).is_file() else None


def target_config_dict(cfg: RunConfig) -> dict | None:
    """The target's config fields without loading weights: tiny models from code, others from disk."""
    if _is_tiny(cfg):
        from ddtree.testing.tiny import tiny_config

        t = cfg.model.tiny
        try:
            return tiny_config(t.model_type, vocab_size=t.vocab_size, num_hidden_layers=t.num_hidden_layers).to_dict()
        except (ValueError, KeyError) as e:
            raise ConfigError("model.tiny.model_type", f"transformers cannot build '{t.model_type}' ({_first_line(e)})",
                              "use a transformers model type such as qwen3 or llama") from None
    d = _local_config_json(cfg.model.name_or_path, cfg.model.revision)
    if d is not None and "text_config" in d and "num_hidden_layers" not in d:
        d = {**d, **d["text_config"]}
    return d


def check_drafter_fits(cfg: RunConfig) -> None:
    """The drafter's recorded target and (if on disk) its config.json against the target's, before loading."""
    dr, model = cfg.drafter, cfg.model
    if dr.kind != "pretrained":
        return
    what = f"drafter {dr.name_or_path}"
    fix = f"use drafter={model.name} (the drafter made for this model), or method=ar drafter=none"
    if dr.target is not None:
        if _is_tiny(cfg):
            raise ConfigError("drafter", f"{what} was trained for {dr.target}, but model={model.name} is a tiny "
                              "random model", f"use drafter=tiny with model={model.name}")
        if _basename(dr.target) != _basename(model.name_or_path):
            raise ConfigError("drafter", f"{what} was trained for {dr.target}, not {model.name_or_path}",
                              fix + "; set drafter.target=null if the model is a copy of that target")
    dcfg = _local_config_json(dr.name_or_path, dr.revision)
    tcfg = target_config_dict(cfg) if dcfg is not None else None
    if not dcfg or not tcfg:
        return
    t_layers = tcfg.get("num_hidden_layers")
    ids = (dcfg.get("dflash_config") or {}).get("target_layer_ids") or []
    problems = []
    if dcfg.get("num_target_layers") not in (None, t_layers):
        problems.append(f"{dcfg['num_target_layers']} target layers (the target has {t_layers})")
    elif ids and t_layers is not None and max(ids) >= t_layers:
        problems.append(f"target layer {max(ids)} (the target has {t_layers} layers)")
    for key in ("hidden_size", "vocab_size"):
        if dcfg.get(key) is not None and tcfg.get(key) is not None and dcfg[key] != tcfg[key]:
            problems.append(f"{key} {dcfg[key]} (the target's is {tcfg[key]})")
    if problems:
        raise ConfigError("drafter", f"{what} does not fit model={model.name}: it expects " + "; ".join(problems), fix)


def validate(cfg: DictConfig | RunConfig) -> RunConfig:
    """Every check that can run before loading weights; returns the typed config."""
    rc = to_run_config(cfg)
    _choice("method", rc.method, METHODS)
    _choice("engine", rc.engine, ENGINES)
    if rc.engine == "upstream":
        check_upstream_path(rc.upstream.path)
    if rc.budget < 1:
        raise ConfigError("budget", f"must be >= 1, got {rc.budget}", "use e.g. budget=32")
    if not math.isfinite(rc.temperature) or rc.temperature < 0:
        raise ConfigError("temperature", f"must be >= 0, got {rc.temperature}", "use temperature=0 for greedy")
    if rc.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {rc.max_new_tokens}", "use e.g. max_new_tokens=256")
    _check_device(rc.device)

    m = rc.model
    _choice("model.dtype", m.dtype, DTYPES)
    if m.tiny is None and not m.name_or_path:
        raise ConfigError("model.name_or_path", "is not set", "pass model.name_or_path=<hub id or local dir>")
    if m.tiny is not None and m.name_or_path:
        raise ConfigError("model.name_or_path", f"is set on the tiny random model '{m.name}'",
                          "pick a hub model (e.g. model=qwen3_8b) and then model.name_or_path=<id or dir>")
    if m.tiny is not None and m.tiny.vocab_size < 16:
        raise ConfigError("model.tiny.vocab_size", f"must be >= 16, got {m.tiny.vocab_size}")
    check_device_map(m.device_map)

    d = rc.drafter
    _choice("drafter.kind", d.kind, DRAFTER_KINDS)
    if d.dtype is not None:
        _choice("drafter.dtype", d.dtype, DTYPES)
    if d.block_size is not None and d.block_size < 2:
        raise ConfigError("drafter.block_size", f"must be >= 2, got {d.block_size}", "use 2..16, or null")
    if d.kind == "pretrained" and not d.name_or_path:
        raise ConfigError("drafter.name_or_path", "is not set", "pass drafter.name_or_path=<hub id or local dir>")
    if d.kind != "pretrained" and d.name_or_path:
        raise ConfigError("drafter.name_or_path", f"is set, but drafter.kind={d.kind}",
                          "use drafter=pretrained drafter.name_or_path=<hub id or local dir>")
    if d.kind == "random" and d.num_layers < 1:
        raise ConfigError("drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    if rc.method != "ar":
        if d.kind == "none":
            raise ConfigError("drafter", f"method={rc.method} needs a DFlash drafter, but drafter=none",
                              f"use drafter={m.name} (or drafter=tiny), or method=ar")
        if d.kind == "random" and m.tiny is None:
            raise ConfigError("drafter", f"a random drafter on the real model {m.name} measures nothing",
                              f"use drafter={m.name}; drafter=tiny is for the tiny test models")

    dtype = _model_dtype(rc)
    device = rc.device
    check_attention("attention.target", rc.attention.target, method=rc.method, for_target=True,
                    device=device, dtype=dtype)
    if rc.method != "ar":
        check_attention("attention.drafter", rc.attention.drafter, method=rc.method, for_target=False,
                        device=device, dtype=d.dtype or dtype)
    base_target = SPLIT_ATTENTION.get(rc.attention.target, rc.attention.target)
    if rc.engine == "upstream" and rc.method in TREE_METHODS and base_target not in ("eager", "sdpa"):
        raise ConfigError("attention.target", f"engine=upstream verifies the tree with the authors' dense 4-D mask, "
                          f"which '{rc.attention.target}' cannot take", "use attention=sdpa (or eager)")

    check_dataset(rc.dataset)  # settings and local files only: nothing is downloaded here

    t = rc.tracking
    _choice("tracking.backend", t.backend, TRACKERS)
    if t.backend == "mlflow":
        uri = tracking_uri(rc)
        scheme = uri.split(":", 1)[0] if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) else ""
        if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise ConfigError("tracking.uri", f"'{uri}' is a file store, which MLflow 3 refuses",
                                  "use tracking.uri=sqlite:///<path>/mlflow.db (the default) or an http server")
    if rc.method != "ar":  # AR never loads the drafter
        check_drafter_fits(rc)
    return rc


def check_upstream_path(path: str | None) -> None:
    """engine=upstream: upstream.path must be a checkout of the authors' code (layout only; nothing imported)."""
    from ddtree.upstream.loader import UpstreamError, check_path

    try:
        check_path(path)
    except UpstreamError as e:
        problem, _, fix = str(e).removeprefix("upstream.path: ").partition(" — ")
        raise ConfigError("upstream.path", problem, fix or None) from None


def tracking_uri(rc: RunConfig) -> str:
    if rc.tracking.uri:
        return rc.tracking.uri
    return "sqlite:///" + str(Path(rc.runs_dir).expanduser().resolve() / "mlflow.db")
