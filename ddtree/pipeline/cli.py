"""`python -m ddtree.run`: the Hydra entry point.

    python -m ddtree.run                                    # tiny smoke run (offline)
    python -m ddtree.run model=qwen3_8b method=dflash
    python -m ddtree.run method=ddtree budget=32,64 -m      # a sweep: one MLflow parent, a child per job
    torchrun --nproc_per_node=8 -m ddtree.run model=qwen3_8b  # data parallel: the prompts shared by 8 ranks

A mistake a user can make ends the process with one line on stderr (exit code 2), before any model work
where possible (ddtree.pipeline.console); DDTREE_TRACEBACK=1 shows the traceback instead. The job itself is
ddtree.pipeline.job.
"""

from __future__ import annotations

import sys
import warnings

import hydra
from omegaconf import DictConfig

from ddtree.errors import ConfigError
from ddtree.pipeline.console import RUN_ALIASES, run_cli, spell_overrides, tracebacks_wanted, user_error
from ddtree.pipeline.schema import CONF_DIR

# conf/hydra/launcher/{submitit_slurm,submitit_local,ray}.yaml shadow the plugins' own configs on purpose
# (ddtree's defaults: a GPU per job); Hydra 1.3 then validates them against the plugin's schema, and says so
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema",
                        category=UserWarning)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from ddtree.pipeline.job import job_dirs, run_job

    try:
        run_job(cfg)
    except BaseException as e:
        from ddtree.pipeline.distributed import world_from_env

        sweep_dir = job_dirs()[1]
        if sweep_dir is not None and world_from_env().is_main:  # the basic launcher stops the sweep here
            from ddtree.pipeline.tracking import fail_sweep

            try:
                fail_sweep(sweep_dir)
            except Exception as err:  # never hide the job's own error behind a tracking one
                print(f"warning: could not mark the sweep's MLflow run failed: {err}", file=sys.stderr)
        if isinstance(e, ConfigError) and not tracebacks_wanted():
            user_error(str(e))  # leaves Hydra as SystemExit: no "Error executing job" banner either
        from ddtree.pipeline.output_verdicts import STRICT_EXIT, SuspectOutputs

        if isinstance(e, SuspectOutputs):
            sys.stderr.write(f"error: {e}\n")
            raise SystemExit(STRICT_EXIT) from None
        raise


def main() -> None:
    from ddtree.pipeline.distributed import hydra_argv_for_rank, world_from_env

    def start() -> None:
        argv = spell_overrides(sys.argv[1:], RUN_ALIASES)
        sys.argv[1:] = hydra_argv_for_rank(argv, world_from_env())  # torchrun ranks > 0: scratch dirs
        _hydra_main()

    run_cli(start, "ddtree.run")


if __name__ == "__main__":
    main()
