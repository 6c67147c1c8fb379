"""What a cold start costs a decode call (GPU machine only): each shape timed like the
benchmark (L2 evicted by reading, a GPU spin in front, CUDA events) with different
warm-ups between the eviction and the spin:

  flush   nothing (the benchmark's method)
  code    the same kernels run once on a tiny separate problem: their code is in L2
  pages   one 16-byte read per 64 KB of the key and value caches: address translations
          warm, the data itself still in memory
  both    code and pages
  warm    no eviction at all (the data in L2 where it fits)

    python3 benchmarks/cold_start.py [--shapes=b1 x4096,opt-30b] [--reps=30]
"""

import statistics
import sys

import torch
from small_shapes import case, parse_args, suite_cases

import pagedattn
from pagedattn.bench.kernels import Timer

MODES = ("flush", "code", "pages", "both", "warm")


def warmups(sh, kc, vc, timer):
    """mode -> function run between the L2 eviction and the spin."""
    dt = getattr(torch, sh.dtype)
    tq, tkc, tvc, tbt, tsl = case(1, sh.num_heads, sh.num_kv_heads, sh.head_size, dt, 64)
    tout = torch.empty_like(tq)
    # partitioned, so the decode and the reduce kernel both run
    tiny = pagedattn.prepare_decode(tq, tkc, tvc, tbt, tsl, out=tout, kernel="partitioned", partition_size=32)
    step = 65536 // kc.element_size()
    kf, vf = kc.view(-1), vc.view(-1)
    def pages():
        return kf[::step].float().sum() + vf[::step].float().sum()

    return {
        "flush": lambda: timer._evict_l2(0),
        "code": lambda: (timer._evict_l2(0), tiny.run()),  # tiny holds its arrays
        "pages": lambda: (timer._evict_l2(0), pages()),
        "both": lambda: (timer._evict_l2(0), tiny.run(), pages()),
        "warm": lambda: None,
    }


def gpu_us(timer, pre, fn, reps):
    for _ in range(3):
        pre()
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        pre()
        torch.cuda._sleep(timer.spin_cycles)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def main():
    opts, _, only = parse_args(sys.argv[1:])
    reps = int(opts.get("reps", 30))
    timer = Timer(torch, reps, 3, "read")
    print(f"{'shape':22s} " + " ".join(f"{m:>8s}" for m in MODES) + "  (us)")
    for sh, (q, kc, vc, bt, sl) in suite_cases(only or ["b1 x", "b8 x1024", "b8 x4096", "b32 x1024", "opt"]):
        out = torch.empty_like(q)
        prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out)
        pre = warmups(sh, kc, vc, timer)
        t = {m: gpu_us(timer, pre[m], prep.run, reps) for m in MODES}
        print(f"{sh.name:22s} " + " ".join(f"{t[m]:8.2f}" for m in MODES), flush=True)
        del q, kc, vc, out


if __name__ == "__main__":
    main()
