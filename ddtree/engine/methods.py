"""The one table of decoding methods: name -> proposer, the drafter it drafts with, the budget and the shape it
verifies, whether the compiled round runs it, which families it runs on.

Everything that asks "which method is this" (the generate loop, config validation, the authors'-code
engine, reports, docs) asks this table, not a string. Importing it is cheap (no torch): config validation
reads it before any model work; the proposers load when one is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddtree.engine.checks import MTP_STEPS, MTP_TOPK, check_block_size, check_budget, check_mtp_args
from ddtree.engine.drafter_kinds import DFLASH, EAGLE3, OWN_HEAD, DrafterKind
from ddtree.engine.families import Family, check_family_has_mtp, family
from ddtree.errors import ConfigError

if TYPE_CHECKING:
    from ddtree.engine.options import EngineOptions
    from ddtree.engine.proposers import Proposer

DEFAULT_BUDGET = 64  # DDTree's node budget when a caller passes budget=None
MTP = "mtp"  # the method drafting with the target's own multi-token-prediction head


@dataclass(frozen=True)
class DraftSettings:
    """What a proposer is built from besides the models; each method reads its own (the rest stay None)."""

    budget: int | None = None  # the node budget (methods with reads_budget)
    block_size: int | None = None  # the drafter's block (drafter_kind DFLASH; None: the drafter's own)
    steps: int | None = None  # method=mtp, eagle3: draft depth (None: MTP_STEPS)
    topk: int | None = None  # method=mtp, eagle3: children per expanded node (None: MTP_TOPK; > 1: a tree)
    scoring: str | None = None  # method=ddtree: auto, marginal or pair (None: auto; resolve_scoring)
    options: EngineOptions | None = None  # the engine's options (ddtree.engine.options; None: resolved when built)


def _ar(target, drafter, s: DraftSettings) -> Proposer:
    from ddtree.engine.proposers import ARProposer

    return ARProposer()


def _dflash(target, drafter, s: DraftSettings) -> Proposer:
    if has_selector(drafter):  # DFlash2: the candidate selector's walk (ddtree.engine.selector)
        from ddtree.engine.selector import DFlash2ChainProposer

        return DFlash2ChainProposer(target, drafter, s.block_size)
    from ddtree.engine.proposers import DFlashProposer

    return DFlashProposer(target, drafter, s.block_size)


def _ddtree(target, drafter, s: DraftSettings) -> Proposer:
    budget = s.budget if s.budget is not None else DEFAULT_BUDGET
    block_size = s.block_size
    check_scoring(s.scoring, "ddtree", drafter)
    scoring = resolve_scoring(s.scoring, has_selector(drafter))
    if has_selector(drafter):  # DFlash2 (ddtree.engine.selector): its logits, and pair scores when asked
        from ddtree.engine.selector import DFlash2MarginalProposer, PairTreeProposer

        if scoring == "pair":
            return PairTreeProposer(target, drafter, budget, block_size)
        return DFlash2MarginalProposer(target, drafter, budget, block_size, options=s.options)
    from ddtree.engine.proposers import DDTreeProposer

    return DDTreeProposer(target, drafter, budget, block_size, options=s.options)


# DDTree's node scores: per-position marginals, or a DFlash2 selector's pair scores; auto: pair where the drafter has a
# selector (DFlash2), marginal otherwise (docs/dflash2.md: on the toy's 256 unseen prompts pair's tau is 1.08x marginal's)
SCORINGS = ("auto", "marginal", "pair")
AUTO_SCORING = "auto"


def resolve_scoring(scoring: str | None, dflash2: bool) -> str:
    """The scoring a DDTree over a drafter runs: `scoring` itself, or for auto (None) pair where the drafter is DFlash2
    (it has a candidate selector) and marginal where it is DFlash."""
    if scoring is None or scoring == AUTO_SCORING:
        return "pair" if dflash2 else "marginal"
    return scoring


def has_selector(drafter) -> bool:
    """Whether `drafter` carries a DFlash2 candidate selector (pair scores; the DFlash row's `pair_scores`)."""
    return DFLASH.pair_scores(drafter)


def check_scoring(scoring: str | None, method: str, drafter=None, *, dflash2: bool | None = None) -> None:
    """scoring is marginal or pair; pair (read by method=ddtree) needs a DFlash2 drafter (`drafter`, or `dflash2`
    where only its config is known)."""
    if scoring is None:
        return
    if scoring not in SCORINGS:
        raise ConfigError("scoring", f"unknown value {scoring!r}", f"use one of: {', '.join(SCORINGS)}")
    is_dflash2 = has_selector(drafter) if dflash2 is None else dflash2
    reads = method in METHODS and METHODS[method].reads_scoring
    if scoring == "pair" and reads and (drafter is not None or dflash2 is not None) and not is_dflash2:
        raise ConfigError("scoring", "pair scores come from a DFlash2 drafter's candidate selector; this drafter is "
                          "DFlash (no selector)", "use scoring=marginal, or a DFlash2 drafter")


def _mtp(target, drafter, s: DraftSettings) -> Proposer:
    from ddtree.engine.proposers import MTPProposer

    return MTPProposer(target, drafter, steps=s.steps or MTP_STEPS, topk=s.topk or MTP_TOPK,
                       budget=s.budget if s.budget is not None else DEFAULT_BUDGET)


def _eagle3(target, drafter, s: DraftSettings) -> Proposer:
    from ddtree.engine.drafter.eagle3 import Eagle3Proposer

    return Eagle3Proposer(target, drafter, steps=s.steps or MTP_STEPS, topk=s.topk or MTP_TOPK,
                          budget=s.budget if s.budget is not None else DEFAULT_BUDGET)


@dataclass(frozen=True)
class Method:
    """One decoding method.

    make_proposer(target, drafter, DraftSettings): its proposer (ddtree.engine.proposers), after check_method_args.
    drafter_kind: what fills its drafter slot, a row of ddtree.engine.drafter_kinds (DFLASH; OWN_HEAD, None passed:
    read from the target), or None.
    tree: the shape it verifies: root (one token), chain or tree (branching).
    reads_budget: the budget can shape its tree; budget_when_branching: only when it branches (topk > 1).
    compilable: the compiled round (ddtree.engine.compiled) runs it (one node count per engine).
    authors_code: the DDTree authors' code (engine=upstream, ddtree.upstream) has it.
    settings: the config group of settings it alone reads (its `steps`, `topk`: method=mtp's mtp.*, method=eagle3's
    eagle3.*), or None.
    reads_scoring: its tree's node scores are a setting (scoring=marginal|pair: DDTree's best-first tree).
    auto_budget: budget=auto calibrates its budget (ddtree.pipeline.autobudget: a best-first tree of the drafter's).
    drafts: what it drafts, in the docs' words, where its tree shape alone does not say it (None: the shape's).
    """

    name: str
    make_proposer: Callable[[Any, Any, DraftSettings], Proposer]
    drafter_kind: DrafterKind | None
    tree: str
    reads_budget: bool
    budget_when_branching: bool = False
    compilable: bool = True
    authors_code: bool = True
    settings: str | None = None
    reads_scoring: bool = False
    auto_budget: bool = False
    drafts: str | None = None

    @property
    def verifies_tree(self) -> bool:
        """A branching tree: needs a tree attention mask (and, on hybrids, the tree-exact GDN)."""
        return self.tree == "tree"

    @property
    def reads_block_size(self) -> bool:
        """It drafts blocks of a drafter (drafter.block_size)."""
        return self.drafter_kind is not None and self.drafter_kind.block_size

    def uses_budget(self, topk: int | None = None) -> bool:
        """Whether the budget shapes its tree under these settings (MTP's chain, topk 1, ignores it)."""
        return self.reads_budget and (not self.budget_when_branching or (topk or MTP_TOPK) > 1)

    def runs_on(self, row: Family) -> bool:
        """The baseline runs on every family; a drafting method where the family verifies a tree exactly (not
        recurrent) and, drafting with the target's own head, where the family has one."""
        if self.tree == "root":
            return True
        return not row.recurrent and (not self.drafter_kind.from_target or row.own_head)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", _ar, drafter_kind=None, tree="root", reads_budget=False),
    Method("dflash", _dflash, drafter_kind=DFLASH, tree="chain", reads_budget=False),
    Method("ddtree", _ddtree, drafter_kind=DFLASH, tree="tree", reads_budget=True, reads_scoring=True,
           auto_budget=True),
    # a chain of `steps` tokens (topk 1) or an EAGLE-style tree (topk > 1, the `budget` best nodes)
    Method(MTP, _mtp, drafter_kind=OWN_HEAD, tree="tree", reads_budget=True, budget_when_branching=True,
           authors_code=False, settings="mtp",
           drafts="the target's own MTP head: a chain of `mtp.steps`, or (`mtp.topk` > 1) a tree of `budget` nodes"),
    # an EAGLE-3 drafter (docs/eagle3.md): a chain of `steps`, or (topk > 1) an EAGLE-2 dynamic tree of `budget` nodes
    Method("eagle3", _eagle3, drafter_kind=EAGLE3, tree="tree", reads_budget=True, budget_when_branching=True,
           authors_code=False, settings="eagle3",
           drafts="a chain of `eagle3.steps`, or (`eagle3.topk` > 1) a tree of `budget` nodes"),
)}
METHOD_NAMES = tuple(METHODS)
# the baseline and the methods drafting with a block drafter (DFlash, DFlash2): what a trained drafter is evaluated on
# (ddtree.train); what a target supports is family_methods
DRAFTER_METHOD_NAMES = tuple(name for name, m in METHODS.items() if m.drafter_kind is None or m.drafter_kind.block_size)
COMPILABLE_METHOD_NAMES = tuple(name for name, m in METHODS.items() if m.compilable)
BASELINE = "ar"  # the method every other is compared with (plain target decoding)


