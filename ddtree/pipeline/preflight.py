"""Checks a job runs after validation and before it opens the store or loads any weights.

Where each model comes from (a local checkpoint folder, or a hub repo in the local cache or on a
reachable hub), what the target is (its family from config.json: hybrid or not, a causal LM or not, the
methods it supports) and whether every prompt fits its context. Each problem is one ConfigError that
names the setting and the fix. Nothing here downloads weights: a hub repo is looked up in the cache
(huggingface_hub.try_to_load_from_cache) and, when online, asked about with one HEAD request.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddtree.engine.checks import is_dflash2_config
from ddtree.engine.methods import (
    AUTO_SCORING,
    check_target_supported,
    get_method,
    loads_drafter,
    resolve_scoring,
)
from ddtree.errors import ConfigError
from ddtree.pipeline.distributed import check_tensor_parallel, world_from_env
from ddtree.pipeline.prompts import Prompt
from ddtree.pipeline.schema import AUTO

# backends that need a package beyond torch: backend -> (importable module, pip name)
ATTENTION_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                      "flash_attention_3": ("flash_attn_interface", "flash-attn-3")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HUB_TIMEOUT_S = 10.0  # one HEAD request per source: a dead network fails fast, not after minutes


@dataclass(frozen=True)
class Source:
    """What a name_or_path setting points at: a local folder, or a hub repo (cached or not)."""

    setting: str
    name: str
    local: Path | None  # the folder, for a local source
    cached_file: Path | None = None  # the checked file from the hub cache, when it is there


def _offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(v in ("1", "true", "yes", "on") for v in env)


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it is written as a path (hub ids are `org/name` or `name`)."""
    return (Path(name).expanduser().exists() or name.startswith(("/", ".", "~")) or name.count("/") > 1
            or "\\" in name)


def _hub_fix(repo: str) -> str:
    return f"hf download {repo} where the hub is reachable (it fills the local cache), then run again"


def check_source(setting: str, name: str, revision: str | None, files: tuple[str, ...],
                 what: str = "a checkpoint") -> Source:
    """`name` (a local folder or a hub id) holds one of `files`, or is a ConfigError naming `setting`."""
    if _looks_local(name):
        p = Path(name).expanduser()
        if not p.exists():
            raise ConfigError(setting, f"no such folder: {p}",
                              f"pass {setting}=<a folder holding {files[0]}> or a hub id such as Qwen/Qwen3-8B")
        if not p.is_dir():
            raise ConfigError(setting, f"{p} is a file, not a checkpoint folder",
                              f"pass the folder that holds {files[0]} and the weights")
        if not any((p / f).is_file() for f in files):
            raise ConfigError(setting, f"{p} has no {' or '.join(files)}: it is not {what}",
                              f"pass the folder that holds {files[0]} (e.g. one written by save_pretrained)")
        return Source(setting, name, p)
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(setting, f"'{name}' is neither a local folder nor a hub id",
                          f"pass {setting}=<hub id such as Qwen/Qwen3-8B> or an existing folder") from None
    for f in files:
        hit = try_to_load_from_cache(name, f, revision=revision)
        if isinstance(hit, str) and Path(hit).is_file():
            return Source(setting, name, None, Path(hit))
    rev = f" (revision {revision})" if revision else ""
    if _offline():
        raise ConfigError(setting, f"{name}{rev} is not in the local Hugging Face cache and the hub is off "
                          "(HF_HUB_OFFLINE=1)", _hub_fix(name) + ", or unset HF_HUB_OFFLINE to download it")
    _ask_hub(setting, name, revision, files[0])
    return Source(setting, name, None)


