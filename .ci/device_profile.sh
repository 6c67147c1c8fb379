#!/usr/bin/env bash
# Profiles the decode kernel with Nsight Compute (clocks left alone). Logs in $OUT.
set -u
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ timeout 300 python3 -m pip install --no-build-isolation --no-deps "$REPO" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
for layout in vllm nhd; do
  timeout 200 ncu --clock-control none -k regex:decode -s 2 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    python3 "$REPO/.ci/profile_decode.py" $layout 32 16384 > "$OUT/ncu_$layout.txt" 2>&1
  echo "ncu $layout rc=$?"
done
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Configuration|Dynamic Shared|Block Limit|Warp Cycles Per Issued|Issued Warp|No Eligible|Stall|Grid Size|Waves" "$OUT"/ncu_*.txt
