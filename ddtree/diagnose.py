"""`python -m ddtree.diagnose <job dir | sweep dir>`: the entry point; the code lives in `ddtree.pipeline.diagnose`."""

from ddtree.pipeline.diagnose.cli import main

if __name__ == "__main__":
    main()