def drafter_method(tree: str) -> str:
    """The method drafting with a DFlash drafter that verifies `tree` ("chain": DFlash, "tree": DDTree): the pair a
    report and a diagnosis compare."""
    return next(name for name, m in METHODS.items() if m.drafter_kind and m.drafter_kind.curve and m.tree == tree)


def reads_budget(name: str | None, topk: int | None = None) -> bool:
    """Whether method `name` (None or unknown: no) reads the budget under these settings (Method.uses_budget)."""
    m = METHODS.get(name)
    return m is not None and m.uses_budget(topk)


def loads_drafter(name: str) -> bool:
    """Whether method `name` loads a drafter checkpoint (its drafter kind's `checkpoint`): the drafter.* settings,
    its quantization, its memory and its source then apply."""
    kind = get_method(name).drafter_kind
    return kind is not None and kind.checkpoint


def verified_rows(name: str | None, budget: int | None = None, block_size: int | None = None,
                  steps: int | None = None, topk: int | None = None) -> int:
    """The target rows one round of method `name` verifies (the proposers' trees: AR its root; DFlash a chain of
    its block; DDTree and a branching MTP or EAGLE-3 the root and `budget` nodes; their chains the root and
    `steps`). None or an unknown method (another engine's outputs): 1, the AR shape. The validator's second opinion
    computes a miss in this shape (ddtree.engine.output_check.DecodeShape)."""
    m = METHODS.get(name)
    if m is None or m.tree == "root":
        return 1
    if m.tree == "chain":
        return max(1, block_size or 1)
    if m.budget_when_branching and (topk or MTP_TOPK) == 1:  # a chain of `steps` (mtp, eagle3 with topk 1)
        return (steps or MTP_STEPS) + 1
    return (budget if budget is not None else DEFAULT_BUDGET) + 1


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError("method", f"unknown value '{name}'", f"use one of: {', '.join(METHOD_NAMES)}")
    return METHODS[name]


