"""The independent reference implementations and counters that tests and benchmarks share. The product never
imports it (tests/test_docs.py: test_the_layers_import_only_downward); tiny random models live in ddtree.tiny."""
