"""ddtree.check's settings: the typed config (Hydra's `check_schema`), every check of the settings alone, and the
identity a resumed check is found by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ddtree.engine.methods import BASELINE
from ddtree.errors import ConfigError
from ddtree.pipeline.endpoint import APIS, SERVERS
from ddtree.pipeline.prompts import Prompt, fingerprint
from ddtree.pipeline.schema import (
    AttentionConfig,
    CompatConfig,
    DatasetConfig,
    ModelConfig,
    RunConfig,
    TrackingConfig,
    ValidationConfig,
    schema_node,
    structured,
)

CHECK_FILE = "check.jsonl"
SUMMARY = "summary.json"
SOURCES = ("endpoint", "file")


@dataclass
class EndpointConfig:
    """source=endpoint: an OpenAI-compatible server (or llama.cpp's native API)."""

    url: str | None = None  # http://HOST:PORT/v1 (api=llamacpp: http://HOST:PORT)
    api: str = "chat"  # chat: /chat/completions (the server's chat template) | completion | llamacpp
    model: str | None = None  # the served model's name; null: the only one GET /models lists
    api_key: str | None = None
    timeout_s: float = 600.0  # per request
    prompt_ids: bool = False  # completion/llamacpp: send ddtree's prompt token ids instead of its text
    # merged into every request: the fields that make a server return token ids (docs/check.md), e.g.
    # vLLM {return_token_ids: true}, SGLang {return_meta_info: true, return_token_ids: true}
    extra: dict[str, Any] = field(default_factory=dict)
    metrics: bool = True  # read vLLM's /metrics spec_decode counters before and after (where the server has them)
    # whose sampler defaults to send at their neutral values (docs/check.md): auto (GET /models says) | vllm | sglang
    # | llamacpp | llama-cpp-python | openai (the standard's fields only) | none (temperature and top_p only)
    server: str = "auto"

@dataclass
class FileSourceConfig:
    path: str | None = None  # JSONL: {"id", "prompt" | "turns", "output_ids" | "output"[, "finish_reason"]} a line

@dataclass
class CheckConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    source: str = "endpoint"  # endpoint | file
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    file: FileSourceConfig = field(default_factory=FileSourceConfig)
    temperature: float = 0.0  # what the engine is asked to sample at (0: greedy)
    max_new_tokens: int = 256
    repeats: int = 1  # each prompt this many times (T > 0: a distribution test over the repeats' first tokens)
    seed: int = 0  # sent to the server (seed + repeat)
    device: str = "auto"  # where ddtree's copy of the target runs
    baseline: str | None = "auto"  # ddtree's own AR outputs to compare with: auto (search runs_dir) | a job dir | null
    runs_dir: str = "runs"
    tags: dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(name="check_schema", node=schema_node(CheckConfig))
NON_IDENTITY = ("runs_dir", "tracking", "tags", "validation", "baseline", "device")


def to_check_config(cfg: DictConfig | CheckConfig) -> CheckConfig:
    return cfg if isinstance(cfg, CheckConfig) else structured(cfg, CheckConfig, cli="ddtree.check")


def run_config(cc: CheckConfig) -> RunConfig:
    """The run settings the shared pieces read (target loading, prompts, the verdict rule): plain AR decoding."""
    return RunConfig(model=cc.model, dataset=cc.dataset, attention=cc.attention, compat=cc.compat,
                     tracking=cc.tracking, validation=cc.validation, method=BASELINE, baseline=False,
                     temperature=cc.temperature, max_new_tokens=cc.max_new_tokens, seed=cc.seed, device=cc.device,
                     runs_dir=cc.runs_dir, tags=cc.tags)


def check_settings(cc: CheckConfig) -> RunConfig:
    """Every check of the settings alone (no server asked, no weight loaded); the run settings."""
    from ddtree.pipeline import config_checks as C

    rc = run_config(cc)
    C.check_run_settings(rc)
    C.check_model(rc)
    C.check_attention_settings(rc)
    C.check_tracking(rc)
    C.check_validation(rc)
    if cc.source not in SOURCES:
        raise ConfigError("source", f"unknown value '{cc.source}'", f"use one of: {', '.join(SOURCES)}")
    if cc.repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {cc.repeats}", "use repeats=1 (each prompt once)")
    if cc.source == "endpoint":
        C.check_dataset(rc.dataset)
        if cc.endpoint.api not in APIS:
            raise ConfigError("endpoint.api", f"unknown value '{cc.endpoint.api}'", f"use one of: {', '.join(APIS)}")
        if not cc.endpoint.url:
            raise ConfigError("endpoint.url", "is not set", "pass endpoint.url=http://HOST:PORT/v1, or source=file "
                              "file.path=<outputs.jsonl>")
        if cc.endpoint.server not in SERVERS:
            raise ConfigError("endpoint.server", f"unknown value '{cc.endpoint.server}'",
                              f"use one of: {', '.join(SERVERS)}")
        if not cc.endpoint.timeout_s > 0:
            raise ConfigError("endpoint.timeout_s", f"must be > 0, got {cc.endpoint.timeout_s}", "use e.g. 600")
        if cc.endpoint.prompt_ids and cc.endpoint.api == "chat":
            raise ConfigError("endpoint.prompt_ids", "the chat API takes messages, not token ids",
                              "use endpoint.api=completion (or llamacpp) with endpoint.prompt_ids=true")
    elif not cc.file.path:
        raise ConfigError("file.path", "is not set", "pass file.path=<outputs.jsonl>")
    return rc


def identity(cc: CheckConfig, prompts: list[Prompt], file_sha: str | None) -> dict[str, Any]:
    d = OmegaConf.to_container(OmegaConf.structured(cc), resolve=True)
    for k in NON_IDENTITY:
        d.pop(k, None)
    for k in ("api_key", "timeout_s", "metrics"):  # how the server is asked, not what it is asked
        d["endpoint"].pop(k, None)
    d["prompts"] = fingerprint(prompts)
    if file_sha:
        d["file_sha256"] = file_sha
    return d
