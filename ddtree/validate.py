"""`python -m ddtree.validate <job dir>`: re-check a finished job; the code lives in `ddtree.pipeline.verdicts`."""

from ddtree.pipeline.verdicts import main

if __name__ == "__main__":
    main()
