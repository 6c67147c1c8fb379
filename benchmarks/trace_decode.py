"""Timeline of a decode call from a build with -DPAGEDATTN_TRACE (GPU machine only).

Each decode CTA prints the global timer at: entry (0), length known (1), the arrival of
warp 0's chunks 0..5 (2..7), the end of its loop (8), all warps done (9), the warps'
outputs merged in shared memory (10) and its end (11); each reduce CTA
at entry, after waiting for the decode grid, and at its end. One L2-evicted call per
shape, after warm-up, queued behind a GPU spin like the benchmark; times in us from the
first CTA's entry.

    python3 benchmarks/trace_decode.py [--shapes=b1 x4096,opt-30b] [--calls=3]
    python3 benchmarks/trace_decode.py --fp8 [--layout=vllm|nhd] [--shapes=...]

--fp8 traces fp8_e4m3 caches of the benchmark shapes (the transposed fp8 kernels) and
prints each call's plan (decode_plan) first.

With CuPy installed, a one-thread kernel notes the global timer on the call's stream just
before and just after the call, so the summary also shows what the CTAs' own timers cannot:
the time from the kernel queued before the call to the first decode CTA (launch and start)
and from the call's last kernel to the one queued after it (the reduce's end included).
"""

import ctypes
import os
import statistics
import sys
import tempfile

import torch
from cold_start import warmups
from small_shapes import parse_args, suite_cases

import pagedattn
from pagedattn.bench.kernels import Timer

libc = ctypes.CDLL(None)


def traced(fn):
    """Runs fn with fd 1 sent to a file; returns the device printf lines."""
    torch.cuda.synchronize()
    libc.fflush(None)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode().splitlines()


