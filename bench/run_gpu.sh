#!/usr/bin/env bash
# The one script for a GPU machine: the trainer on the device, kernel correctness, the headline
# benchmarks and the native CUDA build, in under 8 minutes on one H200 (a failed first try leaves
# room for a rerun in a 15-minute slot).
#
#   bash bench/run_gpu.sh [RESULTS_DIR]            the default run: 6 stages, budgets below (~7.9 min)
#   bash bench/run_gpu.sh --full [RESULTS_DIR]     the long run: the whole kernel test suite, every
#                                                  benchmark file and, with >= 2 GPUs, the parallel layouts
#   bash bench/run_gpu.sh --dry-run [RESULTS_DIR]  on a CPU, no GPU: every stage's entry points and
#                                                  arguments at toy sizes (tests/test_run_gpu_dry.py runs it)
#   bash bench/run_gpu.sh --plan                   print the stage plan and where results go, and exit
#   --commit-results                               results into the tracked bench/results/ (the files
#                                                  we commit), not the untracked bench/results/local/
#
# Without --dry-run it needs a CUDA device: when the python it runs ($PYTHON, else python3) sees none
# (torch.cuda.is_available() false or device_count() 0) it says so in one line and exits 3 at once.
#
# Default stages (each under `timeout` with its own budget, seconds):
#   environment  20   GPU, driver, versions; measured copy bandwidth and bf16 matmul rate (the ceilings)
#   train       200   python -m trainer: the debug model, then Llama 3 8B cut to 4 layers (seq 8192,
#                     bf16, FSDP2 on one GPU) eager, compiled and float8: tokens/s, MFU, memory, loss
#   correctness  75   every op and backend against float64 on CUDA tensors, a few shapes each
#   headline     75   RMSNorm, triton_op vs custom_op, rotary, attention (and Llama 4's chunked attention),
#                     fp8 GEMM, Float8Linear,
#                     SwiGLU / cross-entropy when their bench files exist, grouped GEMM, the AdamW
#                     step and Newton-Schulz (optimizers); ratios to baselines (each group's share
#                     of the stage budget)
#   offload      55   the memory levers: the CPU AdamW step per billion params (titan vs torch fused)
#                     on the host, then an 8B-shaped 4-block stack (seq 8192, bf16) with none / full AC
#                     / activation offload / CPU offload / both: peak GPU memory, step time
#   native       50   the native CUDA extension and standalone kernels (built in the background
#                     since stage 3), their tests and ctest
# Results: RESULTS_DIR/<date>-<gpu>.{json,md,log} (default bench/results/local, ignored by git;
# bench/results with --commit-results; a temporary folder in the dry run), rewritten as each stage
# ends, so a stage that overruns loses only itself; trainer outputs under <date>-<gpu>-runs/.
# Autotuning is capped to the first 3 configs of each kernel (BENCH_AUTOTUNE_CONFIGS; 0 = all) in the
# headline stage, and to the default config in the trainer and correctness stages (compile time).
# Nothing is installed: the repo runs from this checkout through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=quick DRY=0 PLAN_ONLY=0 OUT="" COMMIT=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --full) MODE=full ;;
    --plan) PLAN_ONLY=1 ;;
    --commit-results) COMMIT=1 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p;}' "$0"; exit 0 ;;  # this header
    -*) echo "run_gpu.sh: unknown option $arg (expected --dry-run, --full, --plan, --commit-results, --help)" >&2
        exit 2 ;;
    *) OUT=$arg ;;
  esac
done

if [ "$MODE" = quick ]; then
  STAGES=(environment:20 train:200 correctness:75 headline:75 offload:55 native:50)
else
  STAGES=(environment:20 train:200 native-build:240 kernel-tests:150 cmake-ctest:300 benchmarks:300
          fp8-benchmarks:420 attention-benchmarks:540 layouts:1500)
