#!/usr/bin/env bash
# make test-gpu-stack: the fast suite on the GPU machine's stack, on this CPU (not in CI: a ~4.6 GB venv).
#
#   bench/gpu_stack.sh [PYTEST ARGS]     # default: the fast suite (pytest -q); e.g. tests/test_launches.py -k once
#   GPU_STACK_PYTHON=python3.12 GPU_STACK_VENV=.venv-gpu-stack (ignored by git)
#
# The venv holds what the image holds (bench/gpu_stack.txt: torch 2.11.0 and triton 3.6.0 from PyPI, a CUDA build that
# runs on the CPU; transformers 5.17 and its hub, tokenizers, safetensors) plus the project's other needs and its test
# extra from pyproject.toml, never hydra-core or omegaconf (the image has none: they come with the kit). The kit
# (.kit/, built here by bench/device_kit.sh when absent) is installed with pip --no-index --no-deps --target into
# VENV/kit and put on PYTHONPATH after the checkout, ahead of the venv's site-packages (bench/kit_env.sh, the code
# bench/device_all.sh runs on the GPU machine). The first run downloads ~2.2 GB (torch's CUDA libraries; ~8 min here).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_STACK_VENV:-.venv-gpu-stack}
BASE=${GPU_STACK_PYTHON:-python3.12}
PY=$VENV/bin/python
STAMP=$VENV/.installed
if [ ! -f "$STAMP" ] || [ bench/gpu_stack.txt -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  command -v "$BASE" >/dev/null || { echo "gpu_stack: $BASE not found (the image runs Python 3.12; set GPU_STACK_PYTHON)" >&2; exit 2; }
  [ -x "$PY" ] || "$BASE" -m venv "$VENV"
  reqs=$VENV/requirements.txt
  # pyproject's dependencies and test extra, less what the kit brings (transformers: the image's 5.17 stays under the
  # kit's); hydra-submitit-launcher without its hydra-core
  "$PY" - "$reqs" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
kit = ("hydra-core", "omegaconf", "transformers", "hydra-submitit-launcher")
reqs = [r for r in project["dependencies"] + project["optional-dependencies"]["test"] if not r.startswith(kit)]
open(sys.argv[1], "w").write("\n".join(reqs + ["submitit"]) + "\n")
PY
  "$PY" -m pip install -q -c bench/gpu_stack.txt -r bench/gpu_stack.txt
  "$PY" -m pip install -q -c bench/gpu_stack.txt -r "$reqs"
  "$PY" -m pip install -q --no-deps "$(grep -o 'hydra-submitit-launcher[^"]*' pyproject.toml | head -1)"
  touch "$STAMP"
fi
ls .kit/*.whl >/dev/null 2>&1 || PYTHON=$PY bench/device_kit.sh
# the C tree build for this Python, in place (ignored by git), as `make install` builds it: the CPU's host_tree branch
ls ddtree/engine/_hosttree.cpython-"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"-*.so \
  >/dev/null 2>&1 || "$PY" setup.py -q build_ext --inplace
. bench/kit_env.sh
kit_env "$PY" "$VENV/kit" || { echo "gpu_stack: the kit did not install" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH="bench:$PYTHONPATH" "$PY" -c 'import device_preflight as p; [print(f"{k}: {v}") for k, v in p.versions().items()]'
exec "$PY" -m pytest -q -rs "$@"
