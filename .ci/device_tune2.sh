#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
for split in 1 0; do
  CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ timeout 240 python3 -m pip install --no-build-isolation --no-deps "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build-s$split \
    -C "cmake.define.CMAKE_CUDA_FLAGS=-DPAGEDATTN_NHD_SPLIT=$split" > "$OUT/build_$split.log" 2>&1 \
    || { echo "build $split failed"; tail -5 "$OUT/build_$split.log"; continue; }
  timeout 120 python3 "$REPO/.ci/tune_decode.py" "split$split" 2>&1 | tee -a "$OUT/tune.txt"
done
timeout 120 python3 "$REPO/.ci/tune_partition.py" 2>&1 | tee "$OUT/partition.txt"
