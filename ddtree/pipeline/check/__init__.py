"""`python -m ddtree.check`: is another engine right? Its outputs judged against the same target, loaded by ddtree.

    python -m ddtree.check model=qwen3_8b dataset=gsm8k source=endpoint endpoint.url=http://127.0.0.1:8000/v1
    python -m ddtree.check source=file file.path=outputs.jsonl validation=strict      # exit 3 on a suspect output
    python -m ddtree.check temperature=0.7 repeats=200 dataset.max_samples=1          # T > 0: a distribution test

Each output gets a verdict by the rule of docs/validation.md (ddtree.engine.output_check, through
ddtree.pipeline.output_verdicts.validate_records): `exact` (every token the target's greedy choice), `tie` (some
token is not, but within the dtype tolerance, or it is where the target computes it as decoding does: a shape
tie), `suspect` (a token outside it under every computation: position, tokens, logits, margin), `ok` at T > 0
(every token has non-negligible target probability). Results go where a run's go: check.jsonl, summary.json, an
MLflow run (experiment ddtree-check), the table line. docs/check.md.

The package, one job a module: `config` (the typed settings and their checks), `sources` (a server's or a file's
answers as token ids), `gather` (the outputs collected, and ddtree's own AR baseline found in runs/), `verdicts` (a
verdict per output by output_check's rule, the T > 0 tests, the summary), `tracking` (the MLflow run and the result
files), `cli` (the check as named phases, and the entry point).
"""

from ddtree.pipeline.check.cli import main, run_check
from ddtree.pipeline.check.config import CheckConfig, check_settings, to_check_config
from ddtree.pipeline.check.verdicts import check_verdict, sampler_hint

__all__ = ["CheckConfig", "check_settings", "check_verdict", "main", "run_check", "sampler_hint", "to_check_config"]
