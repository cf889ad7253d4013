"""`past_key_values=` -> `cache=` for 4.x-style calls of models whose forward takes `cache`.

transformers 5.24 renamed the model's cache argument to `cache`; `past_key_values=` still works
with a deprecation warning and is removed in 5.40. Code written for 4.x (the authors' DFlash/DDTree
loops) passes `past_key_values=`. The rename happens in `PreTrainedModel.__call__`, and only for
models whose `forward` declares `cache` and not `past_key_values` (a drafter whose own forward takes
`past_key_values` keeps it).
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

from ..core import UPSTREAM, Patch, Patcher, resolve

ID = "cache-kwarg"
TARGET = ("transformers.modeling_utils", "PreTrainedModel.__call__")


@functools.cache
def forward_takes_cache(cls: type) -> bool:
    """Whether `cls.forward` takes `cache` (and not `past_key_values`)."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params and "past_key_values" not in params


def rename_cache_kwarg(wrapped, instance, args, kwargs):
    if "past_key_values" in kwargs and instance is not None and forward_takes_cache(type(instance)):
        kwargs = dict(kwargs)
        legacy = kwargs.pop("past_key_values")
        if kwargs.get("cache") is not None and legacy is not None and kwargs["cache"] is not legacy:
            raise TypeError(
                f"{type(instance).__name__}: got both `cache=` and `past_key_values=`; pass `cache=` only"
            )
        if kwargs.get("cache") is None:
            kwargs["cache"] = legacy
    return wrapped(*args, **kwargs)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    owner, _, _ = resolve(TARGET[0], TARGET[1])
    patcher.wrap(owner, "__call__", rename_cache_kwarg)
    return "renames past_key_values= to cache= for models whose forward takes cache"


PATCH = Patch(
    id=ID,
    targets=(":".join(TARGET),),
    versions={"transformers": ">=5.24"},
    reason="4.x code passes past_key_values=; 5.24 renamed it to cache= (deprecated, removed in 5.40)",
    install=install,
    for_engines=frozenset({UPSTREAM}),
)
