"""`python -m ddtree.check` against real serving engines, installed into a venv of their own (make test-servers).

llama.cpp: llama-cpp-python's OpenAI-compatible server (tests/llama_cpp_server.py: installed from the package
registry, built from source the first time, the shipped toy_pure target converted to GGUF f32 by llama.cpp's own
converter), on a loopback port, with its default settings, checked through the chat and the completion API with
ddtree's default settings: every output exact or a tie. The server applies a repetition penalty of 1.1 unless a
request says otherwise; ddtree's greedy requests switch it off (docs/check.md), and the same server asked the way
ddtree asked before (`endpoint.server=none`: temperature and top_p only) is caught.

Not in `make test` or `make test-slow` (marker `servers`): the first run compiles llama.cpp. Where it cannot be
installed the tests skip with the reason (DDTREE_SERVERS_REQUIRED=1, set by make test-servers: they fail instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.servers


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory) -> str:
    """The OpenAI base URL of a running llama_cpp.server on toy_pure (f32), for the module."""
    import llama_cpp_server as lcs

    try:
        info = lcs.install()
        gguf = lcs.convert()
    except (lcs.Unavailable, OSError, subprocess.TimeoutExpired) as e:
        if os.environ.get("DDTREE_SERVERS_REQUIRED"):
            raise
        pytest.skip(f"llama-cpp-python {lcs.VERSION} could not be set up here: {e}")
    print(f"llama-cpp-python: {json.dumps(info)}")
    with lcs.serve(gguf, tmp_path_factory.mktemp("llama_cpp") / "server.log") as url:
        yield url


def run_check(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DDTREE_TRACEBACK": ""}
    proc = subprocess.run([sys.executable, "-m", "ddtree.check", "model=toy_pure", *overrides,
                           f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    if not (tmp_path / "job" / "summary.json").is_file():
        pytest.fail(f"no summary (exit {proc.returncode}): {proc.stderr[-3000:]}")
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    records = [json.loads(x) for x in (tmp_path / "job" / "check.jsonl").read_text().splitlines()]
    return proc, summary, records


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_llama_cpp_python_server_outputs_are_exact_with_default_settings(llama_cpp, api, tmp_path):
    proc, s, recs = run_check(tmp_path, f"endpoint.url={llama_cpp}", f"endpoint.api={api}", "validation=strict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    v = s["validation"]
    print(f"{api}: {proc.stdout.strip().splitlines()[-1]}; near_ties={sum(r['check'].get('near_ties') or 0 for r in recs)}"
          f" prompt_mismatches={s.get('prompt_mismatches')} tok/s={s.get('tokens_per_s')}")
    assert (s["outputs"], v["exact"] + v["tie"], v["suspect"]) == (16, 16, 0), v
    assert s["server"] == "llama-cpp-python" and s["sampler"]["repeat_penalty"] == 1.0
    assert not s.get("prompt_mismatches"), "the server saw another prompt than ddtree encoded"
    assert {r["ids_from"] for r in recs} == {"text"}  # the server returns no token ids: the text, re-tokenized
    assert sum(len(r["output_ids"]) for r in recs) > 16 * 8  # real answers, not empty ones


def test_its_default_repeat_penalty_is_caught_and_named(llama_cpp, tmp_path):
    """The requests ddtree sent before (temperature and top_p alone): the server's repeat_penalty 1.1 applies, and
    where it changes a token the verdict is suspect with the sampler named in the reason."""
    proc, s, recs = run_check(tmp_path, f"endpoint.url={llama_cpp}", "endpoint.server=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    suspects = [r for r in recs if r["check"]["verdict"] == "suspect"]
    print(f"endpoint.server=none: {proc.stdout.strip().splitlines()[-1]}; "
          + "; ".join(f"{r['prompt_id']} at {r['check']['position']}: {r['check']['reason']}" for r in suspects))
    assert suspects, "the repetition penalty changed no output (this test would prove nothing)"
    for r in suspects:
        assert r["check"].get("sampler_hint"), r["check"]["reason"]
