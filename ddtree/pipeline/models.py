"""The models a job runs on, loaded once per process: a sweep's jobs (one process under Hydra's basic
launcher) reuse the target and drafter when their settings are the same."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from ddtree.engine.drafter_kinds import DrafterKind, DrafterLoad
from ddtree.engine.methods import METHODS
from ddtree.errors import ConfigError
from ddtree.pipeline.schema import AUTO, RunConfig


@dataclass
class ModelCache:
    """The last target and drafter loaded, so the jobs of a sweep (one process) reuse them.

    One of each is kept: a sweep over models frees the previous one instead of piling them up.
    """

    target_key: str | None = None
    target: Any = None
    tokenizer: Any = None
    drafter_key: str | None = None
    drafter: Any = None
    warmed: set[str] = field(default_factory=set)
    # AR baseline records of finished shards, by baseline_key(): reused by later jobs (baseline_reuse=true); with
    # them the wall seconds of their batched calls (concurrency > 1; None one prompt at a time)
    baselines: dict[str, tuple[str, list[dict[str, Any]], float | None]] = field(default_factory=dict)
    # validation tolerances calibrated on this target, by baseline outputs and rule (ddtree.pipeline.output_verdicts)
    calibrations: dict[str, Any] = field(default_factory=dict)

    def clear(self) -> None:
        self.target_key = self.target = self.tokenizer = self.drafter_key = self.drafter = None
        self.warmed.clear()
        self.baselines.clear()
        self.calibrations.clear()


MODELS = ModelCache()  # the per-process model cache (Hydra's basic launcher runs a sweep's jobs here)


def resolve_device(device: str) -> str:
    """auto: cuda where there is one, else cpu; a CUDA device asked for where there is none is a ConfigError.
    The one resolver of runs (ddtree.run), re-checks and training (ddtree.train)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{device} requested but CUDA is not available", "use device=cpu or auto")
    return device


def torch_dtype(name: str | None, *, tiny: bool):
    import torch

    if name in (None, "auto"):
        return torch.float32 if tiny else "auto"
    return getattr(torch, name)


def load_target(rc: RunConfig, device: str):
    """(model, tokenizer): a tiny random model built in code, or a checkpoint.

    With model.device_map set, accelerate places the layers (over this rank's GPUs under torchrun)
    and `device` is not used for the target; see ddtree.pipeline.distributed.input_device.
    """
    from ddtree.pipeline.distributed import dispatch, rank_max_memory, tensor_parallel, world_from_env

    m = rc.model
    tp = tensor_parallel(m, world_from_env())
    max_memory = rank_max_memory(world_from_env()) if m.device_map is not None else None
    from ddtree.engine import attention

    # attention=auto not resolved by a job's preflight (a direct call): transformers' own choice, sdpa where the
    # class takes it, else eager (what preflight picks off CUDA)
    attn = None if rc.attention.target == AUTO else rc.attention.target
    if attn in attention.SPLIT_IMPLEMENTATIONS:  # a tree implementation by name: registered first
        attention.register()
    if m.tiny is not None:
        from ddtree.tiny import tiny_model

        t = m.tiny
        model = tiny_model(t.model_type, seed=t.seed, attn_implementation=attn,
                           dtype=torch_dtype(m.dtype, tiny=True), vocab_size=t.vocab_size,
                           num_hidden_layers=t.num_hidden_layers)
        if m.quantization is not None:  # as a published checkpoint would be: saved, then loaded quantized
            model = quantized_copy(model, m.quantization, attn)
        if tp is not None:  # as a published checkpoint would be: saved, then loaded sharded over the group
            return sharded_copy(model, tp, attn), load_tokenizer(rc)
        model = dispatch(model, m.device_map, max_memory) if m.device_map is not None else model.to(device)
        return model.eval(), load_tokenizer(rc)
    return load_checkpoint(m.name_or_path, device=device, dtype=torch_dtype(m.dtype, tiny=False),
                           attn_implementation=attn, tokenizer=m.tokenizer, revision=m.revision,
                           trust_remote_code=m.trust_remote_code, device_map=m.device_map, max_memory=max_memory,
                           quantization=m.quantization, tp=tp)


