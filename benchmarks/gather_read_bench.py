"""Read bandwidth of a paged cache's access pattern without attention: 256 MB to 2 GB read
as runs of R contiguous bytes at random places of the pool (what one CTA of the decode
kernels reads per chunk: a vllm page-16 slab is 2 KB of keys and 2 KB of values per head
for fp8, 4 KB each for bf16), against the same bytes in order. Each warp takes runs
round-robin and folds them into a register (no writes), with up to 8 runs per warp in
flight; CUDA-event medians after warm-up. Says how close a kernel reading runs of R bytes
can come to the copy rate at all. Needs CuPy and a GPU.

    python benchmarks/gather_read_bench.py [--total-mb 512] [--runs 512,1024,2048,4096,8192]
"""

import argparse
import statistics

import cupy as cp

SRC = r"""
// Warp w reads runs w, w + W, ... (run r at base + idx[r] * R16 16-byte words), kInFlight
// runs per round so that several are in flight per warp.
template <int R16>
__device__ void read_runs(const uint4* __restrict__ base, const int* __restrict__ idx, int nruns, unsigned* out) {
  constexpr int kInFlight = R16 >= 256 ? 2 : (R16 >= 128 ? 4 : 8);
  constexpr int kPer = (R16 + 31) / 32;  // words per lane per run
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x / 32);
  unsigned acc = 0;
  for (int r0 = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); r0 < nruns; r0 += warps * kInFlight) {
    uint4 v[kInFlight][kPer];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const int r = r0 + k * warps;
      const uint4* p = base + static_cast<long long>(r < nruns ? __ldg(idx + r) : 0) * R16;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int w = lane + 32 * i;
        v[k][i] = (r < nruns && w < R16) ? __ldcs(p + w) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k)
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc ^= v[k][i].x ^ v[k][i].y ^ v[k][i].z ^ v[k][i].w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads
}
extern "C" __global__ void r512(const uint4* b, const int* i, int n, unsigned* o) { read_runs<32>(b, i, n, o); }
extern "C" __global__ void r1024(const uint4* b, const int* i, int n, unsigned* o) { read_runs<64>(b, i, n, o); }
extern "C" __global__ void r2048(const uint4* b, const int* i, int n, unsigned* o) { read_runs<128>(b, i, n, o); }
extern "C" __global__ void r4096(const uint4* b, const int* i, int n, unsigned* o) { read_runs<256>(b, i, n, o); }
extern "C" __global__ void r8192(const uint4* b, const int* i, int n, unsigned* o) { read_runs<512>(b, i, n, o); }
"""


def timed(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", default="256,512,2048")
    ap.add_argument("--runs", default="512,1024,2048,4096,8192")
    args = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    out = cp.zeros(1, dtype=cp.uint32)
    print(f"{name}, {sms} multiprocessors")
    print("| bytes read | run | in order (GB/s) | random runs (GB/s) |")
    print("|---|---|---|---|")
    for total_mb in [int(t) for t in args.total_mb.split(",")]:
        total = total_mb << 20
        pool = cp.random.randint(0, 2**31, size=total // 4, dtype=cp.int32).view(cp.uint8)
        for run in [int(r) for r in args.runs.split(",")]:
            n = total // run
            kern = mod.get_function(f"r{run}")
            rates = []
            for order in (cp.arange(n, dtype=cp.int32), cp.random.permutation(n).astype(cp.int32)):
                args_ = (pool, order, cp.int32(n), out)
                us = timed(lambda k=kern, a=args_: k((sms * 8,), (256,), a))
                rates.append(total / us / 1e3)
            print(f"| {total_mb} MB | {run} B | {rates[0]:.0f} | {rates[1]:.0f} |", flush=True)
        del pool


if __name__ == "__main__":
    main()
