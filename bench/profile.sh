#!/usr/bin/env bash
# Run one bench_transfer.py case under Nsight Systems; every measured call is an NVTX range
# named "<method>_<store|load> | <case>" (warm-ups: "warmup ...").
#
# Usage: bench/profile.sh [CASE] [extra bench_transfer.py args...]
#   CASE  a fragment-sweep case (substring match), default "split NHD TP8"; others e.g.
#         "packed NHD TP8", "split HND TP8", "MLA 576", "dense ref 256 B"
#   OUT   output folder (default bench/results/profile); NSYS: path to nsys (default: PATH)
# Example: bench/profile.sh "packed NHD TP8" --device cuda --repeats 3
# Without nsys the case still runs (unprofiled) and the script says so.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CASE="${1:-split NHD TP8}"
[ $# -gt 0 ] && shift
OUT="${OUT:-$ROOT/bench/results/profile}"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
SLUG="$(printf '%s' "$CASE" | tr -c 'A-Za-z0-9' '_')"
mkdir -p "$OUT/$SLUG"
ARGS=(bench/bench_transfer.py --quick --only "$CASE" --sections fragments --no-verify
  --no-plots --out "$OUT/$SLUG" "$@")

NSYS="${NSYS:-$(command -v nsys || true)}"
if [ -z "$NSYS" ]; then
  echo "profile.sh: nsys not found (install Nsight Systems or set NSYS=/path/to/nsys);" \
    "running '$CASE' without a profiler"
  "$PY" "${ARGS[@]}"
  echo "profile.sh: no report (nsys missing); results in $OUT/$SLUG"
  exit 0
fi

REPORT="$OUT/canonical_$SLUG"
"$NSYS" profile --trace=cuda,nvtx,osrt --sample=none --cpuctxsw=none --force-overwrite=true \
  --output="$REPORT" "$PY" "${ARGS[@]}"
for ext in nsys-rep qdrep; do
  if [ -f "$REPORT.$ext" ]; then
    echo "profile.sh: nsys report: $REPORT.$ext"
    echo "  summary: $NSYS stats --report nvtx_sum,cuda_gpu_kern_sum $REPORT.$ext"
    exit 0
  fi
done
echo "profile.sh: nsys ran but no report appeared at $REPORT.nsys-rep" >&2
exit 1
