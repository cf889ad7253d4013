"""Resume inside a job: a rerun of a job that died continues at its first unfinished prompt.

Each job dir holds job.json (its config hash, process id and host). A rerun with the same config hash
asks the store for the latest run of that hash that did not finish, reads job.json and samples.jsonl in
that run's job dir, and reuses every prompt whose records are complete (every turn of the method and of
the baseline). It does not when the hashes differ, or when that job's process is still alive on this host.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.pipeline.prompts import Prompt

JOB_FILE = "job.json"


@dataclass
class Resume:
    """The dead job a rerun continues: its run, its job dir, and its finished prompts' records by prompt id."""

    run_id: str
    job_dir: Path
    done: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def write_job_file(job_dir: Path, config_hash: str) -> None:
    (job_dir / JOB_FILE).write_text(json.dumps({"config_hash": config_hash, "pid": os.getpid(),
                                                "host": socket.gethostname()}) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def finished_prompts(samples: Path, prompts: list[Prompt], roles: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Records of the prompts whose every turn has a record of every role; a torn last line is ignored."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    if samples.is_file():
        for line in samples.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the line the kill cut short
                continue
            if isinstance(rec, dict) and "id" in rec:
                by_id.setdefault(str(rec["id"]), []).append(rec)
    done = {}
    for p in prompts:
        recs = by_id.get(p.id, [])
        have = {(r.get("role"), r.get("turn")) for r in recs}
        if all((role, t) in have for role in roles for t in range(len(p.turns))):
            done[p.id] = recs
    return done


def find_resume(tracker: Any, config_hash: str, prompts: list[Prompt], roles: set[str],
                samples: str = "samples.jsonl") -> Resume | None:
    """The unfinished run of this config whose finished prompts (in its job dir's `samples` file) can be reused."""
    old = tracker.unfinished_run(config_hash)
    if old is None or not old["tags"].get("job_dir"):
        return None
    job_dir = Path(old["tags"]["job_dir"])
    try:
        marker = json.loads((job_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("config_hash") != config_hash:  # not the same config: nothing there is reused
        return None
    if (marker.get("host") == socket.gethostname() and marker.get("pid") != os.getpid()
            and isinstance(marker.get("pid"), int) and _alive(marker["pid"])):
        return None  # that job is still running
    return Resume(old["run_id"], job_dir, finished_prompts(job_dir / samples, prompts, roles))