def _ask_hub(setting: str, repo: str, revision: str | None, filename: str) -> None:
    """One HEAD request for `filename`: the repo exists, is readable with this login, and the hub answers."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision), timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ConfigError(setting, f"{repo} is gated: its files need an accepted license and a login",
                          f"accept the terms on https://huggingface.co/{repo}, then `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ConfigError(setting, f"{repo} does not exist on the hub (or is private to another account)",
                          "check the spelling of the hub id; for a private repo, `hf auth login`") from None
    except RevisionNotFoundError:
        raise ConfigError(setting.rsplit(".", 1)[0] + ".revision", f"{repo} has no revision '{revision}'",
                          "use an existing branch, tag or commit, or revision=null") from None
    except EntryNotFoundError:
        raise ConfigError(setting, f"{repo} has no {filename}: it is not a transformers checkpoint",
                          "pass the hub id of a model repo (with config.json and weights)") from None
    except HfHubHTTPError as e:
        raise ConfigError(setting, f"the hub refused {repo} ({str(e).splitlines()[0][:160]})",
                          _hub_fix(repo)) from None
    except Exception as e:  # no route, DNS, timeout, proxy: the hub cannot be reached from here
        raise ConfigError(setting, f"{repo} is not in the local cache and the hub cannot be reached "
                          f"({type(e).__name__})", _hub_fix(repo) + ", or set HF_HUB_OFFLINE=1 once it is cached"
                          ) from None


def read_config(src: Source) -> dict[str, Any] | None:
    """config.json of a source, when it is on disk (a local folder, or cached); text_config merged in."""
    f = src.local / "config.json" if src.local is not None else src.cached_file
    if f is None or not f.is_file() or f.name != "config.json":
        return None
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(src.setting, f"{f} is not readable JSON ({e})", "restore the checkpoint's config.json"
                          ) from None
    return flat_config(d)


@dataclass(frozen=True)
class TargetFacts:
    """What the target's config.json says, before any weights load."""

    model_type: str | None
    hybrid: bool
    context: int | None  # max_position_embeddings
    config: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # config.json, text_config merged
    weights_bytes: int | None = None  # the target's and drafter's checkpoint files, where on disk (checkpoint_bytes)
    drafter_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # a pretrained one's


def target_facts(cfg: dict[str, Any], setting: str, method: str, trust_remote_code: bool) -> TargetFacts:
    """The family, hybrid or not, and context of a target config; refuses what cannot run `method`."""
    from ddtree.engine.families import FAMILIES, family

    mtype = cfg.get("text_model_type") or cfg.get("model_type")
    outer = cfg.get("model_type")
    if not trust_remote_code and outer is not None:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        )

        known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
        if outer not in known and mtype not in known:
            if outer in FAMILIES:  # a family we run, from a later transformers than this one
                import transformers

                raise ConfigError(setting, f"its config.json is a '{outer}' model, which transformers "
                                  f"{transformers.__version__} does not have", "upgrade transformers "
                                  "(pip install -U transformers; 5.25 has it)")
            remote = "auto_map" in cfg
            raise ConfigError(setting, f"its config.json is a '{outer}' model, which this transformers cannot load "
                              "as a causal LM", "set model.trust_remote_code=true (the repo ships its own code)"
                              if remote else "pass a causal language model (a *ForCausalLM checkpoint)")
    types = [t for t in (mtype, outer) if t]
    layer_types = cfg.get("layer_types") or []
    hybrid = any(family(t).gdn or family(t).recurrent for t in types) \
        or any("linear" in str(t) or "mamba" in str(t) for t in layer_types)
    for t in types:
        check_target_supported(t, method, "use method=ar drafter=none for this model family")
    ctx = cfg.get("max_position_embeddings")
    return TargetFacts(mtype, hybrid, int(ctx) if isinstance(ctx, int) and ctx > 0 else None)


# an attention backend -> the flag a transformers model class sets when it takes it (eager: every class)
ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                   "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn"}


