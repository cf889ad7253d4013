"""The authors' DDTree / DFlash loops on hybrid Gated DeltaNet targets (the hybrid half of patch 7).

Their loops verify a draft (a tree in `ddtree_generate`, a chain in `dflash_generate`) in one target
forward, then roll the target cache back with `compact_dynamic_cache(cache, start, accepted)` (K/V
compaction, then `crop`) or `crop(start)`. On a hybrid target (qwen3_5, qwen3_5_moe, qwen3_next) both
are wrong for the linear-attention layers: GDN ignores the tree mask, and a recurrent state cannot be
cropped (transformers raises). While one of their generate functions runs on such a target, this patch:

* runs every verification forward (a forward on a non-empty cache with more than one token) inside
  the engine's `gdn.tree_verification(parents)`: the tree their `build_ddtree_tree` just returned, or a
  chain for `dflash_generate` (host lists, as their loop has them). The GDN layers then compute each
  node against its own ancestors and leave the cache's states untouched;
* in `compact_dynamic_cache`, commits the GDN states along their accepted path
  (`gdn_tree.commit_linear_states`) before their code compacts the attention layers as before;
* gives that one target cache a `crop` that crops the attention layers only (with their 4.x meaning,
  keep the first n tokens), after committing a verified chain's accepted prefix (`dflash_generate`).

Nothing changes on pure-attention targets, nor outside their generate functions. The target's forward
hooks and the cache's `crop` exist only for the duration of one call.

The tree-exact GDN is engine code (`ddtree.engine.gdn`), which compat may not import: the row
`needs` it, and `ddtree.upstream.loader` (a layer above both) hands it over as
`apply(provided={"gdn": ddtree.engine.gdn})`. Without it the row is skipped-absent.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..core import UPSTREAM, UPSTREAM_PACKAGE, Patch, Patcher, PatchUnavailable

ID = "upstream-gdn-tree"
DDTREE = f"{UPSTREAM_PACKAGE}.ddtree"
DFLASH = f"{UPSTREAM_PACKAGE}.dflash"
MODULES = (DFLASH, DDTREE)
# what is wrapped in each of the authors' modules (ddtree.py holds its own `from dflash import` copy)
WRAPPED = {
    DFLASH: ("dflash_generate",),
    DDTREE: ("ddtree_generate", "dflash_generate", "build_ddtree_tree", "compact_dynamic_cache"),
}
GENERATORS = {"ddtree_generate": "ddtree", "dflash_generate": "dflash"}


# the range ddtree.engine.gdn is verified on (tests/test_compat_upstream_gdn.py keeps the two equal)
VERSIONS = ">=5.21,<5.40"


@dataclass
class _Session:
    """One call of their generate function on a GDN hybrid target."""

    kind: str  # "ddtree" (trees from build_ddtree_tree) or "dflash" (chains)
    gdn: Any  # ddtree.engine.gdn, as provided to apply()
    parents: list[int] | None = None  # the tree their build_ddtree_tree returned last
    tree: Any = None  # the open tree_verification context, during a verification forward
    verified: tuple[Any, int, int] | None = None  # (cache, past length, tokens) of the last verification
    caches: list[Any] = field(default_factory=list)  # target caches given a crop for this call

    def before_forward(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        if cache is None or ids is None or not hasattr(cache, "layers"):
            return None
        self._own(cache)
        past, size = _attention_length(cache), ids.shape[-1]
        if past == 0 or size == 1:  # the prefill, or one token (AR): a plain forward is exact
            return None
        if self.verified is not None:
            raise RuntimeError(f"{ID}: a target forward ran before the previous verification was committed")
        if self.kind == "ddtree":
            parents, self.parents = self.parents, None
            if parents is None or len(parents) != size:
                raise RuntimeError(f"{ID}: a {size}-token verification forward without a matching tree from "
                                   "build_ddtree_tree (their loop changed?)")
        else:
            parents = [-1, *range(size - 1)]
        self.tree = self.gdn.tree_verification(parents)
        self.tree.__enter__()
        self.verified = (cache, past, size)
        return None

    def after_forward(self, module, args, kwargs, output):
        self.close_tree()
        return None

    def close_tree(self) -> None:
        if self.tree is not None:
            tree, self.tree = self.tree, None
            tree.__exit__(None, None, None)

    def commit(self, cache, accepted: list[int]) -> None:
        self.verified = None
        self.gdn.commit_linear_states(cache, accepted)

    def crop(self, cache, length: int) -> None:
        """Their `cache.crop(n)`: keep the first n tokens (4.x); a negative n drops -n (5.x)."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        current = _attention_length(cache)
        keep = max(0, min(current, length if length > 0 else current + length))
        if self.verified is not None and self.verified[0] is cache:  # a chain: its first tokens are accepted
            _, past, size = self.verified
            if not past < keep <= past + size:
                raise RuntimeError(f"{ID}: crop({length}) does not keep part of the {size}-token chain verified "
                                   f"after {past} tokens")
            self.commit(cache, list(range(keep - past)))
        if keep < current:
            for layer in cache.layers:
                if not isinstance(layer, LinearAttentionCacheLayerMixin):
                    layer.crop(keep - current)

    def _own(self, cache) -> None:
        if not any(c is cache for c in self.caches):
            cache.crop = functools.partial(self.crop, cache)  # this call's target cache only
            self.caches.append(cache)

    def close(self) -> None:
        self.close_tree()
        for cache in self.caches:
            cache.__dict__.pop("crop", None)
        self.caches.clear()


