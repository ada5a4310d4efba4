#!/usr/bin/env bash
# One-shot GPU machine check, sized for an H200 in < 6 minutes (a rerun fits a 15-minute
# device budget). Everything goes under $OUT: log (all output), summary.txt (one screen),
# cuda-tests.xml, sanitizer.log, kernel_variants.{json,md}, bench/bench_cuda.{json,md}.
#
#   1. build canonical-kv with its CUDA kernels (pip install --no-build-isolation -e .;
#      falls back to setup.py build_ext --inplace);
#   2. the kernel image / registers / occupancy the driver reports for this GPU;
#   3. every CUDA test: pytest -m cuda over the files holding them (ops incl. kernel
#      variants, graph capture and bit-exact replay, device-id errors, plan identity;
#      OffloadWorker on side streams, concurrent jobs, poll()/wait() while a long kernel
#      runs on the compute stream; the vLLM worker's CUDA test only if vLLM is importable);
#   4. compute-sanitizer memcheck over a subset of the ops tests;
#   5. the kernel variants measured against each other (bench/kernel_variants.py);
#   6. the quick transfer benchmark (bench/bench_transfer.py --device cuda --quick), in
#      whatever time is left.
# Every step runs under `timeout`, within DEVICE_CHECK_BUDGET_S (default 330 s). No network.
#
# Usage: OUT=/path/to/results bench/device_check.sh      (default OUT: bench/results/device)
# Env:   PYTHON (default: python, else python3), MAX_JOBS (16),
#        TORCH_CUDA_ARCH_LIST (default: setup.py's "8.0+PTX;9.0").
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/bench/results/device}"
mkdir -p "$OUT/bench"
LOG="$OUT/log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"
BUDGET="${DEVICE_CHECK_BUDGET_S:-330}"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif command -v python >/dev/null 2>&1; then
  PY=python
else
  PY=python3
fi
START=$SECONDS

note() { echo "$*" | tee -a "$LOG" >>"$SUMMARY"; }

