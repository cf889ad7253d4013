"""The one table of drafter kinds: what can fill a method's drafter slot (Method.drafter_kind), one row each.

A row says what the rest of ddtree asks of a kind, so nothing outside the row and the kind's own files branches on
which kind it is: whether a `drafter=` checkpoint is loaded for it (its settings, quantization, memory and preflight
checks then apply), whether it is read from the target's own checkpoint, whether `attention.drafter` is its backend,
whether it reads `drafter.block_size`, whether its drafts can be scored pairwise, how it is checked against a target,
its labels in the run's summary and the docs, how a checkpoint of it loads (`load`). Importing it is cheap (no
torch): config validation reads it. The pipeline loads any checkpoint kind through its row's `load`
(ddtree.pipeline.models.load_drafter) and the target's own head through its `from_target` source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DrafterLoad:
    """What a checkpoint kind's `load` is given (the drafter.* settings, resolved by the pipeline): a random drafter
    for the target (`random`: seed, and a block drafter's num_layers, block_size, target_layer_ids) or the checkpoint
    at name_or_path (revision; weights in `dtype`), on `device`; `attention`: the backend of a kind with its own."""

    random: bool
    name_or_path: str | None
    dtype: Any  # a torch.dtype: a checkpoint's weights (a random drafter takes the target's)
    device: str
    revision: str | None = None
    attention: str = "sdpa"
    seed: int = 0
    num_layers: int = 1
    block_size: int | None = None
    target_layer_ids: list[int] | None = None


def _no_check(target: Any, drafter: Any) -> None:
    return None


def _check_block_drafter(target: Any, drafter: Any) -> None:
    """A DFlash (or DFlash2) drafter against its target: feature layers, vocabulary, widths (its own check)."""
    if drafter is not None:
        drafter.check_compatible(target)


def _load_block_drafter(target: Any, spec: DrafterLoad) -> Any:
    """A DFlash (or DFlash2: its config's architecture decides the class) drafter, checked against the target."""
    from ddtree.engine.drafter import DFlashDrafter

    if spec.random:
        kw = {"target_layer_ids": list(spec.target_layer_ids)} if spec.target_layer_ids is not None else {}
        drafter = DFlashDrafter.random_for_target(target.config, num_layers=spec.num_layers,
                                                  block_size=spec.block_size or 16, seed=spec.seed,
                                                  attn_implementation=spec.attention, **kw)
        drafter = drafter.to(device=spec.device, dtype=target.dtype)
    else:
        kw = {"revision": spec.revision} if spec.revision else {}
        drafter = DFlashDrafter.from_pretrained(spec.name_or_path, dtype=spec.dtype, device=spec.device,
                                                attn_implementation=spec.attention, **kw)
    drafter.check_compatible(target)
    return drafter


def _block_selector(drafter: Any) -> Any | None:
    """A DFlash2 drafter's candidate selector (ddtree.engine.drafter.dflash2), None for a DFlash drafter."""
    return getattr(drafter, "candidate_selector", None)


def _block_pair_scores(drafter: Any) -> bool:
    """A DFlash2 drafter carries a candidate selector: its children can be scored given their parent."""
    return _block_selector(drafter) is not None


def _never(drafter: Any) -> bool:
    return False


def _none(drafter: Any) -> None:
    return None


def _head_tensors(name_or_path: str, revision: str | None) -> None:
    """The MTP head's tensors are in the target's checkpoint (its index or headers: no weights load)."""
    from ddtree.engine.drafter.mtp import mtp_tensor_map

    mtp_tensor_map(name_or_path, revision)


def _own_attention(target: str, drafter: str) -> str:
    return drafter


def _head_attention(target: str, drafter: str) -> str:
    from ddtree.engine.drafter.mtp import head_attention

    return head_attention(target)


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    checkpoint: a `drafter=` checkpoint (or random drafter) is loaded for it: the drafter.* settings, its quantization,
    its memory and its source are checked. from_target: read from the target's own checkpoint (a family must have it).
    own_attention: `attention.drafter` is its backend (else it runs the target's where it can: `attention`).
    block_size: it drafts blocks of `drafter.block_size`. curve: the diagnosis predicts its chain and its trees.
    summary: the run summary's "drafter" for it (None: the checkpoint's name). attention_label: the summary line's
    name for its backend. needs: the docs' "needs a drafter" cell. check(target, drafter): refuse a mismatched pair
    before a proposer is built. pair_scores(drafter): whether this drafter scores children given their parent.
    attention(target backend, attention.drafter): the backend it runs. in_target(name_or_path, revision): where it is
    read from the target's checkpoint, the preflight's look at it (before any weights load). load(target,
    DrafterLoad): a checkpoint kind's drafter, random or from its checkpoint, bound to the target. selector(drafter): its
    training hook, the module a drafter adds a training term for beside the block loss (a DFlash2 drafter's
    candidate selector: ddtree.train.objective.selector_loss), or None."""

    name: str
    checkpoint: bool
    from_target: bool
    own_attention: bool
    block_size: bool
    curve: bool
    summary: str | None
    attention_label: str
    needs: str
    check: Callable[[Any, Any], None] = _no_check
    pair_scores: Callable[[Any], bool] = _never
    attention: Callable[[str, str], str] = _own_attention
    in_target: Callable[[str, str | None], None] | None = None
    load: Callable[[Any, DrafterLoad], Any] | None = None
    selector: Callable[[Any], Any | None] = _none


# a DFlash or DFlash2 block drafter checkpoint (drafter=<name>); its block: the checkpoint's or drafter.block_size
DFLASH = DrafterKind("dflash", checkpoint=True, from_target=False, own_attention=True, block_size=True, curve=True,
                     summary=None, attention_label="drafter", needs="yes", check=_check_block_drafter,
                     pair_scores=_block_pair_scores, load=_load_block_drafter, selector=_block_selector)
# the target's own MTP head (ddtree.engine.drafter.mtp), read from the target's checkpoint
OWN_HEAD = DrafterKind("own_head", checkpoint=False, from_target=True, own_attention=False, block_size=False,
                       curve=False, summary="mtp head", attention_label="MTP head", needs="no (its own head)",
                       attention=_head_attention, in_target=_head_tensors)


def _check_eagle3(target: Any, drafter: Any) -> None:
    """An EAGLE-3 drafter against its target: fused widths, aux layers, vocabulary (its own check)."""
    if drafter is not None:
        drafter.check_compatible(target)


def _load_eagle3(target: Any, spec: DrafterLoad) -> Any:
    """An EAGLE-3 drafter: a random one for the target, or a checkpoint in the public layout bound to the target."""
    from ddtree.engine.drafter.eagle3 import Eagle3Drafter

    if spec.random:
        return Eagle3Drafter.random_for_target(target, seed=spec.seed)
    drafter = Eagle3Drafter.from_pretrained(spec.name_or_path, dtype=spec.dtype, device=spec.device,
                                            revision=spec.revision)
    drafter.bind(target)
    return drafter


def _sdpa(target: str, drafter: str) -> str:
    return "sdpa"  # the EAGLE-3 layer's attention is torch's scaled_dot_product_attention (no setting of its own)


# an EAGLE-3 checkpoint in the public layout (ddtree.engine.drafter.eagle3; drafter=pretrained, or a random one for a
# tiny model built in code: drafter=tiny)
EAGLE3 = DrafterKind("eagle3", checkpoint=True, from_target=False, own_attention=False, block_size=False, curve=False,
                     summary=None, attention_label="EAGLE-3 drafter", needs="yes (EAGLE-3)", check=_check_eagle3,
                     attention=_sdpa, load=_load_eagle3)

DRAFTER_KINDS: dict[str, DrafterKind] = {k.name: k for k in (DFLASH, OWN_HEAD, EAGLE3)}
TRAINED_KIND = DFLASH  # the kind `python -m ddtree.train` trains (block diffusion); training asks its row (`selector`)
