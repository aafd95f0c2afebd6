#!/usr/bin/env bash
# The one script for a GPU machine: environment, native build, CUDA tests, benchmarks, result files.
#
#   bash bench/run_gpu.sh [RESULTS_DIR]      (default bench/results; about 8 minutes on an H100/H200, plus up to 7 for float8, up to 9 for attention,
#                                            up to 25 for the multi-GPU layouts when >= 2 GPUs are visible)
#
# Writes RESULTS_DIR/<date>-<gpu>.{json,md} (benchmark table with the measured copy bandwidth and
# bf16 matmul rate, device, date and versions) and RESULTS_DIR/<date>-<gpu>.log (everything printed).
# Each stage has its own time limit, so one slow stage cannot eat the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TITAN_TEST_DEVICE=cuda TRITON_INTERPRET=0
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
prefix="$OUT/$(date -u +%Y-%m-%d)-$gpu"
log="$prefix.log"
: > "$log"
stage() { echo; echo "=== $1 ($(date -u +%T))" | tee -a "$log"; }

stage "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  which nvcc && nvcc --version | tail -1; } 2>&1 | tee -a "$log"

stage "native CUDA extension build (in place)"
TITAN_KERNELS_CUDA=1 timeout 240 $PY setup.py build_ext --inplace 2>&1 | tail -25 | tee -a "$log"
$PY -c "import titan_kernels as tk; [print(' ', s) for s in tk.available_backends('cuda').values()]" 2>&1 | tee -a "$log"

stage "kernel tests on CUDA tensors"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/kernels -x --timeout 120 2>&1 | tail -30 | tee -a "$log"

stage "standalone CUDA kernels (CMake, no torch) and their ctest"
if command -v cmake >/dev/null; then
  { cmake -S . -B build/cmake-cuda $(command -v ninja >/dev/null && echo -G Ninja) -DTITAN_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" >/dev/null \
    && timeout 180 cmake --build build/cmake-cuda >/dev/null && timeout 120 ctest --test-dir build/cmake-cuda -V; } 2>&1 \
    | grep -E "^[0-9]+: (ok|FAIL|SKIP|PASSED|FAILED)|tests passed|rror" | tail -80 | tee -a "$log"
else echo "cmake not installed: skipped" | tee -a "$log"; fi

stage "benchmarks"
BENCH_OUT="$prefix" timeout 300 $PY -m pytest -q -p no:cacheprovider bench --ignore=bench/bench_fp8.py --ignore=bench/bench_attention.py --benchmark-disable --timeout 280 2>&1 \
  | grep -v "^bench/" | tail -120 | tee -a "$log"

stage "float8 benchmarks: GEMM at Llama shapes, Float8Linear fwd+bwd (own stage: autotuning and compiles)"
BENCH_OUT="$prefix-fp8" timeout 420 $PY -m pytest -q -p no:cacheprovider bench/bench_fp8.py --benchmark-disable --timeout 400 2>&1 \
  | grep -v "^bench/" | tail -80 | tee -a "$log"

stage "attention benchmarks: titan flash_attn vs SDPA backends and FA3/FA2, seq 1k-16k (own stage: autotuning)"
BENCH_OUT="$prefix-attention" timeout 540 $PY -m pytest -q -s -p no:cacheprovider bench/bench_attention.py --benchmark-disable --timeout 520 2>&1 \
  | grep -v "^bench/" | tail -120 | tee -a "$log"

stage "parallel layouts: TP 2 compiled vs eager, 2-D FSDP x TP and 3-D FSDP x TP x PP tokens/s and MFU (>= 2 GPUs)"
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  timeout 1500 $PY bench/layouts_gpu.py "$prefix-layouts" 2>&1 | tail -40 | tee -a "$log"
else echo "fewer than 2 GPUs visible: skipped" | tee -a "$log"; fi

stage "done: $prefix.{json,md,log}, $prefix-fp8.{json,md}, $prefix-attention.{json,md} and $prefix-layouts.{json,md}"
