"""`python -m ddtree.check`: the check as named phases (settings, source, tokenizer, tracking and resume, the
target, gathering, verdicts, results), and its Hydra entry point."""

from __future__ import annotations

import sys
import time
from typing import Any

import hydra
from omegaconf import DictConfig

from ddtree.errors import ConfigError
from ddtree.pipeline.check.config import CHECK_FILE, CheckConfig, check_settings, identity, to_check_config
from ddtree.pipeline.check.gather import gather_endpoint, gather_file, open_source
from ddtree.pipeline.check.tracking import finish, start_tracking
from ddtree.pipeline.check.verdicts import judge
from ddtree.pipeline.schema import CONF_DIR, tracking_uri


def run_check(cfg: DictConfig | CheckConfig) -> dict[str, Any]:
    """One check, as named phases: settings, source, tokenizer, tracking (resume), the target, gathering,
    verdicts, results. The summary."""
    from ddtree.pipeline.job import apply_compat, environment, job_dirs, record_failure, stop_token_ids
    from ddtree.pipeline.models import load_target, load_tokenizer, resolve_device
    from ddtree.pipeline.output_verdicts import SuspectOutputs
    from ddtree.pipeline.preflight import check_prompt_tokens
    from ddtree.pipeline.resume import find_resume, write_job_file
    from ddtree.pipeline.tracking import TAG_RESUMED_FROM, config_hash, make_tracker

    cc = to_check_config(cfg)
    for holder in (cc.dataset, cc.file):
        if holder.path:
            holder.path = hydra.utils.to_absolute_path(holder.path)
    rc = check_settings(cc)
    src = open_source(cc, rc)
    tokenizer = load_tokenizer(rc)
    check_prompt_tokens(src.prompts, tokenizer, "file.path" if src.file else "dataset")
    job_dir = job_dirs()[0]
    chash = config_hash(identity(cc, src.outputs, src.file.sha256 if src.file else None))
    tracker = make_tracker(cc.tracking.backend, tracking_uri(rc) if cc.tracking.backend == "mlflow" else None,
                           cc.tracking.experiment)
    resume = find_resume(tracker, chash, src.outputs, {"method"}, samples=CHECK_FILE) if src.client else None
    write_job_file(job_dir, chash)
    device = resolve_device(rc.device)
    env = environment(device, apply_compat(rc))
    run = start_tracking(cc, tracker, chash, job_dir, env)
    if resume is not None and resume.done:
        print(f"resuming: {len(resume.done)} of {len(src.outputs)} outputs were gathered by {resume.job_dir}",
              flush=True)
        tracker.supersede(resume.run_id, getattr(run, "run_id", None))
        if run is not None:
            run.set_tags({TAG_RESUMED_FROM: resume.run_id})
    try:
        t_load = time.perf_counter()
        target, _ = load_target(rc, device)
        load_s = time.perf_counter() - t_load
        stops = stop_token_ids(tokenizer, target)
        vocab = target.get_input_embeddings().weight.shape[0]
        with (job_dir / CHECK_FILE).open("w", encoding="utf-8") as out:
            if src.client is not None:
                g = gather_endpoint(cc, rc, src.client, src.prompts, tokenizer, stops, vocab, out,
                                    resume.done if resume else {})
            else:
                g = gather_file(cc, src.file, tokenizer, stops, vocab, out)
        if g.error is not None and not g.records:
            raise g.error
        summary = judge(cc, rc, target, tokenizer, src.outputs, g, stops, job_dir)
        summary.update(load_s=load_s, config_hash=chash, **{k: env[k] for k in ("versions", "device", "device_name")})
        finish(cc, summary, g, src, run, job_dir)
        return summary
    except SuspectOutputs:
        raise
    except BaseException as e:  # the run says FAILED (KILLED on Ctrl-C), with what was gathered
        if run is not None:
            from ddtree.pipeline.job import JobFiles

            _, sweep_dir, overrides, _ = job_dirs()
            record_failure(run, JobFiles(job_dir, sweep_dir, overrides, None, job_dir / CHECK_FILE), e)
        raise


# ---------------------------------------------------------------- entry


@hydra.main(config_path=str(CONF_DIR), config_name="check", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from ddtree.pipeline.cli import tracebacks_wanted, user_error
    from ddtree.pipeline.output_verdicts import STRICT_EXIT, SuspectOutputs

    try:
        run_check(cfg)
    except ConfigError as e:
        if tracebacks_wanted():
            raise
        user_error(str(e))
    except SuspectOutputs as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(STRICT_EXIT) from None


def main() -> None:
    from ddtree.pipeline.cli import run_cli

    run_cli(_hydra_main, "ddtree.check")
