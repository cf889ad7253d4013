"""`python -m ddtree.report`: the entry point; the code lives in `ddtree.pipeline.report`."""

from ddtree.pipeline.report import main

if __name__ == "__main__":
    main()
