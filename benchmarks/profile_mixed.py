"""Where a mixed step's time goes on the GPU: each kernel of one `paged_attention` call
(the varlen kernel for the chunks, the decode kernels for the one-row sequences, a reduce
kernel if the plan has partials) timed by the CUDA profiler, for the mixed step of
prefill_bench.py and its two parts alone, both layouts.

    python benchmarks/profile_mixed.py [--iters N] [--json FILE]

Per (layout, shape): the median duration of each kernel over N calls, the median gap
between consecutive kernels of a call, and the median span of a call (first kernel's
start to the last one's end). Each call is followed by a device synchronisation, so the
calls' kernels never overlap, and a 2 ms pause separates calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_bench import make_inputs, mixed_shapes  # noqa: E402

import pagedattn  # noqa: E402


def short(name):
    """A kernel's name without its template arguments and namespaces."""
    base = name.split("<")[0].split("(")[0]
    return base.split("::")[-1][:40]


def calls_of(events, split_us=500.0):
    """Kernel events (ts, dur, name) grouped into calls by the gaps between them."""
    calls, cur, end = [], [], None
    for ts, dur, name in sorted(events):
        if cur and ts - end > split_us:
            calls.append(cur)
            cur = []
        cur.append((ts, dur, name))
        end = ts + dur
    if cur:
        calls.append(cur)
    return calls


def profile_call(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
            time.sleep(0.002)  # a host pause between calls: a gap of milliseconds between their kernels
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = [(float(e["ts"]), float(e["dur"]), e["name"]) for e in trace.get("traceEvents", [])
              if e.get("cat") == "kernel"]  # fmt: skip
    calls = [c for c in calls_of(events) if c]
    per_kernel, gaps, spans = {}, [], []
    for c in calls:
        for i, (ts, dur, name) in enumerate(c):
            per_kernel.setdefault(f"{i}:{short(name)}", []).append(dur)
            if i:
                gaps.append(ts - (c[i - 1][0] + c[i - 1][1]))
        spans.append(c[-1][0] + c[-1][1] - c[0][0])
    med = statistics.median
    return {"calls": len(calls), "span_us": med(spans), "gap_us": med(gaps) if gaps else 0.0,
            "kernels_us": {k: med(v) for k, v in per_kernel.items()}}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    shapes = mixed_shapes(127, bf) + mixed_shapes(511, bf)
    rule = "sure items" if os.environ.get("PAGEDATTN_SM90_SURE") == "1" else "all items"
    print(f"{torch.cuda.get_device_name()}; persistence rule: {rule}")
    rows = []
    for sh in shapes:
        mql = max(q for _, q in sh.seqs)
        for layout in ("vllm", "nhd"):
            q, kc, vc, bt, sl, qsl = make_inputs(sh, layout, g)
            out = torch.empty_like(q)

            def fn(q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl, out=out, mql=mql):
                pagedattn.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=mql, out=out)

            r = profile_call(fn, args.iters)
            r.update(shape=sh.name, layout=layout, rule=rule)
            rows.append(r)
            ks = "; ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items())
            print(f"{sh.name[:48]:48s} {layout:5s} span {r['span_us']:7.1f} us, gap {r['gap_us']:5.1f}: {ks}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
