"""`python -m ddtree.check`: another engine's outputs (a server, or a file) judged against the same target.

The code lives in the package `ddtree.pipeline.check` (one job a module: config, sources, gather, verdicts, tracking,
cli) and `ddtree.pipeline.endpoint` (the HTTP client); the verdicts are `ddtree.pipeline.output_verdicts`'.
docs/check.md.
"""

from ddtree.pipeline.check import main

if __name__ == "__main__":
    main()