def model_class(cfg: dict[str, Any]) -> type | None:
    """The transformers class a config.json loads as (AutoModelForCausalLM's, else a wrapper's image-text-to-text one:
    ddtree.engine.families.auto_model_class; None: remote code or unknown)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT,
    )

    names = [CAUSAL.get(cfg.get("model_type")), CAUSAL.get(cfg.get("text_model_type")),
             IMAGE_TEXT.get(cfg.get("model_type")), *(cfg.get("architectures") or [])]
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type):
            return cls
    return None


def check_attention_supported(cfg: dict[str, Any], backend: str, setting: str = "attention.target") -> None:
    """Refuse a backend the target's model class does not take (transformers would raise after loading)."""
    from ddtree.engine.attention import base_backend
    from ddtree.engine.families import family

    base = base_backend(backend)
    mtype = str(cfg.get("text_model_type") or cfg.get("model_type"))
    if base in ATTENTION_PACKAGES and family(mtype).sinks and not _flash_takes_sinks(base):
        raise ConfigError(setting, f"'{mtype}' attends to learned sinks, which the installed {base} kernel does not "
                          "take (transformers would drop them: a wrong output)", "use attention=auto (eager here)")
    flag = ATTENTION_FLAGS.get(base)
    cls = model_class(cfg) if flag else None
    if cls is None or getattr(cls, flag, True):
        return
    takes = ["eager"] + [b for b, f in ATTENTION_FLAGS.items() if getattr(cls, f, False) and b != "flash_attention_3"]
    raise ConfigError(setting, f"{cls.__name__} (model_type '{cfg.get('model_type')}') does not take the '{base}' "
                      "attention backend", f"use attention={'sdpa' if 'sdpa' in takes else 'eager'} (it takes: "
                      f"{', '.join(takes)})")


def _flash_takes_sinks(base: str) -> bool:
    """Whether the installed flash kernel of `base` takes attention sinks: transformers passes them only to a kernel
    whose signature has `s_aux` or `learnable_sink`, and drops them silently otherwise."""
    import importlib
    import inspect

    module = ATTENTION_PACKAGES.get(base, (None,))[0]
    try:
        fn = importlib.import_module(module).flash_attn_func if module else None
        params = inspect.signature(fn).parameters if fn is not None else {}
    except Exception:  # noqa: BLE001 (not installed, or a wheel that does not import: no sinks here)
        return False
    return "s_aux" in params or "learnable_sink" in params


def auto_attention(cfg: dict[str, Any] | None, device: str, dtype: str) -> str:
    """attention=auto: the fastest backend the target's class takes on `device` that keeps every output exact.
    sdpa where the class takes it (eager: one more launch per attention); a class without sdpa (gpt-oss: its sinks)
    gets a flash kernel that takes sinks on CUDA in half precision, else eager."""
    from ddtree.engine.families import family

    cls = model_class(cfg) if cfg else None
    if cls is None or getattr(cls, "_supports_sdpa", True):
        return "sdpa"
    sinks = family(str(cfg.get("text_model_type") or cfg.get("model_type"))).sinks
    if device.startswith("cuda") and dtype not in ("float32", "auto") and getattr(cls, "_supports_flash_attn", False):
        for base in ("flash_attention_3", "flash_attention_2"):
            if (not sinks or _flash_takes_sinks(base)) and importlib.util.find_spec(ATTENTION_PACKAGES[base][0]):
                return base
    return "eager"


def resolve_attention(rc, cfg: dict[str, Any] | None) -> bool:
    """Replace attention.target/drafter=auto by the backend chosen for this target and device (recorded in rc.tags
    as `ddtree.attention_auto`, printed in the run's summary); whether any was. The caller checks the chosen ones as
    explicit settings are (config_checks.check_attention_settings)."""
    from ddtree.pipeline.models import resolve_device

    a = rc.attention
    if AUTO not in (a.target, a.drafter):
        return False
    auto = [k for k in ("target", "drafter") if getattr(a, k) == AUTO]
    if a.target == AUTO:
        dtype = rc.model.dtype if rc.model.dtype != "auto" else "float32" if rc.model.tiny is not None else "auto"
        if dtype == "auto" and cfg:
            dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")
        a.target = auto_attention(cfg, resolve_device(rc.device), dtype)
    if a.drafter == AUTO:
        a.drafter = "sdpa"  # the DFlash drafter's (and the MTP head's) fastest: one fused kernel on every device
    rc.tags = {**rc.tags, "ddtree.attention_auto": ", ".join(auto)}
    return True


def attention_backends(rc) -> dict[str, str | None]:
    """The attention backends this job runs: the target's, and its drafter's (its kind's `attention`: a DFlash
    drafter's is attention.drafter; the MTP head runs the target's where its layer takes it, else sdpa; AR: None)."""
    kind = get_method(rc.method).drafter_kind
    drafter = kind.attention(rc.attention.target, rc.attention.drafter) if kind is not None else None
    return {"target": rc.attention.target, "drafter": drafter}


