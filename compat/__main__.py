"""`python -m compat`: the patch table with each patch's status here; `--check` fails on a failed patch.

Applies the patches to find out their status, prints the table, then reverts them.
"""

from __future__ import annotations

import argparse
import json
import sys

from ddtree.errors import ConfigError

from . import core, registry


def _table(entries: list[dict]) -> str:
    """One line per patch (id, status, versions, targets), then its reason and what apply() did."""
    id_w = max([len("id"), *(len(e["id"]) for e in entries)])
    st_w = max([len("status"), *(len(e["status"]) for e in entries)])
    lines = [f"{'id'.ljust(id_w)}  {'status'.ljust(st_w)}  versions / targets"]
    for e in entries:
        versions = ", ".join(f"{k}{v}" for k, v in e["versions"].items()) or "any version"
        lines.append(f"{e['id'].ljust(id_w)}  {e['status'].ljust(st_w)}  {versions}; engine={'/'.join(e['engines'])}")
        pad = " " * (id_w + st_w + 4)
        lines += [f"{pad}target: {t}" for t in e["targets"]]
        if e["condition"]:
            lines.append(f"{pad}when:   {e['condition']}")
        lines.append(f"{pad}why:    {e['reason']}")
        if e["detail"]:
            lines.append(f"{pad}here:   {e['detail']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a patch that should apply failed")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--only", nargs="*", default=None, help="patch ids to apply (default: all)")
    parser.add_argument("--skip", nargs="*", default=(), help="patch ids to leave out")
    parser.add_argument("--engine", choices=core.ENGINES, default=None,
                        help="apply only the rows that engine needs (default: every row)")
    args = parser.parse_args(argv)
    try:
        entries = registry.apply(only=args.only, skip=args.skip, engine=args.engine)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(entries, indent=2))
        else:
            print(_table(entries))
            print(f"\nstatuses: {', '.join(core.STATUSES)}")
    finally:
        registry.revert()
    failed = registry.failures(entries)
    if args.check and failed:
        print(
            f"\ncompat --check: {len(failed)} patch(es) failed: {', '.join(e['id'] for e in failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
