set -u; R=$(pwd); export PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 400 python3 -m pip install --no-build-isolation --no-deps --target /tmp/ab-new . -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/ab-build-new > $OUT/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s"
cd /tmp; export PYTHONPATH=/tmp/ab-new:$R/benchmarks
timeout 150 python3 $R/benchmarks/fp8_ab.py --sweep --nps=1,2,3,4,6 2>&1 | tee $OUT/fp8_sweep.txt
G=40x4096,48x4096,56x4096,64x4096,80x4096,96x4096,112x4096,64x2048,96x2048,128x2048,160x2048,24x8192,32x8192,48x8192
for L in vllm nhd; do timeout 200 python3 $R/benchmarks/plan_sweep.py --grid=$G --layout=$L --nps=1,2,3,4 2>&1 | tee -a $OUT/plan_sweep.txt; done
echo "total $(( $(date +%s) - t0 )) s"