def attention_line(rc) -> str:
    """The run summary's line: the backends that ran, and which of the settings attention=auto chose."""
    kind = get_method(rc.method).drafter_kind
    ran = attention_backends(rc)
    line = f"target {ran['target']}"
    if kind is not None:  # the MTP head has no setting of its own: the target's backend where it runs it
        line += f", {kind.attention_label} {ran['drafter']}"
    used = ("target", "drafter") if kind is not None and kind.own_attention else ("target",)
    auto = [k for k in (rc.tags.get("ddtree.attention_auto") or "").split(", ") if k in used]
    return line + (f" (auto: {', '.join(auto)})" if auto else "")


def check_tree_fits(cfg: dict[str, Any], rc) -> None:
    """A DDTree budget whose verification round would not fit in the device's memory, with the largest that fits."""
    from ddtree.engine.checks import DTYPE_BYTES, check_tree_memory
    from ddtree.pipeline.models import resolve_device

    if not get_method(rc.method).reads_budget:
        return
    dtype = rc.model.dtype if rc.model.dtype != "auto" else str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
    dtype_bytes = DTYPE_BYTES.get(dtype, 4 if rc.model.tiny is not None else 2)
    budgets = [int(b) for b in rc.auto.candidates] + [int(rc.auto.calibration_budget)] if rc.budget == "auto" else [rc.budget]
    for budget in budgets:  # budget=auto: every budget the calibration may build
        check_tree_memory(cfg, budget, dtype_bytes, resolve_device(rc.device))


def flat_config(d: dict[str, Any]) -> dict[str, Any]:
    """A config.json as one dict: a multimodal config's text_config merged in (model types kept apart)."""
    text = d.get("text_config")
    return {**d, **text, "model_type": d.get("model_type"), "text_model_type": text.get("model_type")} \
        if isinstance(text, dict) else d


def preflight(rc) -> TargetFacts | None:
    """Every source a job will load (target, tokenizer, drafter) is there; the target's facts from its config.

    Adds the family and hybrid-or-not to rc.tags (what ran is recorded, as its config.json says)."""
    m = rc.model
    if m.tiny is not None:
        from ddtree.tiny import tiny_config

        c = tiny_config(m.tiny.model_type, vocab_size=m.tiny.vocab_size, num_hidden_layers=m.tiny.num_hidden_layers)
        cfg = flat_config(c.to_dict())
        facts = replace(target_facts(cfg, "model.tiny.model_type", rc.method, True), config=cfg)
    else:
        src = check_source("model.name_or_path", m.name_or_path, m.revision, ("config.json",))
        tok_setting = "model.tokenizer" if m.tokenizer else "model.name_or_path"
        check_source(tok_setting, m.tokenizer or m.name_or_path, m.revision, TOKENIZER_FILES, "a tokenizer")
        cfg = read_config(src)
        facts = target_facts(cfg, "model.name_or_path", rc.method, m.trust_remote_code) if cfg else None
        if facts is not None:
            facts = replace(facts, config=cfg, weights_bytes=checkpoint_bytes(src))
        kind = get_method(rc.method).drafter_kind
        if kind is not None and kind.in_target is not None:  # e.g. the MTP head's tensors: no weights load
            kind.in_target(m.name_or_path, m.revision)
        if facts is not None:  # recorded as run tags: what the checkpoint is, read from its config
            rc.tags = {**rc.tags, "ddtree.model_type": str(facts.model_type), "ddtree.hybrid": str(facts.hybrid).lower()}
    check_tensor_parallel(m, world_from_env(), cfg)  # the launch and the target's heads, before any weight loads
    resolve_attention(rc, cfg)  # (the caller checks the chosen backends: ddtree.pipeline.job.configure)
    if cfg and rc.engine == "upstream" and loads_drafter(rc.method):
        check_upstream_embeddings(cfg)
    if cfg:  # what the target's class and the device's memory take, from its config (no weights)
        check_attention_supported(cfg, rc.attention.target)
        check_tree_fits(cfg, rc)
    d = rc.drafter
    if loads_drafter(rc.method) and d.kind == "pretrained":
        src = check_source("drafter.name_or_path", d.name_or_path, d.revision, ("config.json",), "a drafter checkpoint")
        drafter_config = read_config(src)
        resolve_auto_scoring(rc, drafter_config)
        if facts is not None:
            weights = None if facts.weights_bytes is None else facts.weights_bytes + (checkpoint_bytes(src) or 0)
            facts = replace(facts, weights_bytes=weights, drafter_config=drafter_config)
    elif d.kind == "random":  # a random drafter is DFlash
        resolve_auto_scoring(rc, {})
    return facts


