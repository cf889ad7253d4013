"""compat: version-gated monkeypatches that let speculative-decoding code written for one
transformers version (and pure-attention Qwen3) run on the installed stack, with a record of
exactly what was changed.

    import compat
    report = compat.apply()          # idempotent; list of {id, status, detail, ...}
    compat.revert()                  # restores the original objects
    python -m compat [--check]       # the table and each patch's status here

compat never imports the `ddtree` package (layering rule); transformers and torch load only when
patches are applied.
"""

from .registry import (
    STATUSES,
    CompatConfigError,
    Patch,
    apply,
    as_tags,
    failures,
    report,
    revert,
)

__all__ = [
    "PATCHES",
    "STATUSES",
    "CompatConfigError",
    "Patch",
    "apply",
    "as_tags",
    "failures",
    "report",
    "revert",
]


def __getattr__(name):
    if name == "PATCHES":  # built on first use: the GDN patch module is imported lazily
        from .registry import table

        return table()
    raise AttributeError(f"module 'compat' has no attribute {name!r}")
