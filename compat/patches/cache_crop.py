"""Cache crop semantics: `cache.crop(absolute_length)` (4.x) becomes `cache.crop(-tokens_to_drop)`.

Up to 5.12 `crop(n)` kept the first n tokens (a negative n dropped -n). It was deprecated around
5.16 and from 5.18 a positive argument raises: `crop` takes the negative count of tokens to drop.
Code written for 4.x (the authors' rollback after verification) calls `crop(start)`. A positive
argument is translated using the cache's current length; `crop(n)` with n >= length is a no-op, as
it was in 4.x. Zero and negative arguments pass through unchanged (they mean the same in both APIs,
except `crop(0)`, which 4.x read as "empty the cache" and 5.x as "drop nothing": left to 5.x).
"""

from __future__ import annotations

import operator
from types import ModuleType

from ..core import UPSTREAM, Patch, Patcher, resolve

ID = "cache-crop-absolute"
TARGET = ("transformers.cache_utils", "Cache.crop")


def crop_absolute_length(wrapped, instance, args, kwargs):
    if instance is None:
        return wrapped(*args, **kwargs)
    if len(args) == 1 and not kwargs:
        length = args[0]
    elif not args and set(kwargs) == {"max_length"}:  # the 4.x keyword
        length = kwargs["max_length"]
    else:
        return wrapped(*args, **kwargs)
    if isinstance(length, bool):
        return wrapped(*args, **kwargs)
    try:
        length = operator.index(length)  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        return wrapped(*args, **kwargs)
    if length <= 0:
        return wrapped(length)
    current = instance.get_seq_length()
    if length >= current:
        return None
    return wrapped(length - current)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    owner, name, _ = resolve(TARGET[0], TARGET[1])
    patcher.wrap(owner, name, crop_absolute_length)
    return "crop(n > 0) keeps the first n tokens, as in 4.x"


PATCH = Patch(
    id=ID,
    targets=(":".join(TARGET),),
    versions={"transformers": ">=5.16"},
    reason="4.x code calls cache.crop(absolute_length); 5.18+ raises unless given a negative count",
    install=install,
    for_engines=frozenset({UPSTREAM}),
)
