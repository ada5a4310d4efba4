#!/usr/bin/env bash
# One-shot GPU machine check, sized for a 15-minute device budget (this script: < 8 minutes).
#
#   1. build canonical-kv with its CUDA kernels (pip install --no-build-isolation -e .;
#      falls back to setup.py build_ext --inplace);
#   2. the CUDA tests: pytest -m cuda tests/, then the rest of tests/test_ops_cuda.py and
#      tests/test_shared_region.py;
#   3. the CUDA benchmark: bench/bench_transfer.py --device cuda --quick.
#
# Everything is logged to $OUT/log; the benchmark writes $OUT/bench/bench_cuda.{json,md} (and
# PNGs when matplotlib is installed; otherwise render them later with
# `python bench/report.py $OUT/bench/bench_cuda.json`); $OUT/summary.txt lists each step's exit
# status and time. Every step runs under `timeout`, within a total budget
# (DEVICE_CHECK_BUDGET_S, default 470 s) that keeps BENCH_RESERVE_S (default 170 s) for the
# benchmark. No network needed.
#
# Usage: OUT=/path/to/results bench/device_check.sh      (default OUT: bench/results/device)
# Env:   PYTHON (default: python, else python3), MAX_JOBS (16), TORCH_CUDA_ARCH_LIST (9.0).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/bench/results/device}"
mkdir -p "$OUT/bench"
LOG="$OUT/log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"
BUDGET="${DEVICE_CHECK_BUDGET_S:-470}"
RESERVE="${BENCH_RESERVE_S:-170}"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif command -v python >/dev/null 2>&1; then
  PY=python
else
  PY=python3
fi
START=$SECONDS

note() { echo "$*" | tee -a "$LOG" "$SUMMARY"; }

# step NAME LIMIT_S [KEEP_S] -- CMD...: run CMD under timeout, never past the budget, leaving
# KEEP_S seconds of the budget for later steps.
step() {
  local name=$1 limit=$2 keep=$3
  shift 4
  local left=$((BUDGET - (SECONDS - START) - keep))
  if ((left < 20)); then
    note "SKIP  $name: only ${left}s of the budget left"
    return 124
  fi
  ((limit > left)) && limit=$left
  echo "=== [$(date +%T)] $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  note "$(printf '%-5s %s: rc=%s in %ss' "$([ $rc -eq 0 ] && echo OK || echo FAIL)" "$name" "$rc" "$((SECONDS - t0))")"
  return $rc
}

{
  echo "=== machine"
  date
  timeout 20 nvidia-smi || echo "nvidia-smi unavailable"
  timeout 20 nvcc --version || echo "nvcc not on PATH"
  timeout 60 "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  git -C "$ROOT" rev-parse HEAD 2>/dev/null && git -C "$ROOT" status --short 2>/dev/null
} >>"$LOG" 2>&1

export CANONICAL_KV_BUILD_CUDA=1
export MAX_JOBS="${MAX_JOBS:-16}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

built=0 failed=0
if step build 240 "$RESERVE" -- "$PY" -m pip install --no-build-isolation --no-deps -e .; then
  built=1
elif step build-inplace 200 "$RESERVE" -- "$PY" setup.py build_ext --inplace; then
  built=1
  note "      (pip install failed; using the in-place build)"
else
  failed=1
fi

if ((built)); then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  step tests-cuda-marked 150 "$RESERVE" -- \
    "$PY" -m pytest -q -m cuda tests/ --ignore=tests/vllm -p no:cacheprovider || failed=1
  step tests-ops-shared-rest 90 "$RESERVE" -- \
    "$PY" -m pytest -q -m "not cuda" tests/test_ops_cuda.py tests/test_shared_region.py \
    -p no:cacheprovider || failed=1
  left=$((BUDGET - (SECONDS - START)))
  # The benchmark stops starting new cases 45 s before its limit (JSON is written per case).
  step bench "$left" 0 -- "$PY" bench/bench_transfer.py --device cuda --quick \
    --out "$OUT/bench" --time-budget $((left > 90 ? left - 45 : 45)) \
    --build-dir "${TMPDIR:-/tmp}/canonical-kv-bench" || failed=1
else
  note "SKIP  tests and benchmark: the build failed (see $LOG)"
fi

note "total: $((SECONDS - START))s of ${BUDGET}s; results in $OUT"
ls -la "$OUT" "$OUT/bench" >>"$LOG" 2>&1
exit "$failed"
