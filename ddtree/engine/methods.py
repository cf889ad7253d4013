"""The one table of decoding methods: name -> proposer, whether it needs a drafter, reads the budget, tree kind.

Everything that asks "which method is this" (the generate loop, config validation, the authors'-code
engine, reports) asks this table, not a string. Importing it is cheap (no torch): config validation
reads it before any model work; the proposers load when one is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddtree.engine.checks import check_block_size, check_budget
from ddtree.errors import ConfigError

if TYPE_CHECKING:
    from ddtree.engine.proposers import Proposer

DEFAULT_BUDGET = 64  # DDTree's node budget when a caller passes budget=None
MTP = "mtp"  # the method drafting with the target's own multi-token-prediction head
MTP_STEPS, MTP_TOPK = 3, 1  # its defaults: SGLang's --speculative-num-steps 3 --speculative-eagle-topk 1


def _ar(target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    from ddtree.engine.proposers import ARProposer

    return ARProposer()


def _dflash(target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    if has_selector(drafter):  # DFlash2: the candidate selector's walk (ddtree.engine.selector)
        from ddtree.engine.selector import DFlash2ChainProposer

        return DFlash2ChainProposer(target, drafter, block_size)
    from ddtree.engine.proposers import DFlashProposer

    return DFlashProposer(target, drafter, block_size)


def _ddtree(target, drafter, budget: int | None, block_size: int | None, scoring: str | None = None) -> Proposer:
    budget = budget if budget is not None else DEFAULT_BUDGET
    check_scoring(scoring, "ddtree", drafter)
    if has_selector(drafter):  # DFlash2 (ddtree.engine.selector): its logits, and pair scores when asked
        from ddtree.engine.selector import DFlash2MarginalProposer, PairTreeProposer

        make = PairTreeProposer if scoring == "pair" else DFlash2MarginalProposer
        return make(target, drafter, budget, block_size)
    from ddtree.engine.proposers import DDTreeProposer

    return DDTreeProposer(target, drafter, budget, block_size)


SCORINGS = ("marginal", "pair")  # DDTree's node scores: per-position marginals, or a DFlash2 selector's pair scores
DEFAULT_SCORING = "marginal"


def has_selector(drafter) -> bool:
    """Whether `drafter` carries a DFlash2 candidate selector (pair scores)."""
    return getattr(drafter, "candidate_selector", None) is not None


def check_scoring(scoring: str | None, method: str, drafter=None, *, dflash2: bool | None = None) -> None:
    """scoring is marginal or pair; pair (read by method=ddtree) needs a DFlash2 drafter (`drafter`, or `dflash2`
    where only its config is known)."""
    if scoring is None:
        return
    if scoring not in SCORINGS:
        raise ConfigError("scoring", f"unknown value {scoring!r}", f"use one of: {', '.join(SCORINGS)}")
    is_dflash2 = has_selector(drafter) if dflash2 is None else dflash2
    if scoring == "pair" and method == "ddtree" and (drafter is not None or dflash2 is not None) and not is_dflash2:
        raise ConfigError("scoring", "pair scores come from a DFlash2 drafter's candidate selector; this drafter is "
                          "DFlash (no selector)", "use scoring=marginal, or a DFlash2 drafter")


def _mtp(target, drafter, budget: int | None, block_size: int | None, steps: int | None = None,
         topk: int | None = None) -> Proposer:
    from ddtree.engine.proposers import MTPProposer

    return MTPProposer(target, drafter, steps=steps or MTP_STEPS, topk=topk or MTP_TOPK,
                       budget=budget if budget is not None else DEFAULT_BUDGET)


@dataclass(frozen=True)
class Method:
    """One decoding method. `tree`: the shape it verifies: root (one token), chain or tree (branching)."""

    name: str
    make_proposer: Callable[[Any, Any, int | None, int | None], Proposer]
    needs_drafter: bool
    reads_budget: bool
    tree: str
    own_head: bool = False  # drafts with the target's own MTP head (read from its checkpoint), no drafter

    @property
    def verifies_tree(self) -> bool:
        """A branching tree: needs a tree attention mask (and, on hybrids, the tree-exact GDN)."""
        return self.tree == "tree"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", _ar, needs_drafter=False, reads_budget=False, tree="root"),
    Method("dflash", _dflash, needs_drafter=True, reads_budget=False, tree="chain"),
    Method("ddtree", _ddtree, needs_drafter=True, reads_budget=True, tree="tree"),
    # a chain of `steps` tokens (topk 1) or an EAGLE-style tree (topk > 1, the `budget` best nodes)
    Method(MTP, _mtp, needs_drafter=False, reads_budget=True, tree="tree", own_head=True),
)}
METHOD_NAMES = tuple(METHODS)
# every method but those drafting with the target's own head: what any target supports, what a drafter is evaluated on
DRAFTER_METHOD_NAMES = tuple(name for name, m in METHODS.items() if not m.own_head)
BASELINE = "ar"  # the method every other is compared with (plain target decoding)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError("method", f"unknown value '{name}'", f"use one of: {', '.join(METHOD_NAMES)}")
    return METHODS[name]


def check_mtp_args(steps: int | None, topk: int | None) -> None:
    """method=mtp: steps >= 1 draft tokens per round (depth), topk >= 1 children per expanded node."""
    for setting, value in (("mtp.steps", steps), ("mtp.topk", topk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(setting, f"must be an integer >= 1, got {value!r}",
                              f"e.g. {setting}={MTP_STEPS if setting == 'mtp.steps' else MTP_TOPK}")


def check_method_args(name: str, *, has_drafter: bool, budget: int | None, block_size: int | None,
                      drafter_fix: str = "set drafter=<name>, or method=ar", steps: int | None = None,
                      topk: int | None = None) -> Method:
    """The checks every entry (config validation, ddtree.generate, the authors'-code engine) shares:
    a known method, the drafter it needs, a budget >= 1 where it reads one, a block size >= 2 (MTP: its
    steps and topk)."""
    method = get_method(name)
    if method.own_head:
        check_mtp_args(steps, topk)
    if method.needs_drafter and not has_drafter:
        raise ConfigError("drafter", f"method={name} needs a DFlash drafter, but there is none", drafter_fix)
    if method.reads_budget:
        check_budget(budget)
    if method.needs_drafter:
        check_block_size(block_size)
    return method
