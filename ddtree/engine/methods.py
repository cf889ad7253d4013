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


def _ar(target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    from ddtree.engine.proposers import ARProposer

    return ARProposer()


def _dflash(target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    from ddtree.engine.proposers import DFlashProposer

    return DFlashProposer(target, drafter, block_size)


def _ddtree(target, drafter, budget: int | None, block_size: int | None) -> Proposer:
    from ddtree.engine.proposers import DDTreeProposer

    return DDTreeProposer(target, drafter, budget if budget is not None else DEFAULT_BUDGET, block_size)


@dataclass(frozen=True)
class Method:
    """One decoding method. `tree`: the shape it verifies: root (one token), chain or tree (branching)."""

    name: str
    make_proposer: Callable[[Any, Any, int | None, int | None], Proposer]
    needs_drafter: bool
    reads_budget: bool
    tree: str

    @property
    def verifies_tree(self) -> bool:
        """A branching tree: needs a tree attention mask (and, on hybrids, the tree-exact GDN)."""
        return self.tree == "tree"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", _ar, needs_drafter=False, reads_budget=False, tree="root"),
    Method("dflash", _dflash, needs_drafter=True, reads_budget=False, tree="chain"),
    Method("ddtree", _ddtree, needs_drafter=True, reads_budget=True, tree="tree"),
)}
METHOD_NAMES = tuple(METHODS)
BASELINE = "ar"  # the method every other is compared with (plain target decoding)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError("method", f"unknown value '{name}'", f"use one of: {', '.join(METHOD_NAMES)}")
    return METHODS[name]


def check_method_args(name: str, *, has_drafter: bool, budget: int | None, block_size: int | None,
                      drafter_fix: str = "set drafter=<name>, or method=ar") -> Method:
    """The checks every entry (config validation, ddtree.generate, the authors'-code engine) shares:
    a known method, the drafter it needs, a budget >= 1 where it reads one, a block size >= 2."""
    method = get_method(name)
    if method.needs_drafter and not has_drafter:
        raise ConfigError("drafter", f"method={name} needs a DFlash drafter, but there is none", drafter_fix)
    if method.reads_budget:
        check_budget(budget)
    if method.needs_drafter:
        check_block_size(block_size)
    return method
