"""`python -m ddtree.validate <job dir>`: re-check a finished job; the code lives in `ddtree.pipeline.recheck`."""

from ddtree.pipeline.recheck import main

if __name__ == "__main__":
    main()
