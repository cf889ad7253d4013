"""model.quantization / drafter.quantization: a quantized target (or drafter), as transformers loads it.

A setting is a named preset (`PRESETS`) or a transformers quantization config as a mapping
(`{quant_method: quanto, weights: int8}`; torchao also takes `{quant_method: torchao, quant_type: Int8WeightOnlyConfig}`
with optional `quant_type_kwargs`). It is checked before any model work: an unknown preset, a mapping transformers
cannot read, a backend whose package is missing, or one that does not run on the device is one ConfigError (exit 2).

The target is loaded by `from_pretrained(..., quantization_config=...)` (a tiny model built in code is saved and
loaded back the same way); the engine reads a quantized layer only by calling it (ddtree.engine.weights), so every
method stays lossless against the quantized model itself. The drafter keeps its own precision unless
drafter.quantization says otherwise; it is ddtree's own module, so only backends that quantize a module in place
(torchao, quanto) take it. docs/targets.md lists what was tried and how the engine treats each.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """A transformers quantization method: the module it imports, its pip name, the devices it runs on."""

    module: str | None
    pip: str
    devices: tuple[str, ...]
    in_place: bool = False  # quantizes an arbitrary module in place (the DFlash drafter)


CPU_CUDA, CUDA = ("cpu", "cuda"), ("cuda",)
BACKENDS = {
    "torchao": Backend("torchao", "torchao", CPU_CUDA, in_place=True),
    "quanto": Backend("optimum.quanto", "optimum-quanto", CPU_CUDA, in_place=True),
    "hqq": Backend("hqq", "hqq", CPU_CUDA),
    "compressed-tensors": Backend("compressed_tensors", "compressed-tensors", CPU_CUDA),
    "fp8": Backend(None, "transformers", CUDA),  # fine-grained FP8 (Qwen3.6-27B-FP8): Triton kernels on CUDA
    "fbgemm_fp8": Backend("fbgemm_gpu", "fbgemm-gpu", CUDA),
    "bitsandbytes_4bit": Backend("bitsandbytes", "bitsandbytes", CUDA),
    "bitsandbytes_8bit": Backend("bitsandbytes", "bitsandbytes", CUDA),
    "awq": Backend("gptqmodel", "gptqmodel", CUDA),
    "gptq": Backend("gptqmodel", "gptqmodel", CUDA),
    "nvfp4": Backend(None, "transformers", CUDA),
    "mxfp4": Backend(None, "transformers", CUDA),
}

# name -> (quant_method, mapping); torchao's mapping names a config class of torchao.quantization
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "int8": ("torchao", {"quant_type": "Int8WeightOnlyConfig"}),  # weight-only int8, CPU and CUDA
    "int4": ("torchao", {"quant_type": "Int4WeightOnlyConfig", "quant_type_kwargs": {"group_size": 128}}),
    "quanto_int8": ("quanto", {"weights": "int8"}),
    "quanto_int4": ("quanto", {"weights": "int4"}),
    "fp8": ("fp8", {"weight_block_size": [128, 128]}),  # as the official *-FP8 checkpoints are quantized
    "nf4": ("bitsandbytes_4bit", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_compute_dtype": "bfloat16"}),
    "bnb_int8": ("bitsandbytes_8bit", {"load_in_8bit": True}),
}
PRESET_DEVICES = {"int4": CUDA}  # torchao's int4 weight-only kernels (tinygemm / fbgemm) run on CUDA
# (quant_method, a mapping's items) -> why ddtree cannot run it: refused before loading, never a traceback mid-job
UNSUPPORTED: dict[tuple[str, tuple[tuple[str, Any], ...]], str] = {
    # optimum-quanto 0.2.7's int4 weights (QBitsTensor) raise "Cannot set version_counter for inference tensor" in
    # their matmul under torch.inference_mode, which every forward of the engine (and of the AR baseline) runs in
    ("quanto", (("weights", "int4"),)): "optimum-quanto's int4 weights fail under torch.inference_mode, "
                                        "which every ddtree forward runs in",
}


def _method_and_mapping(setting: str, value: Any) -> tuple[str, dict[str, Any], str]:
    """(quant_method, the mapping without it, a label) of a preset name or a mapping."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ConfigError(setting, f"unknown quantization preset '{value}'",
                              f"use one of: {', '.join(PRESETS)}, or a transformers quantization config as a mapping")
        method, mapping = PRESETS[value]
        return method, dict(mapping), value
    if not isinstance(value, Mapping) or not value.get("quant_method"):
        raise ConfigError(setting, f"must be a preset name or a mapping with quant_method, got {value!r}",
                          f"use e.g. {setting}=int8 or {setting}={{quant_method:quanto,weights:int8}}")
    mapping = {k: v for k, v in value.items() if k != "quant_method"}
    method = str(value["quant_method"])
    return method, mapping, method


