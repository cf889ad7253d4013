#!/usr/bin/env bash
# make device-kit: the wheels the GPU image lacks, for its Python 3.12, in .kit/ (ignored by git; a `device` run
# carries it: carry=[".kit"]). The image (/work/.library/device/KINDS.md) has torch 2.11, triton 3.6, transformers
# 5.17, huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, PyYAML, packaging, typer, regex; no hydra-core,
# omegaconf, antlr4 or mlflow, and no package index. Carried:
#   hydra-core 1.3.2, omegaconf 2.3.0, antlr4-python3-runtime 4.9.3 (PyPI has only its sdist: a pure-Python wheel
#   built here), transformers 5.24.0 (the engine calls models with `cache=` and selects hidden states by index, as
#   transformers has since 5.24: on 5.22 neither works; 5.25 would need huggingface_hub >= 2.4 and `kernels`, which the
#   image lacks: 5.24 needs hub >= 1.31, tokenizers >= 0.23.1, safetensors >= 0.8, all there).
# Not carried: mlflow (run with tracking=none there: with tracking=mlflow and no mlflow the run stops with one line
# naming tracking=none) and datasets (the toy and synthetic prompts need neither).
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .kit/*.whl
#   && export PYTHONPATH=/tmp/site  (bench/device_all.sh does it itself when .kit/ is there)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.kit}
PY=${PYTHON:-python3}
rm -rf "$KIT"
mkdir -p "$KIT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$KIT" \
  hydra-core==1.3.2 omegaconf==2.3.0 transformers==5.24.0
"$PY" -m pip wheel -q --no-deps -w "$KIT" antlr4-python3-runtime==4.9.3
size=$(du -sm "$KIT" | cut -f1)
ls -1 "$KIT"
echo "device-kit: $(ls "$KIT" | wc -l) wheels, ${size} MiB in $KIT"
[ "$size" -le 40 ] || { echo "device-kit: over 40 MiB" >&2; exit 1; }
