"""ddtree.engine.host: the CPU allocator settings, set once per process, and where they are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddtree.engine import host

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def _state_in_child(env: dict[str, str], code: str = "print(h.tune_host_allocator())") -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DDTREE_HOST_MALLOC", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", f"import ddtree.engine.host as h\n{code}"],
                         env={**base, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@glibc
def test_a_fresh_process_gets_both_thresholds():
    state = _state_in_child({})  # one child process
    assert state.startswith("glibc ")
    assert "mmap threshold 32 MiB, trim threshold 1024 MiB" in state


@pytest.mark.parametrize(("env", "named"), [
    ({"DDTREE_HOST_MALLOC": "0"}, "DDTREE_HOST_MALLOC=0"),
    ({"MALLOC_TRIM_THRESHOLD_": "4096"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
])
def test_the_environment_wins_and_is_named(env, named):
    state = _state_in_child(env)
    assert state.startswith("untouched") and named in state


@glibc
def test_other_glibc_tunables_do_not_stop_it():
    assert _state_in_child({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}).startswith("glibc ")


@pytest.mark.slow  # three child processes, ~23 s
@glibc
def test_only_an_engine_that_asks_sets_it_once():
    """A library Engine leaves malloc alone unless asked (the setting, or DDTREE_HOST_MALLOC=1); the CLI asks."""
    code = ("import ddtree\nfrom ddtree.tiny import tiny_model\nt = tiny_model('qwen3', seed=0)\n"
            "e = ddtree.Engine(t, method='ar')\nassert not h._STATE and e.binding.host_allocator == 'untouched'\n"
            "e = ddtree.Engine(t, method='ar', tune_host_allocator=True)\nfirst = h._STATE['state']\n"
            "assert h.tune_host_allocator() is first and e.binding.host_allocator is first\nprint(first)")
    assert _state_in_child({}, code).startswith("glibc ")
    by_env = ("import ddtree\nfrom ddtree.tiny import tiny_model\n"
              "ddtree.Engine(tiny_model('qwen3', seed=0), method='ar')\nprint(h._STATE.get('state', 'unset'))")
    assert _state_in_child({"DDTREE_HOST_MALLOC": "1"}, by_env).startswith("glibc ")
    assert _state_in_child({}, by_env) == "unset"


def test_the_cli_asks_for_it_and_keeps_it_out_of_the_identity():
    from ddtree.pipeline import schema

    assert schema.RunConfig().host_allocator is True and "host_allocator" in schema.NON_IDENTITY_KEYS


def test_the_state_is_words_in_this_process():
    assert isinstance(host.tune_host_allocator(), str)
