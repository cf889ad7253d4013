"""The authors' output filter drops generated tokens equal to the drafter's mask token id.

Their `dflash_generate` and `ddtree_generate` fill the output buffer with `mask_token_id`, write the
tokens they commit, and end with `output_ids = output_ids[:, output_ids[0] != mask_token_id]` to cut
the unwritten tail. That also removes every prompt or *generated* token equal to the mask id: an
output of a target that emits it comes back shorter, with tokens missing (found by
ddtree.engine.output_check: a tiny Qwen3 whose greedy output holds the mask id 4 times in 24 tokens gave
20-token outputs, suspect at the first missing token). Written positions are always `[:start + 1]`
(the committed tokens and the bonus token at `start`), so the filter line is rewritten, in the
function's own source from the user's checkout, to `output_ids = output_ids[:, : start + 1]`; the
recompiled function shares the module's globals (later patches of `cuda_time` etc. still apply).
Real DFlash checkpoints use a reserved mask id the target never emits: this bites small vocabularies
and custom drafters.
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from types import FunctionType, ModuleType

from ..core import UPSTREAM, UPSTREAM_PACKAGE, Patch, Patcher, PatchUnavailable

ID = "upstream-mask-filter"
MODULES = (f"{UPSTREAM_PACKAGE}.dflash", f"{UPSTREAM_PACKAGE}.ddtree")
FUNCTIONS = ("dflash_generate", "ddtree_generate")
# `x = x[:, x[0] != mask_token_id]` with `start` (the committed length) in scope
FILTER = re.compile(r"^(\s*)(\w+) = \2\[:, \2\[0\] != mask_token_id\]\s*(#.*)?$", re.M)


def _fixed(fn: FunctionType) -> FunctionType | None:
    """`fn` recompiled from its source with the filter cut at the written length; None when it has no filter."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    source = "\n" * (first - 1) + textwrap.dedent("".join(lines))  # their line numbers in tracebacks
    if not FILTER.search(source):
        return None
    if not re.search(r"\bstart\b", source):
        raise PatchUnavailable(f"{fn.__qualname__} filters on mask_token_id without a 'start' to cut at")
    new = FILTER.sub(lambda m: f"{m.group(1)}{m.group(2)} = {m.group(2)}[:, : start + 1]", source)
    namespace: dict = {}
    exec(compile(new, inspect.getsourcefile(fn) or "<upstream>", "exec"), fn.__globals__, namespace)  # noqa: S102
    return namespace[fn.__name__]


def install(patcher: Patcher, module: ModuleType | None) -> str:
    assert module is not None, "deferred patch: called with the imported module"
    done = []
    for name in FUNCTIONS:
        fn = vars(module).get(name)
        if getattr(fn, "_compat_original", None) is not None:  # ddtree.py's `from dflash import` of a fixed one
            patcher.on_revert(functools.partial(setattr, module, name, fn._compat_original))
            continue
        original = inspect.unwrap(fn) if callable(fn) else fn  # under its decorator (@torch.inference_mode())
        if not isinstance(original, FunctionType) or original.__globals__ is not vars(module):
            continue
        fixed = _fixed(original)
        if fixed is not None:
            fixed._compat_original = fn
            patcher.set_attr(module, name, fixed)
            done.append(name)
    if not done:
        raise PatchUnavailable(f"{module.__name__}: no generate function with the mask_token_id output filter")
    return ", ".join(done) + ": keep [:start + 1] instead of dropping every mask_token_id"


PATCH = Patch(
    id=ID,
    targets=tuple(f"{m}:{f}" for m in MODULES for f in FUNCTIONS),
    versions={"torch": ">=2.0"},
    reason="the authors' output filter drops every generated token equal to the drafter's mask token id",
    install=install,
    for_engines=frozenset({UPSTREAM}),
    imports=MODULES,
)
