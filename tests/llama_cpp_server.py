"""A real llama.cpp server for `python -m ddtree.check` (make test-servers; tests/test_check_servers.py).

llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`), installed from the package registry into
a venv of its own, serving the shipped toy_pure target converted to GGUF f32 by llama.cpp's own converter (the
`convert_hf_to_gguf.py` of the same release, from its source archive). Nothing here imitates the server: the test
talks to the real process over a loopback socket.

The venv (DDTREE_SERVERS_VENV, default .venv-servers in the checkout, ignored by git):

    src/llama_cpp_python-<version>.tar.gz   the release's source (pip download): pip builds it, the converter is in it
    src/llama.cpp/                          its convert_hf_to_gguf.py, conversion/ and gguf-py/, unpacked
    convert/                                sentencepiece (pip --target): the converter imports it for every Qwen vocab
    toy_pure-f32.gguf                       the converted target
    installed.json                          what was installed and how long the build took

The converter runs under the project's Python (torch, transformers, safetensors are there). Its list of known
pre-tokenizers is a table of hashes of real checkpoints' tokenizers; the toy's byte-level BPE (GPT-2's regex) is not
in it, so the conversion registers GPT-2's pre-tokenizer for it, and only for a tokenizer whose pre-tokenizer is
byte-level with GPT-2's regex (anything else still fails as the converter says).

The first install compiles llama.cpp from source (PyPI has the source release alone): 28 minutes for 0.3.36 on a
2-core machine busy with other jobs (load ~12). LLAMA_CPP_PYTHON_VERSION picks the release.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddtree.paths import DATA_ROOT

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
VENV = Path(os.environ.get("DDTREE_SERVERS_VENV", DATA_ROOT / ".venv-servers"))
TOY_PURE = DATA_ROOT / "assets" / "toy_pure" / "target"


class Unavailable(RuntimeError):
    """llama-cpp-python could not be installed or the target not converted here (the reason, one line)."""


def _run(cmd: list[str], what: str, *, env: dict[str, str] | None = None, timeout: float = 3600,
         log: Path | None = None) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        raise Unavailable(f"{what} failed (exit {proc.returncode}): {tail[-1] if tail else 'no output'}"
                          + (f" — full log: {log}" if log else ""))


def _installed(py: Path) -> str | None:
    """The llama-cpp-python version the venv holds with its server's packages (None: not installed)."""
    proc = subprocess.run([str(py), "-c", "import importlib.metadata as m, llama_cpp.server.app, uvicorn; "
                           "print(m.version('llama_cpp_python'))"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def install(venv: Path = VENV, version: str = VERSION) -> dict:
    """llama-cpp-python[server]==version in `venv` (built from its source release), its converter unpacked, the
    converter's sentencepiece: what installed.json says (version, build seconds). Reused when already there."""
    stamp = venv / "installed.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("llama_cpp_python") == version:
        return json.loads(stamp.read_text())
    base = os.environ.get("DDTREE_SERVERS_PYTHON") or shutil.which("python3") or sys.executable
    py = venv / "bin" / "python"
    src = venv / "src"
    t0 = time.monotonic()
    if not py.is_file():
        _run([base, "-m", "venv", str(venv)], f"{base} -m venv {venv}")
    src.mkdir(parents=True, exist_ok=True)
    archive = src / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        _run([str(py), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(src),
              f"llama-cpp-python=={version}"], f"pip download llama-cpp-python=={version}")
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL",
                                                                      str(os.cpu_count() or 2))}
    t1 = time.monotonic()
    build_s = None  # None: built before (the venv already held this version)
    if _installed(py) != version:
        _run([str(py), "-m", "pip", "install", "-v", f"{archive}[server]"],
             f"pip install llama-cpp-python[server]=={version} (compiles llama.cpp: needs cmake and a C++ compiler)",
             env=env, log=venv / "install.log")
        build_s = round(time.monotonic() - t1, 1)
    # the converter of the same release: convert_hf_to_gguf.py, its conversion/ package and gguf-py/
    top = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    dest = src / "llama.cpp"
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(top) and (
            m.name == top + "convert_hf_to_gguf.py" or m.name.startswith((top + "conversion/", top + "gguf-py/")))]
        if not any(m.name.endswith("convert_hf_to_gguf.py") for m in members):
            raise Unavailable(f"{archive.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        for m in members:
            m.name = m.name[len(top):]
        tar.extractall(dest, members=members, filter="data")
    _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(venv / "convert"), "--upgrade",
          "sentencepiece"], "pip install --target convert/ sentencepiece (the converter's import)")
    versions = subprocess.run([str(py), "-c", "import importlib.metadata as m; import json; print(json.dumps("
                               "{p: m.version(p) for p in ('llama_cpp_python', 'fastapi', 'uvicorn')}))"],
                              capture_output=True, text=True, check=True).stdout
    info = {"llama_cpp_python": version, "build_s": build_s, "total_s": round(time.monotonic() - t0, 1),
            "python": subprocess.run([str(py), "-V"], capture_output=True, text=True).stdout.strip(),
            "packages": json.loads(versions)}
    stamp.write_text(json.dumps(info, indent=1) + "\n")
    return info


# run by the project's Python: the converter with GPT-2's pre-tokenizer registered for GPT-2-style byte-level BPE
_CONVERT = r"""
import json, sys
from pathlib import Path
src, model = sys.argv[1], Path(sys.argv[2])
sys.path.insert(0, src)
import convert_hf_to_gguf
from conversion import base

pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
gpt2_like = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
known = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not gpt2_like:
            raise
        print("registered: GPT-2's pre-tokenizer for this byte-level BPE (GPT-2's regex)", file=sys.stderr)
        return "gpt-2"

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", str(model), *sys.argv[3:]]
convert_hf_to_gguf.main()
"""


def convert(venv: Path = VENV, model: Path = TOY_PURE) -> Path:
    """`model` as GGUF f32 in the venv (reused when newer than the checkpoint)."""
    out = venv / f"{model.parent.name}-f32.gguf"
    if out.is_file() and out.stat().st_mtime > (model / "model.safetensors").stat().st_mtime:
        return out
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(venv / "convert"),
                                                                   os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    _run([sys.executable, "-c", _CONVERT, str(venv / "src" / "llama.cpp"), str(model), "--outtype", "f32",
          "--outfile", str(out)], f"convert_hf_to_gguf.py {model}", env=env, log=venv / "convert.log", timeout=600)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(gguf: Path, log: Path, venv: Path = VENV, start_s: float = 180) -> Iterator[str]:
    """`python -m llama_cpp.server` on `gguf` at a free loopback port, with its default settings: the OpenAI base
    URL while it runs (its output in `log`)."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen([str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf),
                                   "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_s
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
