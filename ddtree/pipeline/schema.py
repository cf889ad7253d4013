"""The typed run configuration (Hydra ConfigStore schema) and its conversion to plain data.

Its validation is ddtree.pipeline.config_checks. Importing this module stays cheap (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddtree.engine.methods import METHODS, reads_budget
from ddtree.errors import ConfigError
from ddtree.paths import CONF_DIR as CONF_DIR  # re-exported: the entry points read conf/ from here
from ddtree.paths import DATA_ROOT, runs_root

REPO_ROOT = DATA_ROOT  # the checkout, or an installed package's ddtree/_data (conf/, assets/toy, docs/)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_KINDS = ("none", "pretrained", "random")
DATASETS = ("tiny", "jsonl")
TRACKERS = ("mlflow", "none")
AUTO = "auto"  # attention=auto: chosen per target and device (ddtree.pipeline.preflight.resolve_attention)
ENGINES = ("native", "upstream")  # upstream: the DDTree authors' code (ddtree.upstream.engine)


# ---------------------------------------------------------------- schema


@dataclass
class TinyModelConfig:
    """A random model built in-process with ddtree.tiny.tiny_model (no download)."""

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
    # null: the whole model on `device`; auto | balanced | balanced_low_0 | sequential | {module: device}:
    # accelerate splits its layers over the GPUs (see ddtree.pipeline.distributed)
    device_map: Any = None
    # null: as the checkpoint is; a preset (int8, int4, quanto_int8, fp8, nf4, ...) or a transformers quantization
    # config as a mapping (ddtree.pipeline.quantization, docs/targets.md)
    quantization: Any = None
    # null: the whole model on each rank; auto: transformers' tensor-parallel plan, the heads and MLP columns sharded
    # over model.tp_size ranks under torchrun (ddtree.pipeline.distributed, docs/scale.md)
    tp_plan: str | None = None
    tp_size: int | None = None  # ranks of one tensor-parallel group (null: every rank of the job)


@dataclass
class DrafterConfig:
    kind: str = "none"  # none | pretrained (hub id or dir) | random (DFlashDrafter.random_for_target)
    name_or_path: str | None = None
    target: str | None = None  # the target it was trained for; checked before loading (null: skip)
    block_size: int | None = None  # override; null: the checkpoint's (random: 16)
    dtype: str | None = None  # null: model.dtype
    revision: str | None = None
    quantization: Any = None  # null: its own precision; int8 / quanto_int8 or a torchao/quanto mapping
    # random drafters only
    num_layers: int = 1
    seed: int = 0
    target_layer_ids: list[int] | None = None


@dataclass
class MTPConfig:
    """method=mtp: the target's own MTP head (read from its checkpoint; a tiny model built in code gets a random one)."""

    steps: int = 3  # draft tokens a round, the head applied recursively (SGLang's --speculative-num-steps)
    topk: int = 1  # > 1: an EAGLE-style tree (--speculative-eagle-topk), its `budget` best nodes verified
    seed: int = 0  # tiny models: the random head's seed


@dataclass
class Eagle3Settings:
    """method=eagle3: an EAGLE-3 drafter (drafter=pretrained drafter.name_or_path=...; docs/eagle3.md)."""

    steps: int = 3  # draft tokens a round, the draft layer applied recursively (SGLang's --speculative-num-steps)
    topk: int = 1  # > 1: an EAGLE-2 dynamic tree (--speculative-eagle-topk), its `budget` best nodes verified


@dataclass
class AttentionConfig:
    target: str = "auto"  # auto: per target family and device (ddtree.pipeline.preflight.auto_attention)
    drafter: str = "auto"


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
    truncate: bool = False  # a prompt longer than the context allows: false refuses it, true keeps its last tokens
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


VALIDATION_MODES = ("auto", "on", "off")


