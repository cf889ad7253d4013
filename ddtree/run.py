"""`python -m ddtree.run`: the entry point; the code lives in `ddtree.pipeline.job`."""

from ddtree.pipeline.job import main

if __name__ == "__main__":
    main()
