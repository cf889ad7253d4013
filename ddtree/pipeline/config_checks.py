"""The checks of a run config before any model work: small checks that each raise `ConfigError(setting, problem, fix)`.

Every check here runs before any model is loaded. Heavy imports (torch, transformers) happen only
for the checks that need them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
from pathlib import Path

from omegaconf import DictConfig

from ddtree.engine.checks import (
    check_block_size,
    check_budget,
    check_dflash2_fields,
    check_input_embedding_scale,
    check_mtp_args,
    compile_setting,
    dflash2_fields,
    is_dflash2_config,
)
from ddtree.engine.methods import (
    COMPILABLE_METHOD_NAMES,
    METHODS,
    check_method_args,
    check_scoring,
    get_method,
    loads_drafter,
)
from ddtree.errors import ConfigError
from ddtree.pipeline.datasets import check_dataset
from ddtree.pipeline.distributed import check_device_map
from ddtree.pipeline.preflight import ATTENTION_PACKAGES
from ddtree.pipeline.schema import (
    AUTO,
    CONF_DIR,
    DRAFTER_KINDS,
    DTYPES,
    ENGINES,
    TRACKERS,
    VALIDATION_MODES,
    RunConfig,
    first_line,
    is_auto,
    method_settings,
    to_run_config,
    tracking_uri,
)

BUILTIN_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def split_attention() -> dict[str, str]:
    """The tree-verifying implementations -> the backend each wraps: ddtree.engine.attention's own table
    (imports torch; registers nothing: a load by name registers them, ddtree.pipeline.models.load_target)."""
    from ddtree.engine.attention import SPLIT_IMPLEMENTATIONS

    return SPLIT_IMPLEMENTATIONS


def _drafter_fix(model: str, tiny: bool) -> str:
    """How to give a model a drafter: its own config when it has one, else any DFlash checkpoint (model=hf)."""
    own = CONF_DIR / "drafter" / f"{model}.yaml"
    if tiny or own.is_file() and "kind: none" not in own.read_text():
        return f"use drafter={model} (or drafter=tiny), or method=ar"
    return "use drafter=pretrained drafter.name_or_path=<a DFlash checkpoint for this model>, or method=ar"


def validate(cfg: DictConfig | RunConfig) -> RunConfig:
    """Every check that can run before loading weights; returns the typed config."""
    rc = to_run_config(cfg)
    check_run_settings(rc)
    check_model(rc)
    check_drafter(rc)
    check_attention_settings(rc)
    check_dataset(rc.dataset)  # settings and local files only: nothing is downloaded here
    check_tracking(rc)
    check_validation(rc)
    if loads_drafter(rc.method):  # AR never loads a drafter, MTP reads the target's head
        check_drafter_fits(rc)
    return rc


def check_auto(rc: RunConfig) -> None:
    """budget=auto's settings (ddtree.pipeline.autobudget), before model work."""
    a = rc.auto
    if not get_method(rc.method).auto_budget:
        names = " or ".join(f"method={n}" for n, m in METHODS.items() if m.auto_budget)
        raise ConfigError("budget", f"budget=auto picks a DDTree budget, but method={rc.method}",
                          f"use {names}, or a number")
    if rc.engine != "native":
        raise ConfigError("budget", "budget=auto needs the native engine (it reads the per-round records)",
                          "use engine=native, or a number")
    if a.prompts < 1 or a.calibration_budget < 1 or a.cost_tokens < 1:
        raise ConfigError("auto", "auto.prompts, auto.calibration_budget and auto.cost_tokens must be >= 1")
    if not a.candidates or min(a.candidates) < 1:
        raise ConfigError("auto.candidates", f"must be budgets >= 1, got {list(a.candidates)}",
                          "use e.g. auto.candidates=[8,16,32,64]")
    if a.cost is not None and not Path(a.cost).is_file():
        raise ConfigError("auto.cost", f"{a.cost} does not exist", "pass a CSV or JSON cost table, or auto.cost=null")