def check_upstream_embeddings(cfg: dict[str, Any]) -> None:
    """engine=upstream embeds the drafter's block by calling the target's embedding module: refuse a family whose
    module does more than a lookup (its drafter would draft on inputs it never saw)."""
    from ddtree.engine.families import family

    for t in {cfg.get("model_type"), cfg.get("text_model_type")} - {None}:
        if family(str(t)).embeds_more:
            raise ConfigError("engine", f"the DDTree authors' code embeds the drafter's block through a '{t}' "
                              "target's embedding module, which adds a norm the drafter never saw", "use engine=native")


def resolve_auto_scoring(rc, drafter_config: dict | None) -> None:
    """scoring=auto as the job will run it, where the drafter's config.json is on disk (the job's identity and name
    then say which scoring ran): pair for a DFlash2 drafter, marginal for a DFlash one. Without the file (a hub drafter
    not yet cached) it stays auto until the drafter loads (ddtree.pipeline.models.load_drafter)."""
    if rc.scoring == AUTO_SCORING and get_method(rc.method).reads_scoring and drafter_config is not None:
        rc.scoring = resolve_scoring(AUTO_SCORING, is_dflash2_config(drafter_config))


def check_prompt_lengths(prompts: list[Prompt], lengths: list[int], max_new_tokens: int, context: int | None,
                         truncate: bool, setting: str = "dataset") -> None:
    """Refuse a prompt whose tokens plus max_new_tokens exceed the target's context (unless truncating)."""
    if context is None or truncate:
        return
    if max_new_tokens >= context:
        raise ConfigError("max_new_tokens", f"{max_new_tokens} new tokens do not fit the target's context of "
                          f"{context} tokens", f"use max_new_tokens<={context // 2}")
    for p, n in zip(prompts, lengths, strict=True):
        if n + max_new_tokens > context:
            lower = f"lower max_new_tokens to {context - n}, " if n < context else ""
            raise ConfigError(setting, f"prompt '{p.id}' is {n} tokens; with max_new_tokens={max_new_tokens} it "
                              f"exceeds the target's context of {context} tokens",
                              f"shorten it, {lower}or set dataset.truncate=true (keeps each prompt's last tokens)")


def check_prompt_tokens(prompts: list[Prompt], tokenizer, setting: str = "dataset") -> None:
    """Refuse a turn whose text the tokenizer turns into no tokens (e.g. whitespace under a word-level one)."""
    for p in prompts:
        for k, turn in enumerate(p.turns):
            if not tokenizer(turn, add_special_tokens=False)["input_ids"]:
                where = f"turn {k + 1} of prompt '{p.id}'" if len(p.turns) > 1 else f"prompt '{p.id}'"
                raise ConfigError(setting, f"{where} ({turn[:40]!r}) is no tokens under this tokenizer: the model "
                                  "would be asked nothing", "remove it or give it words the tokenizer knows")


def keep_last(ids: list[int], max_new_tokens: int, context: int | None) -> list[int]:
    """dataset.truncate: the last tokens of a prompt, as many as fit before max_new_tokens new ones."""
    if context is None or len(ids) + max_new_tokens <= context:
        return ids
    return ids[len(ids) + max_new_tokens - context:]


# ---------------------------------------------------------------- concurrency x context in the GPU's memory

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
MEMORY_SHARE = 0.9  # of the free memory after the weights, what the streams may take (activations, the allocator's
# slack and the CUDA graphs' pools: the rest)


def checkpoint_bytes(src: Source) -> int | None:
    """The bytes of a checkpoint's weight files (a local folder, or the hub cache's snapshot folder); None where they
    are not on disk (a hub repo whose weights are not downloaded yet)."""
    folder = src.local if src.local is not None else src.cached_file.parent if src.cached_file is not None else None
    if folder is None:
        return None
    for pattern in WEIGHT_FILES:
        files = [f for f in folder.glob(pattern) if f.is_file()]
        if files:
            return sum(f.stat().st_size for f in files)
    return None