def _attention_length(cache) -> int:
    """The tokens in the cache's attention layers (committed, plus a verified draft not yet cropped). Up to 5.24
    `get_seq_length` read the first attention layer of a hybrid cache; from 5.25 it reads layer 0, and a linear-attention
    layer there counts only what its states hold (a verification leaves them untouched; the commit counts the path)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            return int(cache.get_seq_length(i))
    return int(cache.get_seq_length())


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("ddtree_upstream_gdn", default=None)


def gdn_hybrid(target: Any, gdn: Any) -> bool:
    """Whether `target` has Gated DeltaNet layers `gdn` (ddtree.engine.gdn) can verify as a tree."""
    classes = tuple(gdn.target_classes())
    modules = getattr(target, "modules", None)
    return bool(classes) and callable(modules) and any(isinstance(m, classes) for m in modules())


def _target_of(wrapped, args, kwargs) -> Any:
    try:
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("target")


def _generate(kind: str, gdn: Any):
    def wrapper(wrapped, instance, args, kwargs):
        if _SESSION.get() is not None:  # ddtree_generate(block_size=1) calls dflash_generate
            return wrapped(*args, **kwargs)
        target = _target_of(wrapped, args, kwargs)
        if target is None or not gdn_hybrid(target, gdn):
            return wrapped(*args, **kwargs)
        gdn.install()  # idempotent, as the native TargetSession does; inert outside tree_verification
        session = _Session(kind=kind, gdn=gdn)
        token = _SESSION.set(session)
        hooks = [target.register_forward_pre_hook(session.before_forward, with_kwargs=True),
                 target.register_forward_hook(session.after_forward, with_kwargs=True, always_call=True)]
        try:
            return wrapped(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            session.close()
            _SESSION.reset(token)

    return wrapper


def record_tree(wrapped, instance, args, kwargs):
    """build_ddtree_tree returns (token ids, depths, parents, ...): keep the parents for the verification."""
    result = wrapped(*args, **kwargs)
    session = _SESSION.get()
    if session is not None:
        session.parents = [int(p) for p in result[2]]
    return result


def commit_then_compact(wrapped, instance, args, kwargs):
    """compact_dynamic_cache(cache, past_length, keep_current_indices): commit GDN along the kept path first."""
    session = _SESSION.get()
    if session is not None and session.verified is not None:
        values = list(inspect.signature(wrapped).bind(*args, **kwargs).arguments.values())
        cache, accepted = values[0], values[2]  # (past_key_values, past_length, keep_current_indices)
        if cache is session.verified[0]:
            session.commit(cache, [int(i) for i in accepted])
    return wrapped(*args, **kwargs)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    assert module is not None, "deferred patch: called with the imported module"
    names = WRAPPED[module.__name__]
    missing = [n for n in names if not callable(getattr(module, n, None))]
    if missing:
        raise PatchUnavailable(f"{module.__name__} has no {', '.join(missing)}")
    for name in names:
        if name in GENERATORS:
            patcher.wrap(module, name, _generate(GENERATORS[name], patcher.provided["gdn"]))
        elif name == "build_ddtree_tree":
            patcher.wrap(module, name, record_tree)
        else:
            patcher.wrap(module, name, commit_then_compact)
    return "on GDN hybrid targets: " + ", ".join(names)


PATCH = Patch(
    id=ID,
    targets=tuple(f"{m}:{n}" for m in MODULES for n in WRAPPED[m]),
    versions={"transformers": VERSIONS},
    reason="the authors' tree verification and cache rollback are wrong on hybrid GDN targets (mask ignored, "
    "states not croppable): verify with the engine's tree-exact GDN, commit the accepted path",
    install=install,
    for_engines=frozenset({UPSTREAM}),
    imports=MODULES,
    needs=("gdn",),
)