fi
total=0; for s in "${STAGES[@]}"; do total=$((total + ${s#*:})); done
# Results stay out of git unless asked: the tracked folder holds only the runs we mean to commit.
if [ "$COMMIT" = 1 ]; then DEFAULT_OUT=bench/results; else DEFAULT_OUT=bench/results/local; fi
if [ "$PLAN_ONLY" = 1 ]; then
  echo "stage plan ($MODE):"; for s in "${STAGES[@]}"; do printf '  %-22s %5d s\n' "${s%%:*}" "${s#*:}"; done
  printf '  %-22s %5d s\n' total "$total"
  [ "$DRY" = 1 ] && where=${OUT:-${TMPDIR:-/tmp}/titan-run-gpu-dry-run} || where=${OUT:-$DEFAULT_OUT}
  echo "results: $where/<date>-<gpu>.{json,md,log}"; exit 0
fi

[ "$COMMIT" = 1 ] && export BENCH_COMMIT_RESULTS=1  # --full's benchmark tables (BENCH_OUT) go beside them
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BENCH_AUTOTUNE_CONFIGS=${BENCH_AUTOTUNE_CONFIGS:-3} TRITON_CACHE_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1
if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  OUT=${OUT:-${TMPDIR:-/tmp}/titan-run-gpu-dry-run}
  gpu=cpu-dry-run
  # No GPU, Triton in its interpreter, and the packages the GPU machine lacks made unimportable.
  export CUDA_VISIBLE_DEVICES="" TITAN_TEST_DEVICE=cpu TRITON_INTERPRET=1 BENCH_DEVICE=cpu
  export PYTHONPATH="$PWD/bench/dry_run_site:$PYTHONPATH"
  export BENCH_DRY_ABSENT=tensorboard,tiktoken,sentencepiece,pyarrow,datasets,torchao,liger_kernel,flash_attn,flash_attn_interface
  export TITAN_KERNELS_CUDA=0  # a CPU torch cannot build the CUDA kernels: the dry run checks the build code only
  DRYFLAG=--dry-run
  TIME_SCALE=3  # the dry run walks; a shared CPU may be slow: its limits are 3x the printed budgets
else
  PY=${PYTHON:-python3}
  # No device, no run: say so at once (not after every stage has failed in turn) and write nothing.
  if ! why=$($PY -c "
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}): is_available() {torch.cuda.is_available()}, device_count() {n}')
raise SystemExit(n == 0)" 2>/dev/null); then
    echo "run_gpu.sh: no CUDA device visible to $PY (${why:-it cannot import torch}); nothing run (--dry-run walks the stages on a CPU)" >&2
    exit 3
  fi
  OUT=${OUT:-$DEFAULT_OUT}
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')
  [ -n "$gpu" ] || gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
  export TITAN_TEST_DEVICE=cuda TRITON_INTERPRET=0
  DRYFLAG=""
  TIME_SCALE=1
fi
mkdir -p "$OUT"
prefix="$OUT/$(date -u +%Y-%m-%d)-$gpu"
[ "$DRY" = 1 ] && export BENCH_NATIVE_WORK="$prefix-native"  # the dry run writes nothing into the checkout
log="$prefix.log"
: > "$log"
trap '$PY -m bench.gpu_native stop >/dev/null 2>&1' EXIT
echo "run_gpu.sh $MODE$( [ "$DRY" = 1 ] && echo ' (dry run on the CPU)' ): results $prefix.{json,md,log}" | tee -a "$log"
$PY -m bench.gpu_report plan "$prefix" "$MODE$( [ "$DRY" = 1 ] && echo -dry )" "${STAGES[@]}" | tee -a "$log"

failed=()
budget_of() { for s in "${STAGES[@]}"; do [ "${s%%:*}" = "$1" ] && { echo "${s#*:}"; return; }; done; echo 0; }
# run_stage NAME CMD...: CMD under `timeout` with the stage's budget; its output to the log; the
# stage's exit status and wall time recorded in the result files whatever happens.
run_stage() {
  local name=$1; shift
  local budget; budget=$(budget_of "$name")
  echo | tee -a "$log"
  echo "=== $name (budget ${budget} s, $(date -u +%T))" | tee -a "$log"
  local t0; t0=$(date +%s%N)
  BENCH_STAGE_BUDGET=$((budget * TIME_SCALE)) timeout --kill-after=10 $((budget * TIME_SCALE)) "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local elapsed; elapsed=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  $PY -m bench.gpu_report status "$prefix" "$name" "$rc" "$elapsed" "$budget"
  echo "=== $name: rc $rc in $elapsed s" | tee -a "$log"
  [ "$rc" = 0 ] || failed+=("$name")
}

if [ "$MODE" = quick ]; then
  run_stage environment $PY -m bench.gpu_env "$prefix" $DRYFLAG
  TITAN_KERNELS_AUTOTUNE=0 BENCH_AUTOTUNE_CONFIGS=1 run_stage train $PY -m bench.gpu_train "$prefix" $DRYFLAG
  $PY -m bench.gpu_native start $DRYFLAG 2>&1 | tee -a "$log"  # CPU work, overlapping stages 3 to 5
  TITAN_KERNELS_AUTOTUNE=0 BENCH_AUTOTUNE_CONFIGS=1 run_stage correctness $PY -m bench.gpu_correctness "$prefix" $DRYFLAG
  if [ "$DRY" = 1 ]; then  # the GPU parameter lists of the bench modules, checked without a GPU
    BENCH_DEVICE=cuda $PY -m bench.gpu_headline --check-params 2>&1 | tee -a "$log" || failed+=(headline-params)
  fi
  run_stage headline $PY -m bench.gpu_headline "$prefix" $DRYFLAG
  run_stage offload $PY -m bench.gpu_offload "$prefix" $DRYFLAG
  run_stage native $PY -m bench.gpu_native finish "$prefix" $DRYFLAG
else
  # --full: the long version, every stage with its own limit; the pytest stages write their own
  # benchmark tables next to the result files (BENCH_OUT).
  PYTEST=($PY -m pytest -q -p no:cacheprovider -p no:timeout)
  COLLECT=(); [ "$DRY" = 1 ] && COLLECT=(--collect-only)
  run_stage environment $PY -m bench.gpu_env "$prefix" $DRYFLAG
  run_stage train $PY -m bench.gpu_train "$prefix" $DRYFLAG
  if [ "$DRY" = 1 ]; then
    run_stage native-build $PY setup.py --name
  else
    TITAN_KERNELS_CUDA=1 run_stage native-build $PY setup.py build_ext --inplace
  fi
  run_stage kernel-tests "${PYTEST[@]}" tests/kernels tests/test_cuda_compile.py -x "${COLLECT[@]}"
  if [ "$DRY" = 1 ]; then
    run_stage cmake-ctest cmake --version
  else
    run_stage cmake-ctest bash -c 'cmake -S . -B build/cmake-cuda $(command -v ninja >/dev/null && echo -G Ninja) \
        -DTITAN_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" && cmake --build build/cmake-cuda \
        && ctest --test-dir build/cmake-cuda --output-on-failure'
  fi
  BENCH_OUT="$prefix-bench" run_stage benchmarks "${PYTEST[@]}" bench --ignore=bench/bench_fp8.py \
      --ignore=bench/bench_attention.py "${COLLECT[@]}"
  BENCH_OUT="$prefix-fp8" run_stage fp8-benchmarks "${PYTEST[@]}" bench/bench_fp8.py "${COLLECT[@]}"
  BENCH_OUT="$prefix-attention" run_stage attention-benchmarks "${PYTEST[@]}" -s bench/bench_attention.py "${COLLECT[@]}"
  if [ "$DRY" = 1 ]; then
    run_stage layouts $PY -c "import bench.layouts_gpu as l; print(sorted(l.layouts(8)))"
  elif [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run_stage layouts $PY bench/layouts_gpu.py "$prefix-layouts"
  else
    echo "fewer than 2 GPUs visible: the layouts stage is skipped" | tee -a "$log"
  fi
fi

echo | tee -a "$log"
$PY -m bench.gpu_report render "$prefix"
if [ ${#failed[@]} -eq 0 ]; then
  echo "done: every stage passed; $prefix.{json,md,log}" | tee -a "$log"
else
  echo "done: FAILED stages: ${failed[*]}; see $prefix.{md,log}" | tee -a "$log"
  exit 1
fi