def check_run_settings(rc: RunConfig) -> None:
    """The top-level settings: method, engine, budget, temperature, length, device."""
    method = get_method(rc.method)
    _choice("engine", rc.engine, ENGINES)
    check_scoring(rc.scoring, rc.method)
    if method.settings:  # the method's own settings group (Method.settings, e.g. mtp.*)
        check_mtp_args(method_settings(rc).steps, method_settings(rc).topk, method.settings)
    if rc.engine == "upstream" and not method.authors_code:
        raise ConfigError("engine", f"engine=upstream runs the DDTree authors' DFlash/DDTree, not method={rc.method}",
                          f"use engine=native for method={rc.method}")
    if rc.engine == "upstream":
        check_upstream_path(rc.upstream.path)
    rc.compile = compile_setting(rc.compile)
    if rc.compile == "true" and rc.engine == "upstream":
        raise ConfigError("compile", "compile=true compiles the native engine's round, not the authors' code",
                          "use engine=native, or compile=auto")
    if rc.compile == "true" and rc.model.tp_plan is not None:
        raise ConfigError("compile", "the compiled round does not run a tensor-parallel target (model.tp_plan) yet",
                          "use compile=auto (the eager round on each rank's shards) or drop model.tp_plan")
    if rc.compile == "true" and not method.compilable:
        raise ConfigError("compile", f"the compiled round runs {', '.join(COMPILABLE_METHOD_NAMES)}, not method={rc.method}",
                          "use compile=auto (eager where it cannot run) or compile=false")
    if is_auto(rc.budget):
        rc.budget = "auto"
        check_auto(rc)
    elif isinstance(rc.budget, bool) or not isinstance(rc.budget, int):
        raise ConfigError("budget", f"must be a whole number or auto, got {rc.budget!r}", "use e.g. budget=32")
    else:
        check_budget(rc.budget)  # whatever the method: a budget the config carries is >= 1
    if not math.isfinite(rc.temperature) or rc.temperature < 0:
        raise ConfigError("temperature", f"must be >= 0, got {rc.temperature}", "use temperature=0 for greedy")
    if rc.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {rc.max_new_tokens}", "use e.g. max_new_tokens=256")
    check_concurrency(rc)
    _check_device(rc.device)


def check_concurrency(rc: RunConfig) -> None:
    """concurrency: a whole number >= 1; above 1 the native engine's Engine.generate_many runs the job's prompts."""
    n = rc.concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("concurrency", f"must be a whole number >= 1, got {n!r}",
                          "use concurrency=1 (one prompt at a time) or e.g. concurrency=8")
    if n > 1 and rc.engine != "native":
        raise ConfigError("concurrency", f"engine={rc.engine} decodes one prompt at a time (the authors' code has no "
                          "batched round)", "use engine=native, or concurrency=1")


def check_validation(rc: RunConfig) -> None:
    v = rc.validation
    _choice("validation.mode", v.mode, VALIDATION_MODES)
    if v.rescore_dtype is not None:
        _choice("validation.rescore_dtype", v.rescore_dtype, tuple(d for d in DTYPES if d != "auto"))
    if not v.steps >= 0:
        raise ConfigError("validation.steps", f"must be >= 0, got {v.steps}", "use e.g. validation.steps=4")
    if not 0 < v.false_alarm < 1:
        raise ConfigError("validation.false_alarm", f"must be in (0, 1), got {v.false_alarm}",
                          "use e.g. validation.false_alarm=0.001")
    if min(v.calibration_factor, v.calibration_outputs, v.calibration_tokens) < 0:
        raise ConfigError("validation.calibration_factor", "calibration_factor, _outputs and _tokens must be >= 0",
                          "use validation.calibrate=false to skip the calibration")