def sharded_copy(model, tp, attn_implementation: str | None):
    """A model built in code, saved and loaded back sharded over this rank's tensor-parallel group (each rank builds
    the same seeded model and keeps its own shards)."""
    import tempfile

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from ddtree.pipeline.distributed import tp_load_kwargs, tp_loading

    with tempfile.TemporaryDirectory() as tmp:
        # written by this rank itself: save_pretrained writes on rank 0 alone once a process group is up
        model.config.save_pretrained(tmp)
        save_model(model, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        with tp_loading(tp):
            return AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype, attn_implementation=attn_implementation,
                                                        use_kernels=False, **tp_load_kwargs(tp)).eval()


def quantized_copy(model, quantization: Any, attn_implementation: str | None):
    """A model built in code, saved and loaded back under `quantization` (what from_pretrained does to a checkpoint)."""
    import tempfile

    from ddtree.engine.families import auto_model_class
    from ddtree.pipeline.quantization import transformers_config

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        device = next(model.parameters()).device
        return auto_model_class(model.config.model_type).from_pretrained(
            tmp, dtype=model.dtype, attn_implementation=attn_implementation, device_map=device,
            quantization_config=transformers_config("model.quantization", quantization)).eval()


def load_checkpoint(name_or_path: str, *, device: str, dtype: Any, attn_implementation: str,
                    tokenizer: str | None = None, revision: str | None = None, trust_remote_code: bool = False,
                    device_map: Any = None, max_memory: dict | None = None,
                    setting: str = "model.name_or_path", quantization: Any = None, tp: Any = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of a transformers checkpoint: the one loader of runs and training.
    device_map (accelerate's) places the layers; without one the whole model goes to `device`. quantization: a
    preset or mapping (ddtree.pipeline.quantization), applied by transformers at load.
    use_kernels=False: from 5.25, where the `kernels` package is installed, transformers kernelizes a loaded model by
    default, swapping hub kernels (downloaded, some remote code) into RMSNorm, activations, RoPE and GDN ops on a GPU.
    The engine's lean forward does those steps itself, so the model's own forward (prefill, references) would no longer
    compute what the lean one does (a bf16 verdict's "exact" lost). A multimodal wrapper without a causal-LM class
    (Muse-Glimmer) loads as its image-text-to-text model, whose text path the engine drives.
    tp: this rank's ddtree.pipeline.distributed.TensorParallel: the model sharded over its group (transformers'
    tp_plan), on the device transformers binds (cuda:LOCAL_RANK, or the CPU)."""
    import contextlib

    from transformers import AutoConfig, AutoTokenizer

    from ddtree.engine.families import auto_model_class

    kw = {"max_memory": max_memory} if max_memory else {}
    where = contextlib.nullcontext()
    if tp is not None:
        from ddtree.pipeline.distributed import tp_load_kwargs, tp_loading

        kw.update(tp_load_kwargs(tp))
        where, device = tp_loading(tp), None
    if quantization is not None:
        from ddtree.pipeline.quantization import transformers_config

        kw["quantization_config"] = transformers_config("model.quantization", quantization)
    try:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
        with where:
            model = auto_model_class(config.model_type).from_pretrained(
                name_or_path, config=config, dtype=dtype, attn_implementation=attn_implementation, revision=revision,
                trust_remote_code=trust_remote_code, device_map=device_map if device_map is not None else device,
                use_kernels=False, **kw)
        tok = AutoTokenizer.from_pretrained(tokenizer or name_or_path, revision=revision,
                                            trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ConfigError(setting, f"cannot load {name_or_path}: {str(e).splitlines()[0]}",
                          "point to a Hugging Face checkpoint directory or hub id") from None
    return model.eval(), tok


def load_tokenizer(rc: RunConfig):
    """The target's tokenizer (the tiny character tokenizer for tiny models); no weights load."""
    m = rc.model
    if m.tiny is not None:
        from ddtree.tiny import tiny_tokenizer

        return tiny_tokenizer(m.tiny.vocab_size)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(m.tokenizer or m.name_or_path, revision=m.revision,
                                         trust_remote_code=m.trust_remote_code)


def target_context(target) -> int | None:
    """The target's context length (max_position_embeddings), if its config has one."""
    ctx = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    return ctx if isinstance(ctx, int) and ctx > 0 else None


def load_drafter(rc: RunConfig, target, device: str):
    """The job's drafter from a checkpoint (None for drafter=none): its kind's row loads it (DrafterKind.load: random
    or from its checkpoint, checked against the target); then the scoring it allows, and its quantization."""
    d = rc.drafter
    if d.kind == "none":
        return None
    from ddtree.engine.methods import check_scoring, get_method, resolve_scoring

    method = get_method(rc.method)
    random = d.kind == "random"
    dtype = target.dtype if random or d.dtype in (None, "auto") else torch_dtype(d.dtype, tiny=False)
    attn = "sdpa" if rc.attention.drafter == AUTO else rc.attention.drafter  # (auto, not resolved by preflight)
    spec = DrafterLoad(random=random, name_or_path=d.name_or_path, dtype=dtype, device=device, revision=d.revision,
                       attention=attn, seed=d.seed, num_layers=d.num_layers, block_size=d.block_size,
                       target_layer_ids=d.target_layer_ids)
    drafter = method.drafter_kind.load(target, spec)
    check_scoring(rc.scoring, rc.method, drafter)
    if method.reads_scoring:  # auto, where preflight could not read the drafter's config.json
        rc.scoring = resolve_scoring(rc.scoring, method.drafter_kind.pair_scores(drafter))
    if d.quantization is not None:
        from ddtree.pipeline.quantization import quantize_module

        quantize_module(drafter, "drafter.quantization", d.quantization)
    return drafter.eval()


def load_mtp_head(rc: RunConfig, target):
    """method=mtp: the MTP head stored in the target's checkpoint (a random one for a tiny model built in code)."""
    from ddtree.engine.drafter.mtp import MTPHead

    if rc.model.tiny is not None:
        return MTPHead.random_for_target(target, seed=rc.mtp.seed)
    return MTPHead.from_target(target, rc.model.name_or_path, revision=rc.model.revision)


def model_device(target, rc: RunConfig, device: str) -> str:
    """Where inputs (and the drafter) go: `device`, or with a device map the embeddings' execution device."""
    if rc.model.device_map is None:
        return device
    from ddtree.pipeline.distributed import input_device

    return str(input_device(target))


def cache_key(*parts: Any) -> str:
    """A stable string for settings that decide what gets loaded or computed."""
    return json.dumps(parts, sort_keys=True, default=str)


def get_models(rc: RunConfig, device: str, cache: ModelCache):
    """(target, tokenizer, drafter), loading only what this job's settings change (`cache`: what is loaded)."""
    m = OmegaConf.to_container(OmegaConf.structured(rc.model))
    tkey = cache_key(m, device, rc.attention.target)
    if cache.target_key != tkey:
        cache.clear()
        cache.target, cache.tokenizer = load_target(rc, device)
        cache.target_key = tkey
    kind = METHODS[rc.method].drafter_kind
    if kind is None:
        return cache.target, cache.tokenizer, None
    dkey, load = drafter_source(kind)(rc, cache, device, tkey)
    if cache.drafter_key != dkey:
        cache.drafter = cache.drafter_key = None  # a load that fails leaves no key naming a drafter not there
        cache.drafter = load()
        cache.drafter_key = dkey
    return cache.target, cache.tokenizer, cache.drafter


def _checkpoint_source(rc: RunConfig, cache: ModelCache, device: str, tkey: str):
    """A checkpoint kind's drafter (DrafterKind.checkpoint): its cache key and loader (engine=upstream: the authors'
    class holding the same tensors)."""
    d = OmegaConf.to_container(OmegaConf.structured(rc.drafter))
    if rc.drafter.kind == "pretrained":
        d.pop("block_size")  # applied at generate time, not at load time

    def load():
        drafter = load_drafter(rc, cache.target, model_device(cache.target, rc, device))
        if rc.engine == "upstream":
            from ddtree.upstream.engine import upstream_drafter

            return upstream_drafter(load_upstream(rc), drafter)
        return drafter

    kind = METHODS[rc.method].drafter_kind.name
    return cache_key(tkey, kind, d, rc.attention.drafter, rc.engine, rc.upstream.path), load


def _own_head_source(rc: RunConfig, cache: ModelCache, device: str, tkey: str):
    """The target's own MTP head (DrafterKind.from_target): its cache key and loader."""
    return (cache_key(tkey, "mtp", rc.mtp.seed if rc.model.tiny is not None else None),
            lambda: load_mtp_head(rc, cache.target))


def drafter_source(kind: DrafterKind):
    """How a drafter kind is keyed and loaded into a job's drafter slot: from a checkpoint, or the target's own."""
    return _checkpoint_source if kind.checkpoint else _own_head_source


def load_upstream(rc: RunConfig):
    """engine=upstream: the authors' modules from upstream.path, patched as compat.* says (cached per path)."""
    from ddtree.upstream.engine import load_upstream_engine

    return load_upstream_engine(rc.upstream.path, only=rc.compat.only, skip=rc.compat.skip,
                                patch=rc.compat.enabled)
