"""A patch module that fails to import: the table must show it as failed, not break."""

raise RuntimeError("half-written patch module")
