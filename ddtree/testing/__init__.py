"""Tiny random models, the character tokenizer and the independent reference implementations that
tests and benchmarks share. The product imports it only to build `model=tiny_*` smoke-run models."""
