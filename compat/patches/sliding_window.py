"""Sliding-window layers never reach a backend that silently ignores the window.

Attention functions receive `sliding_window=` as a keyword. flash-attention honours it (as
`window_size=(w-1, w-1)`, aligned bottom-right); eager and sdpa ignore it, and use only the mask.
transformers' own models put the window into the mask, but a DFlash drafter with sliding layers
(the authors' `Qwen3DFlashAttention`) calls the attention function with `attention_mask=None` and
`sliding_window=w`, so under eager/sdpa its sliding layers silently attend to everything.

The fix: when eager or sdpa get a window and no mask while keys outnumber the window, they get an
explicit additive mask with flash-attention's semantics (query i sits at key position
kv_len - q_len + i; key j is visible when |pos_i - j| <= w - 1, and j <= pos_i when sdpa would
have been causal). Where no mask can be built, it raises: flex_attention with a window and no
BlockMask, and a flash kernel whose signature has no `window_size`.
A caller that passes both a mask and a window is trusted to have put the window in its mask, as
transformers' mask builders do.
"""

from __future__ import annotations

from types import ModuleType

from ddtree.errors import ConfigError

from ..core import Patch, Patcher, PatchUnavailable, rebind_partials, resolve

ID = "sliding-window"
SDPA = ("transformers.integrations.sdpa_attention", "sdpa_attention_forward")
EAGER_QWEN3 = ("transformers.models.qwen3.modeling_qwen3", "eager_attention_forward")
FLEX = ("transformers.integrations.flex_attention", "flex_attention_forward")
FLASH_KWARGS = ("transformers.modeling_flash_attention_utils", "_process_flash_attention_kwargs")
INTERFACE = ("transformers.modeling_utils", "AttentionInterface")
CACHED_PARTIALS = ("_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def window_mask(q_len: int, kv_len: int, window: int, causal: bool, dtype, device):
    """Additive (1, 1, q_len, kv_len) mask: 0 where flash-attention's window (and causality) allows."""
    import torch

    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    visible = (q_pos - k_pos).abs() <= window - 1
    if causal:
        visible &= k_pos <= q_pos
    mask = torch.zeros((q_len, kv_len), dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _call_parts(args, kwargs):
    """(module, query, key, attention_mask, mask is positional) of an attention-function call."""
    names = ("module", "query", "key", "value", "attention_mask")
    got = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    return got[0], got[1], got[2], got[4], len(args) > 4


def make_window_router(backend: str, causal_from_call: bool):
    """Wrapper for an attention function that ignores `sliding_window` (eager: causal_from_call=False)."""

    def route_sliding_window(wrapped, instance, args, kwargs):
        window = kwargs.get("sliding_window")
        if window is None:
            return wrapped(*args, **kwargs)
        module, query, key, mask, mask_positional = _call_parts(args, kwargs)
        if mask is not None or query is None or key is None:
            return wrapped(*args, **kwargs)
        q_len, kv_len = query.shape[-2], key.shape[-2]
        if kv_len <= window or q_len > kv_len:
            return wrapped(*args, **kwargs)
        causal = False
        if causal_from_call:
            flag = kwargs.get("is_causal")
            causal = bool(flag if flag is not None else getattr(module, "is_causal", True))
        mask = window_mask(q_len, kv_len, int(window), causal, query.dtype, query.device)
        if mask_positional:
            args = (*args[:4], mask, *args[5:])
        else:
            kwargs = {**kwargs, "attention_mask": mask}
        return wrapped(*args, **kwargs)

    route_sliding_window.backend = backend
    return route_sliding_window


def refuse_flex_window(wrapped, instance, args, kwargs):
    window = kwargs.get("sliding_window")
    if window is not None:
        _, query, key, mask, _ = _call_parts(args, kwargs)
        if mask is None and key is not None and key.shape[-2] > window:
            raise ConfigError(
                "attention",
                f"flex_attention: sliding_window={window} with no BlockMask would be ignored",
                "pass a BlockMask that carries the window, or use flash_attention_2, sdpa or eager (compat masks those)",
            )
    return wrapped(*args, **kwargs)


def refuse_flash_without_window(wrapped, instance, args, kwargs):
    window, key_length = kwargs.get("sliding_window"), kwargs.get("key_length")
    supports = kwargs.get("supports_mapping") or {}
    if (
        window is not None
        and key_length is not None
        and key_length > window
        and not supports.get("window_size")
    ):
        raise ConfigError(
            "attention",
            f"the loaded flash-attention kernel takes no `window_size`, so sliding_window={window} would be ignored",
            "use sdpa or eager (compat masks the window there), or a kernel with window_size",
        )
    return wrapped(*args, **kwargs)


def install(patcher: Patcher, module: ModuleType | None) -> str:
    done, absent = [], []
    interface_map = None
    try:
        _, _, interface = resolve(*INTERFACE)
        interface_map = interface._global_mapping
    except (PatchUnavailable, AttributeError):
        absent.append("AttentionInterface._global_mapping")

    def wrap_function(target, wrapper, mapping_keys=()):
        try:
            owner, name, original = resolve(*target)
        except PatchUnavailable:
            absent.append(f"{target[0]}:{target[1]}")
            return None
        proxy = patcher.wrap(owner, name, wrapper)
        for key in mapping_keys:
            if interface_map is not None and interface_map.get(key) is original:
                patcher.set_item(interface_map, key, proxy)
        done.append(target[1])
        return owner, original, proxy

    wrap_function(SDPA, make_window_router("sdpa", causal_from_call=True), ("sdpa",))
    wrap_function(EAGER_QWEN3, make_window_router("eager", causal_from_call=False))
    wrap_function(FLEX, refuse_flex_window, ("flex_attention",))
    flash = wrap_function(FLASH_KWARGS, refuse_flash_without_window)
    if flash is not None:
        rebind_partials(patcher, flash[0], CACHED_PARTIALS, flash[1], flash[2])
    if not done:
        raise PatchUnavailable(f"no attention function to guard here: {absent}")
    return (
        "window honoured or refused in: "
        + ", ".join(done)
        + (f" (absent: {', '.join(absent)})" if absent else "")
    )


PATCH = Patch(
    id=ID,
    targets=tuple(f"{m}:{a}" for m, a in (SDPA, EAGER_QWEN3, FLEX, FLASH_KWARGS))
    + tuple(
        f"transformers.modeling_utils:AttentionInterface._global_mapping['{k}']"
        for k in ("sdpa", "flex_attention")
    ),
    versions={"transformers": ">=5.0"},
    reason="eager/sdpa ignore sliding_window when no mask is given; a sliding drafter layer must keep its window",
    install=install,
    condition_doc="at call time: sliding_window set, no mask, keys > window",
)