def family_methods(model_type: str) -> tuple[str, ...]:
    """The methods a model_type runs, in table order (an unknown type: pure attention)."""
    row = family(model_type)
    return tuple(name for name, m in METHODS.items() if m.runs_on(row))


def supports(model_type: str, method: str) -> bool:
    return get_method(method).runs_on(family(model_type))


def check_target_supported(model_type_name: str, method: str,
                           fix: str = "use method=ar for this model family") -> None:
    """Refuse families whose verification would be silently wrong, or without the head a method drafts with."""
    m, row = get_method(method), family(model_type_name)
    if m.runs_on(row):
        return
    if m.drafter_kind is not None and m.drafter_kind.from_target and not row.own_head:
        check_family_has_mtp(model_type_name)
    raise ConfigError("method", f"method={method} on a '{model_type_name}' target is not supported: its recurrent "
                      "layers cannot verify a draft tree or roll back rejected tokens exactly", fix)


def check_method_args(name: str, *, has_drafter: bool, budget: int | None, block_size: int | None,
                      drafter_fix: str = "set drafter=<name>, or method=ar", steps: int | None = None,
                      topk: int | None = None) -> Method:
    """The checks every entry (config validation, ddtree.generate, the authors'-code engine) shares:
    a known method, the drafter it needs, a budget >= 1 where it reads one, a block size >= 2 (MTP: its
    steps and topk)."""
    method = get_method(name)
    if method.settings is not None:  # mtp.*, eagle3.*: a chain's steps, a tree's topk
        check_mtp_args(steps, topk, method.settings)
    if method.drafter_kind is not None and method.drafter_kind.checkpoint and not has_drafter:
        raise ConfigError("drafter", f"method={name} needs a drafter, but there is none", drafter_fix)
    if method.reads_budget:
        check_budget(budget)
    if method.reads_block_size:
        check_block_size(block_size)
    return method