def check_model(rc: RunConfig) -> None:
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
    if m.tp_plan is not None and rc.engine != "native":
        raise ConfigError("model.tp_plan", f"engine={rc.engine} runs the authors' code on one process's model",
                          "use engine=native for a tensor-parallel target, or drop model.tp_plan")
    if m.quantization is not None:
        from ddtree.pipeline.models import resolve_device
        from ddtree.pipeline.quantization import check_quantization

        check_quantization("model.quantization", m.quantization, resolve_device(rc.device))


def check_drafter(rc: RunConfig) -> None:
    """The drafter's own settings, and that the method has the drafter it needs."""
    d, m = rc.drafter, rc.model
    _choice("drafter.kind", d.kind, DRAFTER_KINDS)
    if d.dtype is not None:
        _choice("drafter.dtype", d.dtype, DTYPES)
    check_block_size(d.block_size)
    if d.kind == "pretrained" and not d.name_or_path:
        raise ConfigError("drafter.name_or_path", "is not set", "pass drafter.name_or_path=<hub id or local dir>")
    if d.kind != "pretrained" and d.name_or_path:
        raise ConfigError("drafter.name_or_path", f"is set, but drafter.kind={d.kind}",
                          "use drafter=pretrained drafter.name_or_path=<hub id or local dir>")
    if d.kind == "random" and d.num_layers < 1:
        raise ConfigError("drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    budget = rc.auto.calibration_budget if rc.budget == "auto" else rc.budget
    check_method_args(rc.method, has_drafter=d.kind != "none", budget=budget, block_size=d.block_size,
                      drafter_fix=_drafter_fix(m.name, m.tiny is not None))
    if loads_drafter(rc.method) and d.quantization is not None:
        from ddtree.pipeline.models import resolve_device
        from ddtree.pipeline.quantization import check_quantization

        check_quantization("drafter.quantization", d.quantization, resolve_device(rc.device), drafter=True)
    if loads_drafter(rc.method):
        if d.kind == "random" and m.tiny is None:
            raise ConfigError("drafter", f"a random drafter on the real model {m.name} measures nothing",
                              f"use drafter={m.name}; drafter=tiny is for the tiny test models")


def check_attention_settings(rc: RunConfig) -> None:
    """attention.target (and attention.drafter when the method drafts) for this method, device and dtype."""
    dtype = _model_dtype(rc)
    if rc.attention.target != AUTO:
        check_attention("attention.target", rc.attention.target, method=rc.method, for_target=True,
                        device=rc.device, dtype=dtype)
    kind = get_method(rc.method).drafter_kind
    if kind is not None and kind.own_attention and rc.attention.drafter != AUTO:
        check_attention("attention.drafter", rc.attention.drafter, method=rc.method, for_target=False,
                        device=rc.device, dtype=rc.drafter.dtype or dtype)
    if rc.engine == "upstream" and get_method(rc.method).verifies_tree and rc.attention.target != AUTO and (
            split_attention().get(rc.attention.target, rc.attention.target) not in ("eager", "sdpa")):
        raise ConfigError("attention.target", f"engine=upstream verifies the tree with the authors' dense 4-D mask, "
                          f"which '{rc.attention.target}' cannot take", "use attention=sdpa (or eager)")


def check_tracking(rc: RunConfig) -> None:
    t = rc.tracking
    _choice("tracking.backend", t.backend, TRACKERS)
    if t.backend == "mlflow":
        if importlib.util.find_spec("mlflow") is None:  # e.g. the GPU machine's image (bench/device_kit.sh)
            raise ConfigError("tracking.backend", "mlflow is not installed here",
                              "use tracking=none (samples.jsonl and summary.json are still written) or pip install mlflow")
        uri = tracking_uri(rc)
        scheme = uri.split(":", 1)[0] if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) else ""
        if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise ConfigError("tracking.uri", f"'{uri}' is a file store, which MLflow 3 refuses",
                              "use tracking.uri=sqlite:///<path>/mlflow.db (the default) or an http server")


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
    tree = for_target and get_method(method).verifies_tree
    split = split_attention() if tree or name not in BUILTIN_ATTENTION else {}
    if name not in BUILTIN_ATTENTION and name not in split and name not in registered_attention():
        raise ConfigError(setting, f"unknown attention backend '{name}'",
                          f"use one of: {', '.join(registered_attention())}")
    if not for_target and name not in ("eager", "sdpa"):
        supported = drafter_attention()
        if supported is not None and name not in supported:
            raise ConfigError(setting, f"the DFlash drafter does not implement {name}",
                              f"use {setting}=sdpa (one of: {', '.join(supported)})")
    base = split.get(name, name)
    if tree and base not in split.values():
        raise ConfigError(setting, f"method={method} verifies a tree, which the engine does on "
                          f"{', '.join(split.values())} only, not on '{name}'", "use attention=sdpa")
    if base in ATTENTION_PACKAGES:
        module, pip_name = ATTENTION_PACKAGES[base]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(setting, f"{name} needs the '{module}' package, which is not installed",
                              f"pip install {pip_name}, or use attention=sdpa")
        try:  # installed is not enough: a wheel built for another torch/CUDA fails on import
            importlib.import_module(module)
        except Exception as e:
            raise ConfigError(setting, f"'{module}' is installed but cannot be imported ({first_line(e)})",
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
        from ddtree.tiny import tiny_config

        t = cfg.model.tiny
        try:
            d = tiny_config(t.model_type, vocab_size=t.vocab_size, num_hidden_layers=t.num_hidden_layers).to_dict()
        except (ValueError, KeyError) as e:
            raise ConfigError("model.tiny.model_type", f"transformers cannot build '{t.model_type}' ({first_line(e)})",
                              "use a transformers model type such as qwen3 or llama") from None
    else:
        d = _local_config_json(cfg.model.name_or_path, cfg.model.revision)
    if d is not None and "text_config" in d and "num_hidden_layers" not in d:
        d = {**d, **d["text_config"]}
    return d


def check_drafter_fits(cfg: RunConfig) -> None:
    """The drafter's recorded target and (if on disk) its config.json against the target's, before loading."""
    dr, model = cfg.drafter, cfg.model
    if dr.kind == "random":  # a random drafter is DFlash (no selector)
        check_scoring(cfg.scoring, cfg.method, dflash2=False)
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
    if dcfg is not None:
        _check_dflash2_config(cfg, dcfg)
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


def _check_dflash2_config(cfg: RunConfig, dcfg: dict) -> None:
    """A drafter's config.json (a DFlash2 one's convolution and selector fields, any one's input_embedding_scale) and
    the scoring, before any model loads."""
    inner = dcfg.get("dflash_config") if isinstance(dcfg.get("dflash_config"), dict) else {}
    scale = inner.get("input_embedding_scale")
    scale = dcfg.get("input_embedding_scale") if scale is None else scale
    check_input_embedding_scale(scale)
    if scale not in (None, 1) and cfg.engine == "upstream":
        raise ConfigError("engine", f"the drafter scales its input embeddings by {scale}, which the DDTree authors' "
                          "code does not", "use engine=native")
    dflash2 = is_dflash2_config(dcfg)
    if dflash2:
        check_dflash2_fields(dflash2_fields(dcfg), hidden_size=dcfg.get("hidden_size"),
                             block_size=inner.get("block_size") or dcfg.get("block_size") or 16,
                             vocab_size=dcfg.get("vocab_size"))
        if cfg.engine == "upstream":
            raise ConfigError("engine", "the DDTree authors' code drafts with DFlash, not a DFlash2 drafter",
                              "use engine=native")
    check_scoring(cfg.scoring, cfg.method, dflash2=dflash2)


def check_upstream_path(path: str | None) -> None:
    """engine=upstream: upstream.path must be a checkout of the authors' code (layout only; nothing imported)."""
    from ddtree.upstream.loader import check_path

    check_path(path)  # raises UpstreamError, a ConfigError naming upstream.path
