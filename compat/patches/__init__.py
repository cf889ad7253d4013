"""One module per patch; each exposes `PATCH` (a `compat.core.Patch`) and the functions it installs.

Patch modules import only `compat.core`, and transformers/torch inside their install functions,
never at import time, so `python -m compat` and the table itself stay cheap to load.
"""

from ..core import UPSTREAM_PACKAGE

__all__ = ["UPSTREAM_PACKAGE"]
