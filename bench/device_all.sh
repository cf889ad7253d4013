#!/usr/bin/env bash
# Every CUDA check in one `device` call (10 minutes at most): a preflight (<= 60 s), then steps by priority within
# 480 s in all, each written under OUTDIR as it runs (a call killed at its limit returns what is there).
#
#   bench/device_all.sh OUTDIR          # on the GPU machine: OUTDIR=$OUT (docs/gpu.md: the one call)
#   DEVICE_STEPS="preflight compiled_tests" bench/device_all.sh OUTDIR   # some steps only
#   DEVICE_BUDGET_S=480 (the steps' total after the preflight), PREFLIGHT_S=60
#
# The image (torch 2.11, triton 3.6, Python 3.12, transformers 5.17, no hydra/omegaconf/mlflow, no index) gets the
# kit when .kit/ holds it (`make device-kit`; the call carries .kit): pip install --no-index --no-deps into a folder
# of its own on PYTHONPATH, ahead of the image's site-packages (transformers 5.22 over 5.17). No MLflow there: a CLI
# run needs tracking=none.
#
# Steps, in this order (the first that matter most; cold compiles after the eager steps, flex last):
#   preflight          bench/device_preflight.py: versions and where each came from, fp32 matmul precision, torch's
#                      SDPA choice for the compiled verify's attention, one tiny compiled round vs HF greedy
#   tests              pytest -m gpu (eager: lossless fp32, bf16 verdicts, fused ops' Triton kernels under
#                      DDTREE_KERNELS=strict, CUDA kernels, one host read a round)
#   launches           bench_launches.py on CUDA (Qwen3.6-27B structure, eager): ops, syncs, real kernel launches
#   compiled_tests     pytest -m gpu -k compiled_round (inductor + CUDA graphs: lossless, no recompile, 1 read)
#   concurrency        device_concurrency.py: generate_many compile=auto (the compiled batched round, CUDA graphs)
#                      vs compile=false at 1, 8, 32 streams on the toy pair: exact (HF greedy, the eager round), tok/s
#   compiled_launches  bench_launches.py --compile on CUDA (ops outside graphs, graph calls, CUDA launches)
#   forward            device_forward.py: the target forward per attention backend and tree size
#   engines            bench_engines.py: native vs the authors' code (toy pairs)
#   flex               device_forward.py's flex_attention row (compiles its kernel)
# Under OUTDIR (8 files at most come back from a call): status.txt (a line per step: exit, seconds, limit),
# steps.log (every step's output, appended as it runs), preflight.json, launches.json, concurrency.json,
# compiled_launches.json, engines.md. Exit: the preflight's and the tests' status (0 = all passed). Without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bench/device_all.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_all: no CUDA device visible to $PY (torch.cuda.is_available() is False or torch absent): nothing to run" \
    | tee "$OUTDIR/status.txt"
  exit 0
fi
. bench/kit_env.sh  # the carried wheels, ahead of the image's packages (make test-gpu-stack puts them there the same way)
kit_env "$PY" "${KIT_DIR:-/tmp/ddtree-kit}"
case $? in
  0) ;;
  1) echo "device_all: no .kit/ (make device-kit; carry .kit): the image's packages only"
     export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;;
  *) echo "device_all: the kit did not install" | tee "$OUTDIR/status.txt"; exit 1 ;;
esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export DDTREE_KERNELS=${DDTREE_KERNELS:-strict}  # a fused op's kernel that fails its first-call check fails the run
STEPS=" ${DEVICE_STEPS:-preflight tests launches compiled_tests concurrency compiled_launches forward engines flex} "
BUDGET=${DEVICE_BUDGET_S:-480}
T0=$SECONDS
: >"$OUTDIR/status.txt"
: >"$OUTDIR/steps.log"

step() {  # step NAME LIMIT CMD...: within its limit and what is left of the budget; output appended to steps.log
  local name=$1 limit=$2; shift 2
  case "$STEPS" in *" $name "*) ;; *) return 0 ;; esac
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$name" != preflight ]; then
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
      echo "$name: skipped (${left} s of the ${BUDGET} s budget left)" | tee -a "$OUTDIR/status.txt"
      return 0
    fi
  fi
  echo "===== $name (limit $limit s) $(date -u +%T)" >>"$OUTDIR/steps.log"
  local t=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$OUTDIR/steps.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t)) s (limit $limit s)" | tee -a "$OUTDIR/status.txt"
  return $rc
}

step preflight "${PREFLIGHT_S:-60}" "$PY" bench/device_preflight.py --out "$OUTDIR/preflight.json"
RC=$?
T0=$SECONDS  # the steps' budget starts after the preflight
export DDTREE_COMPILE=0  # the eager steps: compile=auto stays eager (the grid would compile every shape)
step tests 150 "$PY" -m pytest -q -m gpu tests -rs -p no:cacheprovider -k "not compiled_round"
TESTS_RC=$?
step launches 90 "$PY" bench/bench_launches.py --device cuda --rounds 4 --structures qwen3_6_27b \
  --methods ar,dflash,ddtree:16,ddtree:64,mtp --drafter-contexts '' --out "$OUTDIR/launches.json"
unset DDTREE_COMPILE
step compiled_tests 100 "$PY" -m pytest -q -m gpu tests/test_gpu.py -rs -p no:cacheprovider -k compiled_round
COMPILED_RC=$?
step concurrency 120 "$PY" bench/device_concurrency.py --concurrency 1,8,32 --methods ar,ddtree:16 --new 64 \
  --out "$OUTDIR/concurrency.json"
CONCURRENCY_RC=$?
step compiled_launches 90 "$PY" bench/bench_launches.py --device cuda --compile --structures qwen3_6_27b \
  --methods ddtree:64,dflash,ar --rounds 4 --drafter-contexts '' --bytes-contexts '' \
  --out "$OUTDIR/compiled_launches.json"
export DDTREE_COMPILE=0
step forward 60 "$PY" bench/device_forward.py --prefix 4096 --tokens 1,16,64,256 --repeats 5 --warmup 2 \
  --backends sdpa/dense,sdpa/split,flash_attention_2/split,flash_attention_3/split
step engines 120 "$PY" bench/bench_engines.py --device cuda --dtype bfloat16 --pairs toy,toy_pure --prompts 16 \
  --passes 3 --out "$OUTDIR/engines.md"
step flex 50 "$PY" bench/device_forward.py --prefix 4096 --tokens 1,64 --repeats 3 --warmup 2 \
  --backends sdpa/split,flex_attention/split
echo "device_all: $((SECONDS - T0)) s after the preflight; $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
[ "$RC" -eq 0 ] && RC=$TESTS_RC
[ "$RC" -eq 0 ] && RC=$COMPILED_RC
[ "$RC" -eq 0 ] && RC=$CONCURRENCY_RC
exit "$RC"