@dataclass
class ValidationConfig:
    """Verdicts for every output (ddtree.engine.output_check), after the timed generation; docs/validation.md."""

    mode: str = "auto"  # auto: on when a baseline runs | on | off
    strict: bool = False  # the job exits non-zero (3) when any output is suspect
    steps: float = 4.0  # a margin up to this many dtype steps at the logits' magnitude is a tie
    calibrate: bool = True  # a floor from the AR baseline's cached-vs-teacher-forced drift
    calibration_factor: float = 2.0
    calibration_outputs: int = 4  # baseline outputs re-decoded for the calibration ...
    calibration_tokens: int = 64  # ... over at most this many of their first tokens
    rescore_dtype: str | None = None  # e.g. float32: teacher-force in a wider dtype
    false_alarm: float = 1e-3  # T > 0: chance a correct sampled output is called suspect


@dataclass
class AutoBudgetConfig:
    """budget=auto (ddtree.pipeline.autobudget): a short calibration, the diagnosis model, the best budget."""

    prompts: int = 4  # calibration prompts (the dataset's first ones)
    calibration_budget: int = 32  # the DDTree budget they run at (16-64 calibrate well: docs/diagnosis.md)
    candidates: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64, 128, 256])
    cost_tokens: int = 32  # new tokens of the one timed generation per candidate (and AR)
    cost: str | None = None  # a cost table instead (python -m ddtree.diagnose --cost format)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    eagle3: Eagle3Settings = field(default_factory=Eagle3Settings)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    method: str = "ddtree"  # set by the `method` group
    budget: Any = 64  # DDTree node budget (excluding the root), or "auto" (ddtree.pipeline.autobudget)
    auto: AutoBudgetConfig = field(default_factory=AutoBudgetConfig)
    scoring: str = "auto"  # method=ddtree's node scores: auto | marginal | pair (a DFlash2 drafter's selector)
    temperature: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    # streams decoding at once: 1 decodes one prompt at a time; N > 1 runs the baseline and the method each through
    # one Engine.generate_many call over the job's prompts (per turn), up to N streams a round (docs/concurrency.md)
    concurrency: int = 1
    baseline: bool = True  # also run AR on each prompt in the same job
    # reuse the AR baseline an earlier job of this process ran on the same prompts and settings (a sweep over
    # methods and budgets decodes each prompt with AR once, as the paper does); false: AR in every job
    baseline_reuse: bool = True
    force: bool = False  # rerun even if this config already finished in the tracking store
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    warmup: bool = True  # one untimed short generation per method after loading
    # CPU targets: glibc's malloc thresholds tuned for this process (ddtree.engine.host; the library's default: off)
    host_allocator: bool = True
    record_rounds: bool = True  # per-round diagnosis records in samples.jsonl (python -m ddtree.diagnose reads them)
    # the compiled verification round (ddtree.engine.compiled): auto (CUDA targets it can run) | true | false
    compile: str = "auto"
    engine: str = "native"
    runs_dir: str = "runs"
    tags: dict[str, str] = field(default_factory=dict)  # extra MLflow tags (experiment configs set tags.experiment)


def schema_node(schema: type) -> DictConfig:
    """The ConfigStore node of a dataclass schema, its free-form maps (`dict[...]` settings: endpoint.extra, tags)
    open: Hydra's struct mode would refuse a new key inside them, so `endpoint.extra='{return_token_ids: true}'`
    failed with "no such setting" while `+endpoint.extra.return_token_ids=true` worked. The schema's own settings
    stay closed (a typo is still refused)."""
    node = OmegaConf.structured(schema)

    def open_maps(cfg: DictConfig) -> None:
        for key in cfg.keys():
            child = cfg._get_node(key)
            if isinstance(child, DictConfig):
                if is_dataclass(OmegaConf.get_type(child)):
                    open_maps(child)
                else:
                    OmegaConf.set_struct(child, False)

    open_maps(node)
    return node


