#!/usr/bin/env bash
# Nsight Compute on the varlen (prefill) path, one H200 / H100 call (GPU machine only):
# builds the working tree with -lineinfo, profiles one Hopper-kernel launch of
# profile_prefill.py (1 x 8192, nhd) with the full section set and source counters, and the
# launch and rates of PyTorch SDPA's kernel on the same shape beside it. In $OUT: the
# report (pf_nhd.ncu-rep), its details page, its per-SASS-instruction page as gzipped CSV
# (benchmarks/ncu_source_summary.py reads it), and sdpa_ncu.txt.
#   OUT=... bash benchmarks/device_profile_prefill.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd); OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
ncu --version | tail -1
t0=$(date +%s)
timeout 300 python3 -m pip install --no-build-isolation --no-deps --target /tmp/pa "$REPO" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build -C "cmake.define.CMAKE_CUDA_FLAGS=-lineinfo" > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
cd /tmp
export PYTHONPATH=/tmp/pa:$REPO/benchmarks
t0=$(date +%s)
timeout 240 ncu --set full --import-source yes -k regex:prefill_sm90 -s 1 -c 1 -o "$OUT/pf_nhd" -f \
  python3 "$REPO/benchmarks/profile_prefill.py" pagedattn nhd 1x8192 > "$OUT/ncu_run.log" 2>&1; echo "ncu pf rc=$? $(( $(date +%s) - t0 )) s"
ncu -i "$OUT/pf_nhd.ncu-rep" --page details > "$OUT/pf_details.txt" 2>&1; echo "details rc=$?"
ncu -i "$OUT/pf_nhd.ncu-rep" --page source --csv --print-source sass > "$OUT/pf_source.csv" 2>&1 || \
  ncu -i "$OUT/pf_nhd.ncu-rep" --page source --csv > "$OUT/pf_source.csv" 2>&1; echo "source rc=$? $(wc -c < "$OUT/pf_source.csv")"
t0=$(date +%s)
timeout 150 ncu -k "regex:fmha|flash|sdpa|attn|Attention|fprop" -s 1 -c 1 --section LaunchStats --section SpeedOfLight \
  --section Occupancy --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  python3 "$REPO/benchmarks/profile_prefill.py" sdpa nhd 1x8192 > "$OUT/sdpa_ncu.txt" 2>&1; echo "ncu sdpa rc=$? $(( $(date +%s) - t0 )) s"
gzip -f "$OUT/pf_source.csv"
grep -E "Duration|Throughput|Registers|Block Size|Grid Size|Shared Memory|Issue Slots|Issued Ipc|Warp Cycles|No Eligible|Active Warps|Theoretical Occ|Achieved Occ|Function Name|prefill|sdpa|fmha|flash" "$OUT/pf_details.txt" | head -60
echo ====; grep -E "Duration|Throughput|Registers|Block Size|Grid Size|Shared Memory|Issue Slots|Issued Ipc|Warp Cycles|No Eligible|Active Warps|Theoretical Occ|Achieved Occ|  [a-z_]+.*\(|void|kernel" "$OUT/sdpa_ncu.txt" | head -60
