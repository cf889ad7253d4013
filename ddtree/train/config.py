"""Typed configuration of `python -m ddtree.train` (Hydra schema) and its validation.

Every check raises ConfigError(setting, problem, fix) before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from ddtree.engine.methods import DRAFTER_METHOD_NAMES, METHOD_NAMES
from ddtree.errors import ConfigError
from ddtree.paths import DATA_ROOT
from ddtree.pipeline.schema import TrackingConfig as RunTrackingConfig
from ddtree.pipeline.schema import structured

REPO_ROOT = DATA_ROOT  # the checkout, or an installed package's ddtree/_data
STAGES = ("data", "extract", "train", "eval")
DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("generate", "texts", "hub")
FEATURES = ("offline", "online")
SELECTOR_LOSSES = ("public", "ours")  # a DFlash2 drafter's selector term (train.objective.selector_loss)


@dataclass
class TargetConfig:
    name_or_path: str = MISSING  # a local HF checkpoint dir (or hub id) of the target
    tokenizer: str | None = None  # null: name_or_path
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device_map: str | None = None  # null: the whole target on `device`; auto | balanced | ...: placed by accelerate


@dataclass
class HubDataConfig:
    """A chat dataset read through `datasets` (a hub id, or a loader such as json with data_files)."""

    path: str | None = None  # e.g. HuggingFaceH4/ultrachat_200k, or json (with data_files)
    name: str | None = None  # the dataset's configuration
    split: str = "train"
    data_files: list[str] | None = None
    revision: str | None = None
    cache_dir: str | None = None  # null: the datasets library's cache (HF_DATASETS_CACHE)
    messages_field: str | None = None  # null: "messages" (role/content) or "conversations" (from/value)
    regenerate: bool = True  # true: keep the user turns, the target writes the answers (the DFlash recipe)


@dataclass
class DataConfig:
    source: str = "generate"  # generate: the target answers `prompts` | texts: `texts` as they are | hub: `hub`
    prompts: str | None = None  # JSONL of {"id", "turns": [user messages]} (the run pipeline's format)
    texts: str | None = None  # JSONL of {"messages": [{"role", "content"}, ...]} or {"text": "..."}
    max_samples: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy answers; > 0: sampled
    batch_size: int = 16  # prompts generated together (same token length, so no padding)
    chat_template: bool = True
    hub: HubDataConfig = field(default_factory=HubDataConfig)


@dataclass
class DrafterConfig:
    init: str | None = None  # a public-format drafter dir to start from; null: random init
    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # null: spread over the target's depth
    mask_token: str | None = "<|mask|>"  # looked up in the tokenizer; absent -> mask_token_id
    mask_token_id: int | None = None  # null and no mask_token: the last vocabulary id
    seed: int = 0
    # dflash2: a DFlash2 drafter (convolutions and a candidate selector: docs/dflash2.md), with these settings
    arch: str = "dflash"
    conv_kernel_size: int = 4
    conv_group_size: int | None = None  # null: hidden_size / 8
    selector_rank: int = 64
    selector_top_k: int = 8


@dataclass
class ExtractConfig:
    shard_size: int = 512  # sequences per shard
    batch_size: int = 8  # sequences per target forward (right-padded)
    dtype: str = "bfloat16"  # storage dtype of the features
    keep_free_gb: float = 5.0  # refuse an extraction that would leave less free disk than this


@dataclass
class SelectorLossConfig:
    """A DFlash2 drafter's selector term (docs/training.md, "DFlash2 drafters"); ignored for DFlash drafters."""

    loss: str = "public"  # public: the published recipes' rule | ours: ddtree's first loss (kept to compare)
    alpha: float = 1.0  # the term's weight beside the block loss (0: the selector is not trained)
    inject_gold: bool = True  # the label replaces the k-th candidate where the top-k misses it (training only)
    stop_gradient: bool = False  # the term trains the selector alone (logits and hidden states detached)


@dataclass
class OptimConfig:
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_steps: int = 50
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    anchors_per_seq: int = 8  # blocks drawn per sequence per micro-batch
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    loss_decay: float | None = 4.0  # weight of block position k is exp(-(k-1)/loss_decay); null: uniform
    selector: SelectorLossConfig = field(default_factory=SelectorLossConfig)  # DFlash2 drafters: the selector's term
    log_every: int = 10
    save_every: int = 200  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    seed: int = 0
    fsdp: bool = False  # several processes: shard the drafter and its optimizer state (FSDP2) instead of DDP


@dataclass
class EvalConfig:
    prompts: str | None = None  # JSONL of {"id", "turns"}; null: skip the eval stage
    max_samples: int | None = 16
    max_new_tokens: int = 128
    methods: list[str] = field(default_factory=lambda: list(DRAFTER_METHOD_NAMES))  # mtp: the target's own head
    budgets: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    chat_template: bool = True
    warmup: bool = True
    every: int | None = None  # optimizer steps between acceptance-curve points (and at the end); null: none
    curve_budget: int = 8  # the DDTree budget of the curve (DFlash runs beside it)
    curve_samples: int | None = 8  # held-out prompts per curve point (the first ones of eval.prompts)


