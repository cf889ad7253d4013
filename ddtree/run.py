"""`python -m ddtree.run`: the entry point; the code lives in `ddtree.pipeline.cli` (entry) and `ddtree.pipeline.job`."""

from ddtree.pipeline.cli import main

if __name__ == "__main__":
    main()
