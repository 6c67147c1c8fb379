#!/usr/bin/env bash
# Builds the decode with several (warps, stages) settings and times each. Logs in $OUT.
set -u
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
for cfg in ${PA_TUNE:-4x3 4x2 2x4 8x2}; do
  w=${cfg%x*}; st=${cfg#*x}
  CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ timeout 240 python3 -m pip install --no-build-isolation --no-deps "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build-$cfg \
    -C "cmake.define.CMAKE_CUDA_FLAGS=-DPAGEDATTN_MMA_WARPS=$w -DPAGEDATTN_MMA_STAGES=$st" > "$OUT/build_$cfg.log" 2>&1 \
    || { echo "build $cfg failed"; tail -5 "$OUT/build_$cfg.log"; continue; }
  timeout 120 python3 "$REPO/.ci/tune_decode.py" "w$w-s$st" 2>&1 | tee -a "$OUT/tune.txt"
done
