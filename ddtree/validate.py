"""`python -m ddtree.validate <job dir>`: re-check a finished job's outputs (the documented command).

The code lives in `ddtree.pipeline.recheck`; the verdicts in `ddtree.engine.output_check` (one output) and
`ddtree.pipeline.output_verdicts` (a job's outputs). Config checks are `ddtree.pipeline.config_checks`.
"""

from ddtree.pipeline.recheck import main

if __name__ == "__main__":
    main()
