"""Running the DDTree authors' code (`engine=upstream`): its loader, through the compat registry, and
an engine adapter that reports the same `GenerationResult` as ours. Their code is never committed."""
