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
  # The image's default g++ builds modules whose C++ exceptions crash the process; the
  # system compiler does not (see PERF_NOTES.md), so use it when present.
  cxx=(); [ -x /usr/bin/g++ ] && cxx=(env CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++)
  timeout 300 "${cxx[@]}" python3 -m pip install --no-build-isolation --no-deps -v "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$OUT/build.log" 2>&1
  rc=$?
  note "build: rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
fi
python3 -c "import pagedattn, torch; print('pagedattn', pagedattn.__version__, 'cuda', pagedattn._core.with_cuda, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$summary"

if has bench-fi; then  # FlashInfer: install the carried wheels, JIT-compile in the background
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl > "$OUT/fi_install.log" 2>&1
  export PYTHONPATH=/tmp/site
  (cd /tmp && timeout 420 python3 "$REPO/.ci/fi_warm.py" > "$OUT/fi_warm.log" 2>&1) &
  fi_pid=$!
fi

exc_ok() {  # does a C++ exception reach Python?
  (cd /tmp && timeout 30 python3 -X faulthandler -c "
import pagedattn
try:
    pagedattn.kv_cache_shape(-1, 16, 1, 64, 'float16')
except ValueError as e:
    print('exception ok:', e)" >> "$OUT/exc.log" 2>&1)
  local rc=$?
  note "exception test [$1]: rc=$rc $(grep -E 'exception ok|Fatal' "$OUT/exc.log" | tail -1)"
  return $rc
}
if has exc; then
  so=$(python3 -c "import pagedattn, os; print(os.path.dirname(pagedattn.__file__))")
  { ldd "$so"/_core*.so; ldd "$so"/lib/libpagedattn.so*; ls /opt/gcc/lib64 2>&1 | head; which -a g++ gcc; } > "$OUT/ldd.log" 2>&1
  if ! exc_ok "as built"; then
    gl=$(ls -d /opt/gcc/lib64 2>/dev/null)
    if [ -n "$gl" ]; then export LD_LIBRARY_PATH="$gl:${LD_LIBRARY_PATH:-}"; fi
    if ! exc_ok "LD_LIBRARY_PATH=$gl"; then
      if [ -x /usr/bin/g++ ]; then
        timeout 200 env CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ python3 -m pip install --no-build-isolation --no-deps -v "$REPO" \
          -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build2 > "$OUT/build2.log" 2>&1
        note "rebuild with /usr/bin/g++: rc=$?"
        exc_ok "built with /usr/bin/g++"
      fi
    fi
  fi
fi

if has diag; then
  (cd /tmp && timeout 120 python3 -X faulthandler "$REPO/.ci/sanitize_sample.py" > "$OUT/diag.log" 2>&1)
  note "diag sample: rc=$? $(tail -3 "$OUT/diag.log" | tr '\n' ' ' | cut -c1-400)"
fi

if has test; then
  t0=$(date +%s)
  (cd /tmp && ln -sfn "$REPO/tests" /tmp/tests && timeout ${PA_TEST_TIMEOUT:-240} python3 -X faulthandler -m pytest ${PA_TESTS:-tests/python} -q -ra \
     -p no:cacheprovider --maxfail=40 -k "${PA_TEST_K:-}" > "$OUT/tests.log" 2>&1)
  note "tests: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30 | tee -a "$summary"
fi

if has sanitize; then
  for tool in memcheck racecheck initcheck; do
    t0=$(date +%s)
    (cd /tmp && timeout ${PA_SAN_TIMEOUT:-100} compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
       python3 "$REPO/.ci/sanitize_sample.py" $tool > "$OUT/sanitize_$tool.log" 2>&1)
    note "sanitize $tool: rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sample ok|Error' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi

if has bench || has bench-fi; then
  fi_flag=--no-flashinfer
  if has bench-fi; then
    wait $fi_pid
    note "flashinfer warm-up: rc=$? $(tail -2 "$OUT/fi_warm.log" | tr '\n' ' ' | cut -c1-300)"
    fi_flag=""
  fi
  t0=$(date +%s)
  (cd /tmp && timeout ${PA_BENCH_TIMEOUT:-300} python3 -m pagedattn.bench.kernels $fi_flag ${PA_BENCH_ARGS:-} \
     --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1)
  note "bench: rc=$? in $(( $(date +%s) - t0 )) s"
  sed -n '/^Device:/,$p' "$OUT/bench.log" >> "$summary"
fi
if has host; then
  (cd /tmp && timeout 90 python3 -m pagedattn.bench.host_cost > "$OUT/host_cost.log" 2>&1)
  note "host cost: rc=$? $(tr '\n' ';' < "$OUT/host_cost.log" | tr -s ' ')"
fi

if has cli; then  # the user-facing commands on the GPU
  (cd /tmp && timeout 120 python3 -m pagedattn --device cuda > "$OUT/serve.log" 2>&1)
  note "python -m pagedattn (GPU): rc=$? $(grep -E '^served|^checked' "$OUT/serve.log" | tr '\n' ' ')"
  (cd /tmp && timeout 200 python3 -m pagedattn bench --quick --no-flashinfer --json "$OUT/bench_cli.json" \
     --plot "$OUT/bench_cli.png" > "$OUT/bench_cli.log" 2>&1)
  note "python -m pagedattn bench --quick --plot: rc=$? $(tail -2 "$OUT/bench_cli.log" | tr '\n' ' ' | cut -c1-300)"
fi

if has bm; then  # the block-manager tests alone, for a crash trace
  (cd /tmp && timeout 60 python3 -X faulthandler -m pytest "$REPO/tests/python/test_block_manager.py" -q -x \
     -p no:cacheprovider > "$OUT/tests_bm.log" 2>&1)
  note "block-manager tests: rc=$? $(grep -m3 -E 'File .*pagedattn|Fatal|passed|failed' "$OUT/tests_bm.log" | tr '\n' ' ' | cut -c1-400)"
fi
# at most 8 files come back: keep summary + JSON, pack the logs
(cd "$OUT" && tar czf /tmp/pa-logs.tar.gz --exclude=summary.txt --exclude=bench.json . && \
  find . -maxdepth 1 -type f ! -name summary.txt ! -name bench.json -delete && mv /tmp/pa-logs.tar.gz logs.tar.gz)
echo "==== summary"; cat "$summary"
