# Sourced (bash) by bench/device_all.sh and bench/gpu_stack.sh: the device kit (.kit/*.whl, `make device-kit`) put on
# the path as the GPU machine uses it.
#   kit_env PYTHON KIT_DIR   pip install --no-index --no-deps --target KIT_DIR .kit/*.whl, then
#                            PYTHONPATH=$PWD:KIT_DIR[:$PYTHONPATH]: the checkout, then the kit ahead of PYTHON's own
#                            site-packages (the kit's transformers over the image's)
# Run from the checkout's root. Returns 1 when .kit/ holds no wheel, 2 when the install failed.
kit_env() {
  local py=$1 dir=$2
  ls .kit/*.whl >/dev/null 2>&1 || return 1
  mkdir -p "$dir" && dir=$(cd "$dir" && pwd)  # absolute: subprocesses run elsewhere (the CLI tests)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" .kit/*.whl \
    || return 2
  export PYTHONPATH="$PWD:$dir${PYTHONPATH:+:$PYTHONPATH}"
}
