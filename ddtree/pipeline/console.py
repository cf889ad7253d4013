"""How every CLI of ddtree talks to its user: a mistake as one line on stderr (exit code 2; DDTREE_TRACEBACK=1 shows
the traceback instead), and progress as bars on a terminal but one line per job elsewhere (CI, nohup, a SLURM log),
where each bar frame would become a line of its own; and the experiment spellings both CLIs accept."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TextIO

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from ddtree.errors import ConfigError
from ddtree.noise import quiet_library_noise

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
        key = merging.group(1)
        if "Cannot convert 'dict' to string" in str(cause) and "." in key:  # a setting under a plain value
            return f"{key}: {nested_setting_fix(key)}"
        return f"{key}: {str(cause).splitlines()[0]}"
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


def nested_setting_fix(key: str) -> str:
    """`method.steps=3` and the like: the part before the dot is a plain value, not a group; where a method's own
    settings live instead (the methods table's `settings` groups and their fields)."""
    from dataclasses import fields

    from ddtree.engine.methods import METHODS
    from ddtree.pipeline.schema import RunConfig

    parent = key.rsplit(".", 1)[0]
    groups = {f.name: f for f in fields(RunConfig)}
    own = [f"{g}.{f.name}" for g in dict.fromkeys(m.settings for m in METHODS.values() if m.settings)
           for f in fields(groups[g].default_factory())]
    where = f" — a method's own settings: {', '.join(own)}" if parent == "method" and own else ""
    return (f"'{parent}' is a single value, not a group of settings: no such setting{where} "
            f"(python -m ddtree.run --cfg job prints every setting)")


def user_error(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(USER_ERROR_EXIT)


def run_cli(hydra_main: Callable[[], None], cli: str) -> None:
    """Call a @hydra.main function, turning user errors (config composition, ConfigError) into one line."""
    quiet_library_noise()
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


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def library_bars_off_outside_a_terminal(stream: TextIO | None = None) -> bool:
    """Outside a terminal, turn off the libraries' own progress bars (transformers' weight loading, the hub's
    downloads): in a log each frame is a line. Returns whether it did."""
    if is_terminal(stream if stream is not None else sys.stderr):
        return False
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return True


class Progress:
    """`for item in Progress(items, desc, unit):` a tqdm bar where `file` is a terminal; elsewhere nothing while it runs
    and one line when it ends (`desc: N units in S s` and the postfix). `set_postfix(**kw)` as tqdm's."""

    def __init__(self, items: Iterable, desc: str, unit: str, *, file: TextIO | None = None, enabled: bool = True):
        self.items, self.desc, self.unit, self.enabled = items, desc, unit, enabled
        self.file = file if file is not None else sys.stderr
        self.postfix: dict[str, Any] = {}
        self.bar = None
        if enabled and is_terminal(self.file):
            from tqdm import tqdm

            self.bar = tqdm(items, desc=desc, unit=unit, file=self.file, dynamic_ncols=True)

    def set_postfix(self, **kw: Any) -> None:
        self.postfix.update(kw)
        if self.bar is not None:
            self.bar.set_postfix(**kw)

    def __iter__(self) -> Iterator:
        if self.bar is not None:
            yield from self.bar
            return
        import time

        t0, n = time.perf_counter(), 0
        for item in self.items:
            yield item
            n += 1
        if self.enabled:
            extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
            self.file.write(f"{self.desc}: {n} {self.unit}{'s' if n != 1 else ''} in "
                            f"{time.perf_counter() - t0:.1f} s{extra}\n")
            self.file.flush()


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
