"""Stands in for compat/gdn_tree.py in the placeholder test: the interface the table expects."""

from compat_fixtures import targets

VERSIONS = ">=5.0"
REASON = "stand-in for the GDN tree-verification patch"
TARGETS = (("compat_fixtures.targets", "Box"),)
CALLS: list[str] = []
_ORIGINAL = targets.Box.size


def install() -> list[str]:
    CALLS.append("install")
    targets.Box.size = lambda self: 2
    return ["Box"]


def uninstall() -> None:
    CALLS.append("uninstall")
    targets.Box.size = _ORIGINAL
