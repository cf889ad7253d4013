"""compat: version-gated monkeypatches that let speculative-decoding code written for one
transformers version (the DDTree authors' 4.x-era loops, pure-attention Qwen3) run on the installed
stack, with a record of exactly what was changed.

    import compat
    report = compat.apply(engine="native")   # idempotent; list of {id, status, detail, ...}
    compat.revert()                          # restores the original objects
    python -m compat [--check]               # the table and each patch's status here

Layers: `compat.core` (Patch, Patcher, gates) imports nothing of the package; `compat.patches.*`
import only core; `compat.registry` imports the rows into its table. compat never imports the
`ddtree` engine (only the tiny `ddtree.errors`); transformers and torch load only when patches are
applied.
"""

from ddtree.errors import ConfigError

from .core import ENGINES, STATUSES, Patch, Patcher, PatchUnavailable
from .registry import PATCHES, apply, as_tags, failures, report, revert

__all__ = [
    "ENGINES",
    "PATCHES",
    "STATUSES",
    "ConfigError",
    "Patch",
    "PatchUnavailable",
    "Patcher",
    "apply",
    "as_tags",
    "failures",
    "report",
    "revert",
]