# step NAME LIMIT_S KEEP_S -- CMD...: run CMD under timeout, never past the budget, leaving
# KEEP_S seconds of it for later steps. Output goes to the log (and to $STEP_OUT if set).
step() {
  local name=$1 limit=$2 keep=$3
  shift 4
  local left=$((BUDGET - (SECONDS - START) - keep))
  if ((left < 15)); then
    note "SKIP  $name: only ${left}s of the budget left"
    return 124
  fi
  ((limit > left)) && limit=$left
  echo "=== [$(date +%T)] $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS rc
  if [ -n "${STEP_OUT:-}" ]; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$STEP_OUT" >>"$LOG"
    rc=${PIPESTATUS[0]}
  else
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
  fi
  note "$(printf '%-5s %-22s rc=%-3s %4ss' "$([ "$rc" -eq 0 ] && echo OK || echo FAIL)" \
    "$name" "$rc" "$((SECONDS - t0))")"
  return "$rc"
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
note "canonical-kv device check on $(timeout 20 nvidia-smi --query-gpu=name,driver_version \
  --format=csv,noheader 2>/dev/null | head -1 || echo 'unknown GPU'); $("$PY" -c \
  'import torch; print("torch", torch.__version__)' 2>/dev/null)"

export CANONICAL_KV_BUILD_CUDA=1
export MAX_JOBS="${MAX_JOBS:-16}"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

failed=0
built=0
if step build 200 120 -- "$PY" -m pip install --no-build-isolation --no-deps -e .; then
  built=1
elif step build-inplace 160 120 -- "$PY" setup.py build_ext --inplace; then
  built=1
  note "      (pip install failed; using the in-place build)"
else
  failed=1
fi

if ((built)); then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  STEP_OUT="$OUT/kernels.txt" step kernel-image 60 100 -- "$PY" -c "
import torch, numpy as np
from canonical_ops import _extension
d = torch.cuda.current_device()
torch.ops.canonical._check_cuda_kernels(d)
p = np.array(torch.ops.canonical._kernel_properties(d)).reshape(-1, 6)
print(torch.cuda.get_device_name(d), 'cc', torch.cuda.get_device_capability(d))
for lanes, mb, regs, bps, sass, ptx in p:
    print(f'  kernel lanes={lanes:2d} min_blocks={mb} registers={regs:3d} blocks/SM={bps} sass={sass} ptx={ptx}')
" || failed=1
  [ -f "$OUT/kernels.txt" ] && sed 's/^/      /' "$OUT/kernels.txt" >>"$SUMMARY"

  if "$PY" -c "import vllm" >/dev/null 2>&1; then
    note "      vLLM importable: its CUDA worker test runs with the others"
  else
    note "      vLLM NOT importable here: the vLLM worker's CUDA test is skipped (not run)"
  fi
  # Only the files holding CUDA tests: the others may import what the device image lacks
  # (redis-py for the Redis tier's tests), and one collection error would stop the whole run.
  mapfile -t cuda_test_files < <(grep -rlE 'mark\.cuda' "$ROOT/tests" | sort)
  step tests-cuda 170 90 -- "$PY" -m pytest -q -m cuda "${cuda_test_files[@]}" \
    -p no:cacheprovider --continue-on-collection-errors \
    --maxfail=30 --junitxml="$OUT/cuda-tests.xml" -rs || failed=1
  if [ -f "$OUT/cuda-tests.xml" ]; then
    "$PY" - "$OUT/cuda-tests.xml" >>"$SUMMARY" 2>>"$LOG" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
groups = {
    "ops (reference, variants, ids)": "test_ops_cuda",
    "graph capture / replay": "graph",
    "OffloadWorker (streams, jobs)": "test_worker_cuda",
    "poll()/wait() vs busy compute": "compute_stream",
    "vLLM worker": "vllm_plugin",
    "shared region": "test_shared_region",
}
stats = {k: [0, 0, 0] for k in groups}
failures = []
for case in cases:
    name = case.get("classname", "") + "." + case.get("name", "")
    outcome = 2 if case.find("skipped") is not None else (
        1 if case.find("failure") is not None or case.find("error") is not None else 0)
    if outcome == 1:
        failures.append(name)
    for key, needle in groups.items():
        if needle in name:
            stats[key][outcome] += 1
for key, (ok, bad, skip) in stats.items():
    print(f"      {key:<32} passed {ok:3d}  failed {bad:3d}  skipped {skip:3d}")
for name in failures[:8]:
    print(f"      FAILED {name}")
EOF
  fi

  if command -v compute-sanitizer >/dev/null 2>&1; then
    STEP_OUT="$OUT/sanitizer.log" step memcheck 100 60 -- compute-sanitizer --tool memcheck \
      --error-exitcode 99 --report-api-errors no --leak-check no "$PY" -m pytest -q -x \
      -p no:cacheprovider -m cuda tests/test_ops_cuda.py -k "device_id or cuda_validation \
      or capture_and_replay_of_store or one_kernel_launch or large_call \
      or (random_cases_match_reference_pinned and 7)" || failed=1
    grep -E "ERROR SUMMARY|Invalid|out of bounds" "$OUT/sanitizer.log" | head -5 | sed 's/^/      /' \
      >>"$SUMMARY"
  else
    note "SKIP  memcheck: compute-sanitizer not on PATH"
  fi

  STEP_OUT="$OUT/kernel_variants.txt" step kernel-variants 75 30 -- "$PY" \
    bench/kernel_variants.py --out "$OUT" --repeats 15 --time-budget 55 || failed=1
  [ -f "$OUT/kernel_variants.txt" ] && grep -E "SMs: store best|DISAGREE|skipped" \
    "$OUT/kernel_variants.txt" | sed 's/^/      /' >>"$SUMMARY"

  left=$((BUDGET - (SECONDS - START)))
  # The benchmark stops starting new cases 20 s before its limit (JSON is written per case).
  step bench "$left" 0 -- "$PY" bench/bench_transfer.py --device cuda --quick \
    --sections fragments,sms --out "$OUT/bench" --time-budget $((left > 50 ? left - 20 : 30)) \
    --no-plots --build-dir "${TMPDIR:-/tmp}/canonical-kv-bench" || failed=1
  [ -f "$OUT/bench/bench_cuda.md" ] && grep -iE "goal|≥|canonical" "$OUT/bench/bench_cuda.md" \
    | head -6 | sed 's/^/      /' >>"$SUMMARY"
else
  note "SKIP  tests and benchmarks: the build failed (see $LOG)"
fi

note "total: $((SECONDS - START))s of ${BUDGET}s; results in $OUT"
ls -la "$OUT" "$OUT/bench" >>"$LOG" 2>&1
cat "$SUMMARY"
exit "$failed"