def draft_nodes(rc) -> int:
    """The most tokens one stream verifies a round under rc's method (root included): a tree's budget + 1, a chain's
    steps + 1, a DFlash block (drafter.block_size, 16 where the checkpoint decides), AR's 1."""
    from ddtree.engine.methods import BASELINE, reads_budget
    from ddtree.pipeline.schema import method_settings, method_topk

    if rc.budget == "auto" and get_method(rc.method).auto_budget:
        return max([*rc.auto.candidates, rc.auto.calibration_budget]) + 1
    if reads_budget(rc.method, method_topk(rc)):
        return int(rc.budget) + 1
    if rc.method == BASELINE:
        return 1
    settings = method_settings(rc)
    return settings.steps + 1 if settings is not None else rc.drafter.block_size or 16


def check_streams_fit(text_config: dict[str, Any], *, concurrency: int, rows: int, nodes: int, dtype_bytes: int,
                      free_bytes: int, weights_bytes: int | None, device: str = "cuda",
                      drafter_config: dict[str, Any] | None = None, setting: str = "concurrency") -> None:
    """Refuse `concurrency` streams of `rows` cache rows (trees of `nodes`) whose memory (ddtree.engine.capacity.
    stream_bytes) exceeds MEMORY_SHARE of `free_bytes` less the weights still to load, naming the largest that fits."""
    from ddtree.engine.capacity import stream_bytes

    per = stream_bytes(text_config, rows, nodes, dtype_bytes, drafter_config)
    weights = weights_bytes or 0
    allowance = int(max(free_bytes - weights, 0) * MEMORY_SHARE)
    need = concurrency * per.total
    if need <= allowance:
        return
    fits = allowance // per.total
    after = f" after the weights ({_gib(weights)})" if weights else ""
    fix = (f"use {setting}<={fits}" if fits else "use a shorter max_new_tokens or shorter prompts, or a smaller model"
           ) + " (docs/concurrency.md, Memory per stream)"
    drafter = f", drafter KV rows {_gib(per.drafter_kv)}" if per.drafter_kv else ""
    raise ConfigError(setting, f"{concurrency} streams of {rows:,} rows need about {_gib(need)} on {device} (a stream: "
                      f"KV rows {_gib(per.kv)}, GDN state {_gib(per.gdn_state)}, tree scratch {_gib(per.tree)}"
                      f"{drafter}), "
                      f"more than {MEMORY_SHARE:.0%} of its {_gib(max(free_bytes - weights, 0))} free{after}", fix)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_concurrency_fits(rc, facts: TargetFacts | None, context: int) -> None:
    """concurrency > 1 on one CUDA device holding the whole target: its streams of `context` tokens each (+ a tree)
    fit the device's free memory after the weights (check_streams_fit); elsewhere nothing is checked (a CPU's memory
    is the host's; a device map or a tensor-parallel plan spreads the model over GPUs)."""
    from ddtree.engine.checks import DTYPE_BYTES
    from ddtree.pipeline.distributed import rank_device
    from ddtree.pipeline.models import resolve_device

    m = rc.model
    if rc.concurrency <= 1 or facts is None or facts.config is None or m.device_map is not None or m.tp_plan:
        return
    device = rank_device(resolve_device(rc.device), world_from_env(), None)
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        return
    stored = DTYPE_BYTES.get(str(facts.config.get("dtype") or facts.config.get("torch_dtype") or ""), 2)
    dtype_bytes = DTYPE_BYTES.get(m.dtype, 4 if m.tiny is not None else stored)
    weights = facts.weights_bytes
    if weights is not None and m.quantization is None:  # the files' dtype -> the dtype it loads in
        weights = weights * dtype_bytes // stored
    elif m.quantization is not None:  # smaller than its files by a factor the preset decides: not counted
        weights = None
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    nodes = draft_nodes(rc)
    check_streams_fit(facts.config, concurrency=rc.concurrency, rows=context + nodes, nodes=nodes,
                      dtype_bytes=dtype_bytes, free_bytes=free, weights_bytes=weights, device=device,
                      drafter_config=facts.drafter_config if loads_drafter(rc.method) else None)
