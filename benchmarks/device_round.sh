#!/usr/bin/env bash
# One round on the GPU machine, in one call: FlashInfer's JIT warms up in the background
# while pagedattn builds and the GPU tests run; then the sanitizers on the kernel sample,
# host cost, the small-shape sweep (with and without programmatic dependent launch), the
# full benchmark with FlashInfer and the user-facing commands. Stages are chosen with
# PA_ROUND; everything lands in $OUT (at most 8 files).
#   PA_TESTS="tests/python/..." PA_ROUND="build test sanitize host small bench prefill scripts cli" \
#     bash benchmarks/device_round.sh
# `prefill` runs prefill_bench.py (FlashInfer's prefill modules compile in the background
# from the start of the round); `scripts` runs each benchmark script named in PA_SCRIPTS
# ("name.py [args]" separated by ";"), each with --json into $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
round=${PA_ROUND:-build test sanitize host small bench}
has() { [[ " $round " == *" $1 "* ]]; }
S="$OUT/round.txt"; : > "$S"
LOGS=/tmp/pa-round-logs; mkdir -p "$LOGS"
note() { echo "$*" | tee -a "$S"; }
note "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) commit: $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null) date: $(date -u +%F)"

fi_pid= fi_rc=
fi_wait() {  # waits once for the FlashInfer warm-up, keeps its exit status
  if [ -n "$fi_pid" ] && [ -z "$fi_rc" ]; then wait "$fi_pid"; fi_rc=$?; fi
}
if has bench && ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl/*.whl > "$LOGS/fi_install.log" 2>&1
  (cd /tmp && PYTHONPATH=/tmp/site timeout 400 python3 "$REPO/benchmarks/fi_warm.py" > "$LOGS/fi_warm.log" 2>&1) &
  fi_pid=$!
fi
fp_pid=
if has prefill && ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
  [ -d /tmp/site/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$REPO"/.whl/*.whl > "$LOGS/fi_install.log" 2>&1
  (cd /tmp && PYTHONPATH=/tmp/site timeout 520 python3 "$REPO/benchmarks/fi_prefill_warm.py" > "$LOGS/fi_prefill_warm.log" 2>&1) &
  fp_pid=$!
fi

if has build; then
  t0=$(date +%s)
  # The machine's own compiler environment, as a user's install gets it.
  timeout 300 python3 -m pip install --no-build-isolation --no-deps -v "$REPO" \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/pa-build > "$LOGS/build.log" 2>&1
  rc=$?
  note "build: rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc -ne 0 ]; then tail -40 "$LOGS/build.log" | tee -a "$S"; exit 1; fi
fi

if has test; then
  t0=$(date +%s)
  (cd /tmp && ln -sfn "$REPO/tests" /tmp/tests && timeout ${PA_TEST_TIMEOUT:-240} python3 -X faulthandler -m pytest \
     ${PA_TESTS:-tests/python} -q -ra -p no:cacheprovider --maxfail=30 > "$LOGS/tests.log" 2>&1)
  note "tests: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$LOGS/tests.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -20 | tee -a "$S"
fi

if has sanitize; then
  for tool in ${PA_SAN_TOOLS:-memcheck racecheck initcheck}; do
    t0=$(date +%s)
    (cd /tmp && timeout ${PA_SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
       python3 "$REPO/benchmarks/sanitize_sample.py" $tool > "$LOGS/sanitize_$tool.log" 2>&1)
    note "sanitize $tool: rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sample ok' "$LOGS/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi

if has host; then
  # Host timings need quiet CPUs: let FlashInfer's JIT compile (many processes) finish first.
  fi_wait
  (cd /tmp && timeout 90 python3 -m pagedattn.bench.host_cost > "$LOGS/host_cost.log" 2>&1)
  note "host cost: rc=$?"; cat "$LOGS/host_cost.log" >> "$S"
fi

if has small; then
  (cd /tmp && timeout 200 python3 "$REPO/benchmarks/small_shapes.py" ${PA_SMALL_ARGS:-} pdl > "$LOGS/small.log" 2>&1
   PAGEDATTN_NO_PDL=1 timeout 60 python3 "$REPO/benchmarks/small_shapes.py" --quick no-pdl >> "$LOGS/small.log" 2>&1)
  note "small shapes: rc=$?"; cat "$LOGS/small.log" >> "$S"
fi

if has bench; then
  fi_flag=--no-flashinfer
  if [ -n "$fi_pid" ]; then
    fi_wait
    note "flashinfer warm-up: rc=$fi_rc $(tail -1 "$LOGS/fi_warm.log" | cut -c1-200)"
    fi_flag=""
  fi
  t0=$(date +%s)
  (cd /tmp && PYTHONPATH=/tmp/site timeout ${PA_BENCH_TIMEOUT:-240} python3 -m pagedattn.bench.kernels $fi_flag \
     ${PA_BENCH_ARGS:-} --json "$OUT/bench.json" > "$LOGS/bench.log" 2>&1)
  note "bench: rc=$? in $(( $(date +%s) - t0 )) s"
  sed -n '/^Device:/,$p' "$LOGS/bench.log" >> "$S"
fi
if has prefill; then
  [ -n "$fp_pid" ] && wait "$fp_pid" && note "$(cat "$LOGS/fi_prefill_warm.log" | tr '\n' ';' | cut -c1-400)"
  t0=$(date +%s)
  (cd /tmp && PYTHONPATH=/tmp/site timeout ${PA_PREFILL_TIMEOUT:-240} python3 "$REPO/benchmarks/prefill_bench.py" \
     --json "$OUT/prefill.json" > "$LOGS/prefill.log" 2>&1)
  note "prefill bench: rc=$? in $(( $(date +%s) - t0 )) s"; cat "$LOGS/prefill.log" >> "$S"
fi

if has scripts; then
  IFS=';' read -ra scripts <<< "${PA_SCRIPTS:-}"
  for line in "${scripts[@]}"; do
    read -ra words <<< "$line"; [ ${#words[@]} -gt 0 ] || continue
    name=$(basename "${words[0]}" .py); t0=$(date +%s)
    (cd /tmp && PYTHONPATH=/tmp/site timeout ${PA_SCRIPT_TIMEOUT:-180} python3 "$REPO/benchmarks/${words[0]}" \
       "${words[@]:1}" --json "$OUT/$name.json" > "$LOGS/$name.log" 2>&1)
    note "$name: rc=$? in $(( $(date +%s) - t0 )) s"; tail -40 "$LOGS/$name.log" >> "$S"
  done
fi

if has cli; then  # the user-facing commands on the GPU
  (cd /tmp && timeout 120 python3 -m pagedattn --device cuda > "$LOGS/serve.log" 2>&1)
  note "python -m pagedattn --device cuda: rc=$? $(grep -E '^served|^checked' "$LOGS/serve.log" | tr '\n' ' ')"
  (cd /tmp && timeout 200 python3 -m pagedattn bench --quick --no-flashinfer --json "$LOGS/bench_cli.json" \
     --plot "$LOGS/bench_cli.png" > "$LOGS/bench_cli.log" 2>&1)
  note "python -m pagedattn bench --quick --plot: rc=$? $(tail -2 "$LOGS/bench_cli.log" | tr '\n' ' ' | cut -c1-300)"
fi
tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
echo "==== round"; cat "$S"
