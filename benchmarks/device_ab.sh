#!/usr/bin/env bash
# A/B round on the GPU machine: builds the working tree ("new") and a second source tree
# ("base", PA_AB_BASE, default .ab/base) side by side, runs the GPU decode tests on "new",
# then times every benchmark shape with each build in turn (base, new, base, new) and the
# planner sweep with "new"; the "host" stage runs the host-cost script with each build in
# turn, PA_HOST_ROUNDS times (default 3). Results in $OUT/ab.txt.
#   PA_AB_BASE=.ab/base PA_AB_STAGES="test sanitize ab sweep host" bash benchmarks/device_ab.sh
#   PA_AB_EXTRA="w8=-DPAGEDATTN_MMA_WARPS=8" PA_AB_RUNS="base=base w8=w8" bash benchmarks/device_ab.sh
# PA_AB_SCRIPT names the timing script of the "ab" stage (default ab_time.py; fp8_ab.py times
# the fp8 decode shapes).
# The "prefill" stage times prefill_bench.py --pagedattn-only ($PA_PREFILL_ARGS) with each
# build of PA_PREFILL_BUILDS (default "base new") in turn, twice, and prints the ratios.
# PA_AB_TREES="name=path[@flags]" adds builds of other source trees. The "trace" stage runs
# trace_decode.py with each build of PA_TRACE_BUILDS (builds with -DPAGEDATTN_TRACE;
# PA_AB_NEW_FLAGS gives the working tree's "new" build its flags).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pa-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE=$(cd "$REPO/${PA_AB_BASE:-.ab/base}" && pwd)
stages=${PA_AB_STAGES:-test ab sweep}
has() { [[ " $stages " == *" $1 "* ]]; }
S="$OUT/ab.txt"; : > "$S"
note() { echo "$*" | tee -a "$S"; }
note "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader) date: $(date -u +%F)"
build() {  # name, source[, CUDA flags]
  timeout 400 python3 -m pip install --no-build-isolation --no-deps \
    --target "/tmp/ab-$1" "$2" -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir="/tmp/ab-build-$1" \
    ${3:+-C "cmake.define.CMAKE_CUDA_FLAGS=$3"} > "$OUT/build_$1.log" 2>&1
  echo "build $1: rc=$?"
}
rm -f /tmp/ab-*.rc  # a warm machine keeps the last call's
t0=$(date +%s)
# PA_AB_NEW_FLAGS: CUDA flags of the "new" build itself (% for a space), e.g. -DPAGEDATTN_TRACE
# when the call only traces: no build of the tree without them is wasted then
f=${PA_AB_NEW_FLAGS:-}; build new "$REPO" "${f//%/ }" > /tmp/ab-new.rc &
if has host || { has prefill && [[ " ${PA_PREFILL_BUILDS:-base} " == *base* ]]; } || { has ab && [[ " ${PA_AB_RUNS:-=base} " == *=base* ]]; }; then build base "$BASE" > /tmp/ab-base.rc & fi
# PA_AB_EXTRA: more builds of the working tree with compile-time flags, "name=flag%flag ..."
for v in ${PA_AB_EXTRA:-}; do
  n=${v%%=*}; f=${v#*=}; build "$n" "$REPO" "${f//%/ }" > "/tmp/ab-$n.rc" &
done
# PA_AB_TREES: more builds of other source trees, "name=path[@flag%flag] ..." (paths relative
# to the repository; the flags, if any, as PA_AB_EXTRA's)
for v in ${PA_AB_TREES:-}; do
  n=${v%%=*}; rest=${v#*=}; f=""; [[ $rest == *@* ]] && f=${rest#*@}
  build "$n" "$REPO/${rest%%@*}" "${f//%/ }" > "/tmp/ab-$n.rc" &
done
wait
note "$(cat /tmp/ab-*.rc | tr '\n' ' ') in $(( $(date +%s) - t0 )) s"
grep -q "rc=0" /tmp/ab-new.rc || { tail -30 "$OUT/build_new.log"; exit 1; }
cd /tmp
if has test; then
  t0=$(date +%s)
  ln -sfn "$REPO/tests" /tmp/tests
  PYTHONPATH=/tmp/ab-new timeout ${PA_TEST_TIMEOUT:-200} python3 -m pytest ${PA_TESTS:-tests/python/test_cuda_decode.py} \
    -q -p no:cacheprovider --maxfail=20 > "$OUT/tests.log" 2>&1
  note "tests: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10 | tee -a "$S"
fi
if has sanitize; then  # compute-sanitizer on the kernel sample, "new" build
  for tool in memcheck racecheck; do
    PYTHONPATH=/tmp/ab-new timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
      python3 "$REPO/benchmarks/sanitize_sample.py" $tool > "$OUT/sanitize_$tool.log" 2>&1
    note "sanitize $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sample ok' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi
if has ab; then
  # PA_AB_RUNS: tag=build[+ENV=value], timed in turn, twice
  runs=${PA_AB_RUNS:-base=base new=new}
  for round in 1 2; do
    for r in $runs; do
      tag=${r%%=*}; spec=${r#*=}; b=${spec%%+*}; envs=(); [[ $spec == *+* ]] && envs=(${spec#*+})
      env "${envs[@]}" PYTHONPATH=/tmp/ab-$b:$REPO/benchmarks timeout 300 python3 "$REPO/benchmarks/${PA_AB_SCRIPT:-ab_time.py}" "$tag$round" \
        ${PA_AB_ARGS:-} >> "$S" 2>&1
    done
  done
  python3 - "$S" $(for r in $runs; do echo ${r%%=*}; done) <<'PY' | tee -a "$S"
import collections, statistics, sys
tags = sys.argv[2:]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 4 and f[1] != "host:" and f[-1] == "us" and f[0][:-1] in tags:
        t[" ".join(f[1:-2])][f[0][:-1]].append(float(f[-2]))
print(f"{'shape':22s} " + " ".join(f"{x:>9s}" for x in tags) + "   " + " ".join(f"{x}/{tags[0]}" for x in tags[1:]))
for k, v in t.items():
    m = [statistics.mean(v[x]) if v[x] else float("nan") for x in tags]
    print(f"{k:22s} " + " ".join(f"{x:9.2f}" for x in m) + "   " + " ".join(f"{x / m[0]:.3f}" for x in m[1:]))
PY
fi
if has prefill; then  # the varlen benchmark (pagedattn alone) with each build in turn, twice
  # PA_PREFILL_BUILDS: builds, or tag=build[+ENV=value] as PA_AB_RUNS (one build under two
  # settings of a run-time switch); the first is the reference of the ratios
  pbuilds=${PA_PREFILL_BUILDS:-base new}; ptags=""
  for round in 1 2; do
    for r in $pbuilds; do
      tag=${r%%=*}; spec=${r#*=}; b=${spec%%+*}; envs=""; [[ $spec == *+* ]] && envs=${spec#*+}
      [ $round = 1 ] && ptags="$ptags $tag"
      env ${envs//+/ } PYTHONPATH=/tmp/ab-$b timeout 200 python3 "$REPO/benchmarks/prefill_bench.py" --pagedattn-only \
        ${PA_PREFILL_ARGS:-} --json "/tmp/prefill_$tag$round.json" > "$OUT/prefill_$tag$round.log" 2>&1
      note "prefill $tag$round: rc=$?"
    done
  done
  python3 - $ptags <<'PY' | tee -a "$S"
import json, statistics, sys
bs = sys.argv[1:]
runs = {f"{b}{r}": json.load(open(f"/tmp/prefill_{b}{r}.json")) for b in bs for r in (1, 2)}
print(f"{'varlen shape (us, two rounds each)':58s} {'layout':6s} " + " ".join(f"{b:>15s}" for b in bs) + "  "
      + " ".join(f"{b}/{bs[0]}" for b in bs[1:]))
for i, row in enumerate(runs[f"{bs[0]}1"]["rows"]):
    for lay in ("vllm", "nhd"):
        k = f"pagedattn_{lay}"
        v = {b: [runs[f"{b}{r}"]["rows"][i][k] for r in (1, 2)] for b in bs}
        print(f"{row['shape'][:58]:58s} {lay:6s} " + " ".join(f"{v[b][0]:7.1f} {v[b][1]:7.1f}" for b in bs) + "  "
              + " ".join(f"{statistics.mean(v[b]) / statistics.mean(v[bs[0]]):.3f}" for b in bs[1:]))
PY
fi
if has host; then  # host cost per call: the same script with each build in turn, on one machine
  # host_ab.py takes only keywords both builds know, so any two builds compare.
  for round in $(seq "${PA_HOST_ROUNDS:-3}"); do
    for b in base new; do
      PYTHONPATH=/tmp/ab-$b timeout 120 python3 "$REPO/benchmarks/host_ab.py" "$b$round" >> "$S" 2>&1
    done
  done
  python3 - "$S" <<'PY' | tee -a "$S"
import collections, statistics, sys
t = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) > 4 and f[1] == "host:" and f[-1] == "us" and f[0][:-1] in ("base", "new"):
        t[" ".join(f[2:-2])][f[0][:-1]].append(float(f[-2]))
print(f"{'host cost (median over rounds, us)':60s} {'base':>7s} {'new':>7s}")
for k, v in t.items():
    print(f"{k:60s} {statistics.median(v['base']):7.2f} {statistics.median(v['new']):7.2f}")
PY
fi
if has trace; then  # trace_decode.py ($PA_TRACE_ARGS) with each build of PA_TRACE_BUILDS in turn,
  # twice: builds with -DPAGEDATTN_TRACE, e.g. PA_AB_NEW_FLAGS=-DPAGEDATTN_TRACE for this tree
  # a % in PA_TRACE_ARGS stands for a space inside one argument: --shapes=b1%x1024,b1%x4096
  targs=(); for a in ${PA_TRACE_ARGS:-}; do targs+=("${a//%/ }"); done
  for round in 1 2; do
    for b in ${PA_TRACE_BUILDS:-new}; do
      note "==== trace $b$round"
      PYTHONPATH=/tmp/ab-$b:$REPO/benchmarks timeout 200 python3 "$REPO/benchmarks/trace_decode.py" \
        ${targs[@]+"${targs[@]}"} >> "$S" 2>&1
      note "trace $b$round: rc=$?"
    done
  done
fi
if has sweep; then
  PYTHONPATH=/tmp/ab-new:$REPO/benchmarks timeout 300 python3 "$REPO/benchmarks/plan_sweep.py" ${PA_SWEEP_ARGS:-} >> "$S" 2>&1
  note "sweep: rc=$?"
fi
echo "==== ab"; cat "$S"