@dataclass
class TrackingConfig(RunTrackingConfig):
    """The run CLI's tracking group (conf/tracking/), plus the name of a training run."""

    experiment: str = "ddtree-train"
    run_name: str | None = None  # null: the out_dir's name


@dataclass
class TrainConfig:
    out_dir: str = MISSING  # every stage writes here; rerunning resumes
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    force: list[str] = field(default_factory=list)  # stages to redo even if done
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # torch CPU threads; null: torch's default
    seed: int = 0
    features: str = "offline"  # offline: extracted to shards on disk | online: the target computes them in training
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))


def to_train_config(cfg: DictConfig | dict | TrainConfig) -> TrainConfig:
    """A composed DictConfig (or plain dict) as a validated TrainConfig."""
    if isinstance(cfg, TrainConfig):
        validate(cfg)
        return cfg
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    tc = structured(cfg, TrainConfig, cli="ddtree.train")
    validate(tc)
    return tc




def validate(c: TrainConfig) -> None:
    for s in [*c.stages, *c.force]:
        if s not in STAGES:
            raise ConfigError("stages", f"unknown stage '{s}'", f"use a list from {list(STAGES)}")
    if c.data.source not in DATA_SOURCES:
        raise ConfigError("data.source", f"unknown source '{c.data.source}'", f"use one of {', '.join(DATA_SOURCES)}")
    if c.features not in FEATURES:
        raise ConfigError("features", f"unknown value '{c.features}'", f"use one of {', '.join(FEATURES)}")
    if "data" in c.stages and c.data.source == "hub":
        if not c.data.hub.path:
            raise ConfigError("data.hub.path", "data.source=hub needs a dataset",
                              "pass data.hub.path=<hub id> (or json with data.hub.data_files=[...])")
    elif "data" in c.stages:
        needed = "prompts" if c.data.source == "generate" else "texts"
        path = getattr(c.data, needed)
        if not path:
            raise ConfigError(f"data.{needed}", f"data.source={c.data.source} needs a JSONL file",
                              f"pass data.{needed}=<file.jsonl>")
        if not Path(path).is_file():
            raise ConfigError(f"data.{needed}", f"no such file: {path}", "pass an existing .jsonl file")
    for name, value in (("target.dtype", c.target.dtype), ("extract.dtype", c.extract.dtype)):
        if value not in DTYPES:
            raise ConfigError(name, f"unknown dtype '{value}'", f"use one of {', '.join(DTYPES)}")
    positive = {"drafter.num_layers": c.drafter.num_layers, "extract.shard_size": c.extract.shard_size,
                "extract.batch_size": c.extract.batch_size, "optim.batch_size": c.optim.batch_size,
                "optim.grad_accum": c.optim.grad_accum, "optim.anchors_per_seq": c.optim.anchors_per_seq,
                "data.batch_size": c.data.batch_size, "data.max_new_tokens": c.data.max_new_tokens,
                "optim.save_every": c.optim.save_every, "optim.log_every": c.optim.log_every,
                "eval.curve_budget": c.eval.curve_budget}
    if c.eval.every is not None:
        positive["eval.every"] = c.eval.every
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    if c.drafter.block_size < 2:
        raise ConfigError("drafter.block_size", f"must be >= 2, got {c.drafter.block_size}", "use e.g. 16")
    if c.optim.lr <= 0:
        raise ConfigError("optim.lr", f"must be > 0, got {c.optim.lr}")
    if c.optim.max_steps is None and c.optim.epochs <= 0:
        raise ConfigError("optim.epochs", f"must be > 0, got {c.optim.epochs}", "or set optim.max_steps")
    if c.drafter.arch not in ("dflash", "dflash2"):
        raise ConfigError("drafter.arch", f"unknown value {c.drafter.arch!r}", "use dflash or dflash2")
    sel = c.optim.selector
    if sel.loss not in SELECTOR_LOSSES:
        raise ConfigError("optim.selector.loss", f"unknown value {sel.loss!r}", f"use {' or '.join(SELECTOR_LOSSES)}")
    if not sel.alpha >= 0 or sel.alpha == float("inf"):
        raise ConfigError("optim.selector.alpha", f"must be a finite number >= 0, got {sel.alpha}", "use e.g. 1.0")
    if sel.loss == "ours" and (not sel.inject_gold or sel.stop_gradient):
        raise ConfigError("optim.selector.loss", "the 'ours' loss always injects the label and trains everything",
                          "use optim.selector.loss=public for inject_gold=false or stop_gradient=true")
    if c.optim.loss_decay is not None and c.optim.loss_decay <= 0:
        raise ConfigError("optim.loss_decay", f"must be > 0 or null, got {c.optim.loss_decay}")
    if c.tracking.backend not in ("mlflow", "none"):
        raise ConfigError("tracking.backend", f"unknown backend '{c.tracking.backend}'", "use mlflow or none")
    if c.eval.prompts and "eval" in c.stages and not Path(c.eval.prompts).is_file():
        raise ConfigError("eval.prompts", f"no such file: {c.eval.prompts}", "pass an existing .jsonl file or null")
    for m in c.eval.methods:
        if m not in METHOD_NAMES:
            raise ConfigError("eval.methods", f"unknown method '{m}'", f"use {', '.join(METHOD_NAMES)}")


def as_dict(c: TrainConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
