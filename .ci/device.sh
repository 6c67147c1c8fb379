#!/usr/bin/env bash
# One call on the GPU machine: build + install pagedattn, run the tests, sanitizers on
# a sample, the kernel benchmark. Stages are chosen by arguments (default: all but
# flashinfer); logs and JSON land in $OUT.
#   bash .ci/device.sh build test sanitize bench        (bench-fi: with FlashInfer)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
stages=${*:-build test sanitize bench}
has() { [[ " $stages " == *" $1 "* ]]; }
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
note "gpu: $(tail -1 "$OUT/gpu.txt") commit: $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo none)"

if has build; then
  t0=$(date +%s)
  timeout 300 python3 -m pip install --no-build-isolation --no-deps -v "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$OUT/build.log" 2>&1
  rc=$?
  note "build: rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
fi
python3 -c "import pagedattn, torch; print('pagedattn', pagedattn.__version__, 'cuda', pagedattn._core.with_cuda, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$summary"

if has test; then
  t0=$(date +%s)
  (cd /tmp && timeout ${PA_TEST_TIMEOUT:-240} python3 -m pytest "$REPO/tests/python" -q -ra -p no:cacheprovider --maxfail=40 \
     -k "${PA_TEST_K:-}" > "$OUT/tests.log" 2>&1)
  note "tests: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30 | tee -a "$summary"
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    (cd /tmp && timeout ${PA_SAN_TIMEOUT:-100} compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
       python3 "$REPO/.ci/sanitize_sample.py" $tool > "$OUT/sanitize_$tool.log" 2>&1)
    note "sanitize $tool: rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sample ok' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi

if has bench || has bench-fi; then
  fi_flag=--no-flashinfer
  if has bench-fi; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl > "$OUT/fi_install.log" 2>&1
    export PYTHONPATH=/tmp/site
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$OUT/fi_install.log" 2>&1
    note "flashinfer: $(tail -1 "$OUT/fi_install.log")"
    fi_flag=""
  fi
  t0=$(date +%s)
  (cd /tmp && timeout ${PA_BENCH_TIMEOUT:-300} python3 -m pagedattn.bench.kernels $fi_flag ${PA_BENCH_ARGS:-} \
     --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1)
  note "bench: rc=$? in $(( $(date +%s) - t0 )) s"
  sed -n '/^Device:/,$p' "$OUT/bench.log" >> "$summary"
fi
echo "==== summary"; cat "$summary"
