#!/usr/bin/env bash
# Every CUDA path in one call, under 8 minutes on one GPU, written to one Markdown file:
#   1. the lossless and verdict tests on CUDA (pytest -m gpu over tests/: fp32/bf16, sdpa/flash, split/dense, the fused
#      ops' Triton kernels (DDTREE_KERNELS=strict: one that fails its first-call check fails the run), the CUDA
#      kernels, the fused norm, one host read a round with CUDA-event stage timing),
#   2. bench/device_forward.py (target forward per backend and tree size, a Qwen3-8B-shaped random model),
#   3. bench/bench_launches.py (ops, syncs and real kernel launches per round on Qwen3.6-27B's and Qwen3-8B's layer
#      structure at tiny width, the predicted H200 round; JSON next to OUT.md as OUT.launches.json),
#   4. bench/bench_engines.py (native vs the authors' code vs transformers' DFlash, interleaved),
#   5. device_forward's flex_attention row (compiled first, so last and alone),
#   6. the compiled round (compile=true: inductor with CUDA graphs, docs/compile.md): its CUDA test, then
#      bench_launches --compile on the Qwen3.6-27B structure (ops outside the graphs, graph calls, CUDA launches).
#      It runs first (the riskiest, never yet run on a GPU); the report keeps the numbering above.
#   Steps 1-5 run the eager round (DDTREE_COMPILE=0 keeps compile=auto off: the grid would compile every shape).
#
#   bench/device_all.sh [OUT.md]                     # default runs/device_all.md
#   DDTREE_UPSTREAM=runs/ddtree-upstream bench/device_all.sh   # with the authors' checkout (never committed)
#   DEVICE_STEPS="compiled" bench/device_all.sh runs/device_compiled.md   # some steps only (default: all six)
#
# Each step has its own time limit (STEP_S_TESTS, STEP_S_FORWARD, STEP_S_LAUNCHES, STEP_S_ENGINES, STEP_S_FLEX,
# STEP_S_COMPILED_TESTS, STEP_S_COMPILED_LAUNCHES seconds)
# so a slow step
# cannot eat the others; a failed or timed-out step is recorded in the file and the next one still runs.
# The exit status is the tests' (0 = every CUDA test passed). Without a CUDA device it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_MD=${1:-runs/device_all.md}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# a fused op whose Triton kernel fails or disagrees on its first CUDA call raises here (never the silent fallback)
export DDTREE_KERNELS=${DDTREE_KERNELS:-strict}
mkdir -p "$(dirname "$OUT_MD")"
LOG_DIR=$(mktemp -d)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_all: no CUDA device visible to $PY (torch.cuda.is_available() is False): nothing to run"
  exit 0
fi

STEPS=" ${DEVICE_STEPS:-tests forward launches engines flex compiled} "
step() {  # step NAME SECONDS CMD... : run with a limit, log to $LOG_DIR/NAME.log, echo the status
  local name=$1 limit=$2; shift 2
  case "$STEPS" in *" ${name%%_*} "*) ;; *) echo "(step $name not selected)" >"$LOG_DIR/$name.log"; return 0 ;; esac
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$LOG_DIR/status"
  return $rc
}

# limits add up to 520 s for steps 1-5 and 300 s for step 6, plus start-up: run them as two calls where a call is
# limited to 10 minutes (DEVICE_STEPS="compiled tests", then DEVICE_STEPS="forward launches engines flex")
# the compiled round first: never run on a GPU before, the riskiest and the one compile=auto picks there
step compiled_tests "${STEP_S_COMPILED_TESTS:-150}" "$PY" -m pytest -q -m gpu tests/test_gpu.py -rs \
  -p no:cacheprovider -k compiled_round
COMPILED_RC=$?
step compiled_launches "${STEP_S_COMPILED_LAUNCHES:-150}" "$PY" bench/bench_launches.py --device cuda --compile \
  --structures qwen3_6_27b --methods ddtree:64,dflash,ar --rounds 4 --drafter-contexts '' \
  --out "${OUT_MD%.md}.compiled_launches.json"
export DDTREE_COMPILE=0
step tests "${STEP_S_TESTS:-150}" "$PY" -m pytest -q -m gpu tests -rs -p no:cacheprovider -k "not compiled_round"
TESTS_RC=$?
step forward "${STEP_S_FORWARD:-80}" "$PY" bench/device_forward.py --prefix 4096 --tokens 1,16,64,256 \
  --repeats 5 --warmup 2 --backends sdpa/dense,sdpa/split,flash_attention_2/split,flash_attention_3/split
step launches "${STEP_S_LAUNCHES:-120}" "$PY" bench/bench_launches.py --device cuda --rounds 4 \
  --out "${OUT_MD%.md}.launches.json"
step engines "${STEP_S_ENGINES:-120}" "$PY" bench/bench_engines.py --device cuda --dtype bfloat16 \
  --pairs toy,toy_pure --prompts 16 --passes 3 --out "$LOG_DIR/engines.md"
# flex compiles its kernel first (tens of seconds): last, alone, so a slow compile costs only its own figures
step flex "${STEP_S_FLEX:-50}" "$PY" bench/device_forward.py --prefix 4096 --tokens 1,64 --repeats 3 --warmup 2 \
  --backends sdpa/split,flex_attention/split
[ "$TESTS_RC" -eq 0 ] && TESTS_RC=$COMPILED_RC

{
  echo "# device_all: $("$PY" -c "import torch; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)")"
  echo
  echo "$(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo '```'
  cat "$LOG_DIR/status"
  echo '```'
  echo
  echo "## 1. CUDA tests (pytest -m gpu)"
  echo
  echo '```'
  tail -n 40 "$LOG_DIR/tests.log"
  echo '```'
  echo
  echo "## 2. Target forward per backend (bench/device_forward.py)"
  echo
  echo '```'
  cat "$LOG_DIR/forward.log"
  echo '```'
  echo
  echo "## 2a. Launches, syncs and the predicted H200 round (bench/bench_launches.py)"
  echo
  echo '```'
  grep -v "falling back" "$LOG_DIR/launches.log"
  echo '```'
  echo
  echo "## 2b. flex_attention (compiled) against sdpa/split"
  echo
  echo '```'
  cat "$LOG_DIR/flex.log"
  echo '```'
  echo
  echo "## 2c. The compiled round (compile=true, CUDA graphs): tests and bench_launches --compile"
  echo
  echo '```'
  tail -n 30 "$LOG_DIR/compiled_tests.log"
  grep -v "falling back" "$LOG_DIR/compiled_launches.log"
  echo '```'
  echo
  if [ -s "$LOG_DIR/engines.md" ]; then
    cat "$LOG_DIR/engines.md"
  else
    echo "## 3. Engines side by side: no table (see the log)"
    echo
    echo '```'
    tail -n 40 "$LOG_DIR/engines.log"
    echo '```'
  fi
} >"$OUT_MD"
echo "device_all: wrote $OUT_MD"
exit $TESTS_RC
