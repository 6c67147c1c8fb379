#!/usr/bin/env bash
# Profiles the decode kernels with Nsight Compute (clocks left alone). Logs in $OUT.
#   PA_PROFILE="vllm:32:16384 vllm:1:16384" bash benchmarks/device_profile.sh
#   PA_NCU_EXTRA="--section MemoryWorkloadAnalysis_Tables" PA_NCU_METRICS="dram__bytes_read.sum,..." add to it
set -u
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
timeout 300 python3 -m pip install --no-build-isolation --no-deps "$REPO" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
for spec in ${PA_PROFILE:-vllm:32:16384 nhd:32:16384}; do
  IFS=: read -r layout batch ctx <<< "$spec"
  f="$OUT/ncu_${layout}_b${batch}_c${ctx}.txt"
  timeout 200 ncu --clock-control none -k regex:decode_mma -s 1 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio${PA_NCU_METRICS:+,$PA_NCU_METRICS}" \
    ${PA_NCU_EXTRA:-} \
    python3 "$REPO/benchmarks/profile_decode.py" $layout $batch $ctx > "$f" 2>&1
  echo "ncu $spec rc=$?"
  # every kernel's duration (decode + reduce) of the same calls
  timeout 100 ncu --clock-control none -k regex:decode --metrics gpu__time_duration.sum \
    python3 "$REPO/benchmarks/profile_decode.py" $layout $batch $ctx 2>&1 | grep -E "decode_|gpu__time_duration" | tail -4 >> "$f"
done
for f in "$OUT"/ncu_*.txt; do
  echo "== $f"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Warp|No Eligible|Grid Size|Waves|issue_stalled|gpu__time|decode_" "$f" \
    | grep -vE " 0$| 0\.0[0-9]*$" | sed 's/  */ /g'
done
