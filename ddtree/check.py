"""`python -m ddtree.check`: another engine's outputs (a server, or a file) judged against the same target.

The code lives in `ddtree.pipeline.check` (the job), `ddtree.pipeline.check_sources` (outputs -> token ids) and
`ddtree.pipeline.endpoint` (the HTTP client); the verdicts are `ddtree.pipeline.output_verdicts`'. docs/check.md.
"""

from ddtree.pipeline.check import main

if __name__ == "__main__":
    main()
