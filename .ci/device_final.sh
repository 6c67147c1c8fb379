#!/usr/bin/env bash
# One GPU-machine call: build with the system compiler, run the whole test suite on
# the GPU (tests that need no GPU included), the serving demo with CuPy and with torch,
# and the host-cost benchmark. Logs land in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ timeout 300 python3 -m pip install --no-build-isolation --no-deps -v "$REPO" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 )) s"
python3 -c "import pagedattn; print('cuda build:', pagedattn.built_with_cuda())"
ln -sfn "$REPO/tests" /tmp/tests
t0=$(date +%s)
timeout ${PA_TEST_TIMEOUT:-330} python3 -X faulthandler -m pytest tests/python -q -ra -p no:cacheprovider \
  --maxfail=30 --ignore=tests/python/test_fuzz_api.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
for lib in cupy torch; do
  timeout 90 python3 -m pagedattn --device cuda --gpu-lib $lib > "$OUT/serve_$lib.log" 2>&1
  echo "serve $lib rc=$?"; tail -14 "$OUT/serve_$lib.log"
done
timeout 60 python3 -m pagedattn.bench.host_cost > "$OUT/host_cost.log" 2>&1; echo "host_cost rc=$?"; cat "$OUT/host_cost.log"
