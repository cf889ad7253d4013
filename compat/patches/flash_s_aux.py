"""Flash-attention `s_aux` (attention sinks): drop it when it carries nothing, refuse to drop real sinks.

transformers forwards `s_aux` to the flash kernel only when the kernel's signature takes it (as
`s_aux`, or `learnable_sink` for FA4); older stacks failed with "unexpected keyword argument
's_aux'" or "'NoneType' object has no attribute 'to'". Two cases are still wrong on 4.57-5.24:
an empty `s_aux` tensor reaches a kernel that takes sinks (and fails there), and real sinks given to
a kernel that takes neither name are dropped silently (different outputs, no error). The fix wraps
`_process_flash_attention_kwargs`: `s_aux` that is None or empty is removed; non-empty `s_aux` with
a kernel that cannot take it raises with the fix in the message.
"""

from __future__ import annotations

from types import ModuleType

from ddtree.errors import ConfigError

from ..core import Patch, Patcher, PatchUnavailable, rebind_partials, resolve

ID = "flash-s-aux"
TARGET = ("transformers.modeling_flash_attention_utils", "_process_flash_attention_kwargs")
CACHED_PARTIALS = ("_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def carries_nothing(s_aux) -> bool:
    return s_aux is None or (hasattr(s_aux, "numel") and s_aux.numel() == 0)


def guard_s_aux(wrapped, instance, args, kwargs):
    if "s_aux" in kwargs:
        s_aux = kwargs["s_aux"]
        if carries_nothing(s_aux):
            kwargs = {k: v for k, v in kwargs.items() if k != "s_aux"}
        else:
            supports = kwargs.get("supports_mapping") or {}
            if not (supports.get("s_aux") or supports.get("learnable_sink")):
                raise ConfigError(
                    "attention",
                    "the loaded flash-attention kernel takes no `s_aux` (attention sinks), and this model has sinks; "
                    "dropping them would change its outputs",
                    "use attention=eager or sdpa, or a flash kernel that takes sinks (FA3 `s_aux`, FA4 `learnable_sink`)",
                )
    return wrapped(*args, **kwargs)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    import inspect

    owner, name, fn = resolve(*TARGET)
    params = inspect.signature(fn).parameters
    if "s_aux" not in params or "supports_mapping" not in params:
        raise PatchUnavailable(f"{TARGET[0]}:{TARGET[1]} takes no s_aux/supports_mapping here")
    proxy = patcher.wrap(owner, name, guard_s_aux)
    rebind_partials(patcher, owner, CACHED_PARTIALS, fn, proxy)
    return "empty/None s_aux dropped; sinks given to a kernel without s_aux raise"


PATCH = Patch(
    id=ID,
    targets=(":".join(TARGET),),
    versions={"transformers": ">=4.57"},
    reason="flash kernels without s_aux: drop an s_aux that carries nothing, never drop real sinks silently",
    install=install,
    condition_doc="at call time: s_aux passed; the kernel's signature decides",
)
