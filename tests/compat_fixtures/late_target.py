"""Imported only by the deferred-patch test, after the patch is registered (post-import hook)."""


def answer() -> int:
    return 41