def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def stream_marker():
    """(mark, read): mark(i) queues a one-thread kernel on torch's current stream that
    writes the global timer (ns) into slot i (0 or 1); read() returns both slots after a
    synchronisation. None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    kernel = cupy.RawKernel(
        r"""
        extern "C" __global__ void pa_mark(unsigned long long* out, int i) {
          unsigned long long t;
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
          out[i] = t;
        }""",
        "pa_mark",
    )
    slots = torch.zeros(2, dtype=torch.int64, device="cuda")
    view = cupy.asarray(slots)  # the same memory (__cuda_array_interface__)

    def mark(i):
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kernel((1,), (1,), (view, cupy.int32(i)))

    # compiled and loaded now: a first launch inside a traced call would outlast the spin
    # that keeps the call's kernels queued back to back
    mark(0)
    torch.cuda.synchronize()
    return mark, lambda: [int(x) for x in slots.tolist()]


def summarize(name, lines, event_us, marks=None):
    dec = [list(map(int, ln.split()[1:])) for ln in lines if ln.startswith("PT ")]
    red = [list(map(int, ln.split()[1:])) for ln in lines if ln.startswith("PR ")]
    if not dec:
        print(f"{name}: no trace lines (is this a -DPAGEDATTN_TRACE build?)")
        return
    # drop the warm-up's CTAs (they ran before the ~30 us spin)
    last = max(r[5] for r in dec)
    dec = [r for r in dec if r[5] > last - 20_000]
    red = [r for r in red if r[5] > last - 20_000]
    t0 = min(r[5] for r in dec)
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    start = [us(r[5]) for r in dec]
    lenk = [us(r[6]) - us(r[5]) for r in dec]
    first = [us(r[7]) - us(r[6]) for r in dec if r[4] > 0]
    loop = [us(r[13]) - us(r[6]) for r in dec]
    sync = [us(r[14]) - us(r[13]) for r in dec]
    merge = [us(r[15]) - us(r[14]) for r in dec]
    tail = [us(r[16]) - us(r[15]) for r in dec]
    end = [us(r[16]) for r in dec]
    per_chunk = []
    for r in dec:
        n = min(r[4], 6)
        per_chunk += [(r[8 + i] - r[7 + i]) / 1e3 for i in range(n - 1)]
    sms = len({r[3] for r in dec})
    parts = max(r[0] for r in dec) + 1
    print(f"{name}: {len(dec)} CTAs ({parts} partitions) on {sms} SMs, chunks/warp0 {q([r[4] for r in dec], 0.5)}, "
          f"call {event_us:.2f} us (events), decode span {max(end):.2f} us")
    row = lambda label, xs: print(  # noqa: E731
        f"  {label:28s} min {min(xs):7.2f}  p50 {q(xs, .5):7.2f}  p90 {q(xs, .9):7.2f}  max {max(xs):7.2f}")
    row("CTA start", start)
    row("entry -> length known", lenk)
    if first:
        row("length -> chunk 0 arrived", first)
    if per_chunk:
        row("chunk i -> chunk i+1", per_chunk)
    row("length -> loop end", loop)
    row("warp 0 done -> all warps done", sync)
    row("all done -> merged in smem", merge)
    row("merged -> CTA end (store)", tail)
    row("CTA end", end)
    if red:
        row("reduce start", [us(r[5]) for r in red])
        row("reduce after wait", [us(r[6]) for r in red])
        row("reduce end", [us(r[7]) for r in red])
    if marks:
        last_end = max([us(r[16]) for r in dec] + [us(r[7]) for r in red])
        print(f"  marker before -> first CTA {-us(marks[0]):7.2f} us   last end -> marker after "
              f"{us(marks[1]) - last_end:7.2f} us   marker to marker {us(marks[1]) - us(marks[0]):7.2f} us")
    print(f"  per chunk: every gap {statistics.mean(per_chunk):.3f} us mean" if per_chunk else "", flush=True)


def fp8_case(sh, layout):
    """fp8_e4m3 inputs of a benchmark shape (fp8_decode_bench's caches, in `layout`): the
    query, caches, tables, lengths and the keyword arguments of an fp8 call."""
    from fp8_decode_bench import _fp8_caches

    from pagedattn.bench.kernels import _make_inputs

    inp = _make_inputs(torch, sh, seed=0)
    fp8 = _fp8_caches(torch, inp, sh)
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    return inp["q"], fp8[f"k_{layout}"], fp8[f"v_{layout}"], inp["tables"], inp["lens"], kw


def main():
    opts, _, only = parse_args(sys.argv[1:])
    calls = int(opts.get("calls", 2))
    modes = opts.get("modes", "flush,code,pages").split(",")
    timer = Timer(torch, 1, 3, "read")
    marker = stream_marker()
    for sh, (qq, kc, vc, bt, sl) in suite_cases(only or ["b1 x4096", "b8 x1024", "opt-30b", "b1 x16384"]):
        kw = {}
        if "--fp8" in sys.argv:
            del kc, vc
            qq, kc, vc, bt, sl, kw = fp8_case(sh, opts.get("layout", "vllm"))
            plan = pagedattn.decode_plan(sh.batch, sh.num_heads, sh.num_kv_heads, sh.head_size, sh.block_size,
                                         bt.shape[1], sh.dtype, opts.get("layout", "vllm"),
                                         kv_cache_dtype="fp8_e4m3")  # fmt: skip
            print(f"{sh.name} fp8 plan: {plan}")
        out = torch.empty_like(qq)
        prep = pagedattn.prepare_decode(qq, kc, vc, bt, sl, out=out, **kw)
        for _ in range(3):
            traced(prep.run)
        pre = warmups(sh, kc, vc, timer)
        for c in [(m, i) for m in modes for i in range(calls)]:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

            def one(ev=ev, run=prep.run, pre=pre[c[0]]):
                pre()
                torch.cuda._sleep(timer.spin_cycles)
                if marker:
                    marker[0](0)
                ev[0].record()
                run()
                ev[1].record()
                if marker:
                    marker[0](1)

            lines = traced(one)
            marks = marker[1]() if marker else None
            summarize(f"{sh.name} {c[0]} #{c[1]}", lines, ev[0].elapsed_time(ev[1]) * 1e3, marks)
        del qq, kc, vc, out


if __name__ == "__main__":
    main()