def _register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="ddtree_schema", node=schema_node(RunConfig))
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))
    if not OmegaConf.has_resolver("runs_root"):  # the checkout, or the current directory when installed
        OmegaConf.register_new_resolver("runs_root", lambda: str(runs_root()))
    if not OmegaConf.has_resolver("model_label"):  # model=hf: the hub id, or a local folder's name
        OmegaConf.register_new_resolver("model_label", model_label)


def model_label(name_or_path: str | None) -> str:
    """The name records carry for a checkpoint: its hub id as written, or the folder's name for a local path."""
    if not name_or_path:
        return "?"
    p = Path(str(name_or_path)).expanduser()
    if p.exists() or str(name_or_path).startswith(("/", ".", "~")) or str(name_or_path).count("/") > 1:
        return p.resolve().name or str(name_or_path)
    return str(name_or_path)


_register()

# keys that do not change what a job computes: left out of its identity (resume)
NON_IDENTITY_KEYS = ("force", "runs_dir", "tracking", "tags", "baseline_reuse", "validation", "host_allocator", "auto",
                     "record_rounds")


# ---------------------------------------------------------------- conversion


def first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), str(text))


def structured(cfg: DictConfig | dict, schema: type, cli: str = "ddtree.run", refuse_unknown: bool = True) -> Any:
    """A composed DictConfig (Hydra's own `hydra` node left out) as an instance of the dataclass `schema`: missing
    or mistyped values become one ConfigError; with refuse_unknown, so do settings the schema does not have."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    try:
        node = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        if type(e).__name__ == "MissingMandatoryValue":
            raise ConfigError(key, "is required but not set", f"pass {key}=<value>") from None
        raise ConfigError(key, first_line(getattr(e, "msg", None) or str(e))) from None
    if refuse_unknown:
        refuse_unknown_keys(obj, cli=cli)
    return obj


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The composed DictConfig as a RunConfig; missing or mistyped values become ConfigError."""
    return cfg if isinstance(cfg, RunConfig) else structured(cfg, RunConfig)


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
    auto = d.get("auto")
    for k in NON_IDENTITY_KEYS:
        d.pop(k, None)
    if str(d.get("compile", "auto")).lower() == "auto":  # the default: identities from before the setting still match
        d.pop("compile", None)
    if d.get("concurrency") == 1:  # the default: one prompt at a time, as jobs from before the setting ran
        d.pop("concurrency", None)
    if str(d.get("budget")).lower() == "auto":  # its settings decide which budget runs
        d["auto"] = auto
    method = METHODS.get(d.get("method"))
    topk = (d.get(method.settings) or {}).get("topk") if method is not None and method.settings else None
    if not reads_budget(d.get("method"), topk):  # a budget sweep runs DFlash once
        d.pop("budget", None)
    if "scoring" in d and d.get("method") != "ddtree":  # DDTree's alone: a scoring sweep runs DFlash once
        d["scoring"] = "marginal"
    for group in {m.settings for m in METHODS.values() if m.settings}:  # a method's own settings matter to it alone
        if method is None or method.settings != group:
            d.pop(group, None)
    return d


def method_settings(rc: RunConfig) -> Any:
    """The settings group method `rc.method` alone reads (its Method.settings: mtp, eagle3), or None."""
    m = METHODS.get(rc.method)
    return getattr(rc, m.settings) if m is not None and m.settings else None


def method_topk(rc: RunConfig) -> int | None:
    """The topk of the method's own settings (a tree when > 1), or None where it has none."""
    s = method_settings(rc)
    return s.topk if s is not None else None


def is_auto(budget: Any) -> bool:
    """budget=auto (ddtree.pipeline.autobudget) rather than a number."""
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def tracking_uri(rc: RunConfig) -> str:
    if rc.tracking.uri:
        return rc.tracking.uri
    return "sqlite:///" + str(Path(rc.runs_dir).expanduser().resolve() / "mlflow.db")
