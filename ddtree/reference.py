"""`python -m ddtree.reference`: the entry point; the code lives in `ddtree.pipeline.reference`."""

from ddtree.pipeline.reference import main

if __name__ == "__main__":
    main()
