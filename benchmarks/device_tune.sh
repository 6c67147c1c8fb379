#!/usr/bin/env bash
# Builds the decode with several compile-time settings and times each in the same call.
#   PA_VARIANTS="base= w4s3=-DPAGEDATTN_MMA_STAGES=3" bash benchmarks/device_tune.sh
# (name=flags pairs, several flags joined by %; they go to CMAKE_CUDA_FLAGS). Logs in $OUT.
set -u
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
for v in ${PA_VARIANTS:-base= w4s3=-DPAGEDATTN_MMA_STAGES=3}; do
  name=${v%%=*}; flags=${v#*=}; flags=${flags//%/ }
  timeout 240 python3 -m pip install --no-build-isolation --no-deps "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build-$name \
    -C "cmake.define.CMAKE_CUDA_FLAGS=$flags" > "$OUT/build_$name.log" 2>&1 \
    || { echo "build $name failed"; tail -5 "$OUT/build_$name.log"; continue; }
  for rep in $(seq ${PA_TUNE_REPS:-2}); do
    timeout 120 python3 "$REPO/benchmarks/tune_decode.py" "$name" 2>&1 | tee -a "$OUT/tune.txt"
  done
done
