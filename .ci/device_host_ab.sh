#!/usr/bin/env bash
# Host-cost A/B on the GPU machine: builds the working tree ("new") and a second source
# tree ("base", PA_AB_BASE, default .ab/base) side by side, optionally runs the GPU tests
# on "new" (PA_HOST_TESTS), then runs the host-cost script with each build in turn,
# PA_HOST_ROUNDS times (default 3), on the same machine. Results in $OUT/host_ab.txt.
#   PA_HOST_TESTS="tests/python" bash .ci/device_host_ab.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE=$(cd "$REPO/${PA_AB_BASE:-.ab/base}" && pwd)
S="$OUT/host_ab.txt"; : > "$S"
note() { echo "$*" | tee -a "$S"; }
note "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader) date: $(date -u +%F)"
build() {  # name, source
  CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ timeout 400 python3 -m pip install --no-build-isolation --no-deps \
    --target "/tmp/hab-$1" "$2" -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir="/tmp/hab-build-$1" \
    > "$OUT/build_$1.log" 2>&1
  echo "build $1: rc=$?"
}
build new "$REPO" > /tmp/hab-new.rc &
build base "$BASE" > /tmp/hab-base.rc &
wait
note "$(cat /tmp/hab-*.rc | tr '\n' ' ')"
grep -q "rc=0" /tmp/hab-new.rc && grep -q "rc=0" /tmp/hab-base.rc || exit 1
cd /tmp
if [ -n "${PA_HOST_TESTS:-}" ]; then
  ln -sfn "$REPO/tests" /tmp/tests
  PYTHONPATH=/tmp/hab-new timeout 300 python3 -m pytest $PA_HOST_TESTS -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
  note "tests: rc=$? $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10 | tee -a "$S"
fi
cp "$REPO/python/pagedattn/bench/host_cost.py" /tmp/hab_host_cost.py  # the same script for both builds
for round in $(seq "${PA_HOST_ROUNDS:-3}"); do
  for b in base new; do
    PYTHONPATH=/tmp/hab-$b timeout 120 python3 /tmp/hab_host_cost.py | sed "s/^/$b$round  /" >> "$S"
  done
done
python3 - "$S" <<'PY' | tee -a "$S"
import collections, statistics, sys
t = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) > 3 and f[-1] == "us/call" and f[0][:-1] in ("base", "new"):
        t[" ".join(f[1:-2])][f[0][:-1]].append(float(f[-2]))
print(f"{'call (median over rounds, us)':60s} {'base':>7s} {'new':>7s}")
for k, v in t.items():
    b, n = statistics.median(v["base"]), statistics.median(v["new"])
    print(f"{k:60s} {b:7.2f} {n:7.2f}")
PY
