"""The pipeline: Hydra entry points, the typed schema and its validation, prompts and datasets, job
phases, MLflow tracking, distributed ranks, reports. The engine below it never imports any of this."""
