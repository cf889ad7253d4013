"""`python -m ddtree.run`: the Hydra entry point, and the one-line user errors every CLI here shares.

    python -m ddtree.run                                    # tiny smoke run (offline)
    python -m ddtree.run model=qwen3_8b method=dflash
    python -m ddtree.run method=ddtree budget=32,64 -m      # a sweep: one MLflow parent, a child per job
    torchrun --nproc_per_node=8 -m ddtree.run model=qwen3_8b  # data parallel: the prompts shared by 8 ranks

A mistake a user can make ends the process with one line on stderr (exit code 2), before any model work
where possible; DDTREE_TRACEBACK=1 shows the traceback instead. The job itself is ddtree.pipeline.job.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

import hydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from ddtree.errors import ConfigError
from ddtree.pipeline.schema import CONF_DIR

# torchao (model.quantization's backend, test extra), which transformers imports wherever it is installed, logs the
# CUDA-only extensions a CPU build cannot load and torch's deprecation of its Enum registrations on every start: not
# the user's to act on, and they would break the one-line errors below
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

# conf/hydra/launcher/{submitit_slurm,submitit_local,ray}.yaml shadow the plugins' own configs on purpose
# (ddtree's defaults: a GPU per job); Hydra 1.3 then validates them against the plugin's schema, and says so
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema",
                        category=UserWarning)

USER_ERROR_EXIT = 2
# conf/hydra/launcher/*.yaml: the plugin module each needs -> how to install it
LAUNCHER_PACKAGES = {"hydra_plugins.hydra_submitit_launcher": "pip install 'ddtree[cluster]' (hydra-submitit-launcher)",
                     "hydra_plugins.hydra_ray_launcher": "pip install hydra-ray-launcher"}


def tracebacks_wanted() -> bool:
    return bool(os.environ.get("DDTREE_TRACEBACK"))


def one_line(e: BaseException, cli: str = "ddtree.run") -> str:
    """Hydra and OmegaConf errors in one line: the message and its cause, without search paths."""
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options:
        group, _, name = str(e.missing_cfg_file).rpartition("/")
        return f"{group}: unknown option '{name}' — use one of: {', '.join(sorted(e.options))}"
    msg, cause = str(e), e.__cause__
    merging = re.match(r"Error merging override (\S+?)=", msg)
    if merging and cause is not None:
        return f"{merging.group(1)}: {str(cause).splitlines()[0]}"
    unknown = re.match(r"Could not override '([^']+)'", msg)
    if unknown:
        key = unknown.group(1)
        return f"{key}: no such setting — check the spelling (python -m {cli} --cfg job prints every setting)"
    skip = ("Config search path", "provider=", "See https://", "Set the environment variable", "full_key:",
            "object_type=", "Available options")
    lines: list[str] = []
    for exc in (e, e.__cause__):
        if exc is None:
            continue
        for ln in str(exc).splitlines():
            ln = ln.strip()
            if ln and not ln.startswith(skip) and ln not in lines and not set(ln) <= {"^", " "}:
                lines.append(ln)
    return " ".join(lines) or type(e).__name__


def user_error(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(USER_ERROR_EXIT)


def run_cli(hydra_main: Callable[[], None], cli: str) -> None:
    """Call a @hydra.main function, turning user errors (config composition, ConfigError) into one line."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us instead of Hydra's multi-line report
    try:
        hydra_main()
    except ConfigError as e:  # raised outside the job, e.g. by a malformed RANK/WORLD_SIZE environment
        if tracebacks_wanted():
            raise
        user_error(str(e))
    except (HydraException, OmegaConfBaseException) as e:
        if tracebacks_wanted():
            raise
        user_error(one_line(e, cli))
    except RuntimeError as e:  # hydra/launcher=<x> whose plugin is not installed
        missing = next((fix for mod, fix in LAUNCHER_PACKAGES.items() if f"'{mod}." in str(e)), None)
        if missing is None or tracebacks_wanted():
            raise
        user_error(f"hydra/launcher: the launcher plugin is not installed — {missing}")
    except BrokenPipeError:  # `--help | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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


# Both CLIs select an experiment as `experiment=NAME` (a defaults-list group, lightning-hydra-template style).
# Older spellings keep working: `+experiment=NAME` for runs, `train/experiment=NAME` (its group) for training.
RUN_ALIASES = {"+experiment=": "experiment="}
TRAIN_ALIASES = {"experiment=": "train/experiment=", "+experiment=": "train/experiment="}


def spell_overrides(argv: list[str], aliases: dict[str, str]) -> list[str]:
    """argv with each override that starts with an alias's key respelled as its value."""
    out = []
    for arg in argv:
        key = next((k for k in aliases if arg.startswith(k)), None)
        out.append(aliases[key] + arg[len(key):] if key else arg)
    return out


def main() -> None:
    from ddtree.pipeline.distributed import hydra_argv_for_rank, world_from_env

    def start() -> None:
        argv = spell_overrides(sys.argv[1:], RUN_ALIASES)
        sys.argv[1:] = hydra_argv_for_rank(argv, world_from_env())  # torchrun ranks > 0: scratch dirs
        _hydra_main()

    run_cli(start, "ddtree.run")


if __name__ == "__main__":
    main()