def label(value: Any) -> str | None:
    """A short name for summaries and run tags: the preset, or the mapping's quant_method (None: unquantized)."""
    if value is None:
        return None
    return value if isinstance(value, str) else str(value.get("quant_method"))


def check_quantization(setting: str, value: Any, device: str, drafter: bool = False) -> None:
    """Refuse, before any model work, what would fail at load time or run off the device (one ConfigError)."""
    if value is None:
        return
    method, _, name = _method_and_mapping(setting, value)
    backend = BACKENDS.get(method)
    if backend is None:
        raise ConfigError(setting, f"quant_method '{method}' is not one ddtree has checked",
                          f"use one of: {', '.join(BACKENDS)} (docs/targets.md)")
    if drafter and not backend.in_place:
        raise ConfigError(setting, f"the DFlash drafter is ddtree's own module, which {method} cannot quantize",
                          "use drafter.quantization=int8 (torchao) or quanto_int8, or leave it unset")
    _, mapping, _ = _method_and_mapping(setting, value)
    for (m, items), why in UNSUPPORTED.items():
        if m == method and all(mapping.get(k) == v for k, v in items):
            raise ConfigError(setting, f"{name}: {why}",
                              f"use {setting}=quanto_int8 or int8 (torchao), or int4 (torchao) on CUDA")
    devices = PRESET_DEVICES.get(name, backend.devices)
    kind = "cuda" if device.startswith("cuda") else device
    if kind not in devices:
        raise ConfigError(setting, f"{name} runs on {', '.join(devices)} only, but the device is {device}",
                          f"use {setting}=int8 (torchao, CPU and CUDA), or device=cuda")
    if backend.module is not None and importlib.util.find_spec(backend.module.split(".")[0]) is None:
        raise ConfigError(setting, f"{name} needs the '{backend.module}' package, which is not installed",
                          f"pip install {backend.pip}, or leave {setting} unset")
    transformers_config(setting, value)  # a mapping transformers cannot read: refused here, not at load time


def transformers_config(setting: str, value: Any):
    """The transformers quantization config object of a preset or mapping."""
    method, mapping, _ = _method_and_mapping(setting, value)
    try:
        if method == "torchao" and isinstance(mapping.get("quant_type"), str):
            from transformers import TorchAoConfig

            quantization = importlib.import_module("torchao.quantization")
            cls = getattr(quantization, mapping.pop("quant_type"))
            return TorchAoConfig(cls(**mapping.pop("quant_type_kwargs", {}) or {}), **mapping)
        from transformers.quantizers.auto import AutoQuantizationConfig

        return AutoQuantizationConfig.from_dict({"quant_method": method, **mapping})
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (whatever transformers or the backend raises on a bad mapping)
        raise ConfigError(setting, f"transformers cannot build a {method} config from it "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                          "check the mapping's keys against the transformers quantization config") from None


def quantize_module(module, setting: str, value: Any):
    """Quantize ddtree's own module (the DFlash drafter) in place, as the backend would a transformers model's
    Linear layers; returns it."""
    method, _, _ = _method_and_mapping(setting, value)
    config = transformers_config(setting, value)
    if method == "torchao":
        from torchao.quantization import quantize_

        quantize_(module, config.get_apply_tensor_subclass())
    else:  # quanto
        from optimum import quanto

        quanto.quantize(module, weights=getattr(quanto, f"q{config.weights}"))
        quanto.freeze(module)
    return module
