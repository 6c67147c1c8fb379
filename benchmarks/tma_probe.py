"""Per-multiprocessor streaming rate: cp.async (16 bytes per lane) against bulk copies
(cp.async.bulk, one lane per warp, mbarrier completion), on the decode kernel's access
pattern: every warp streams its own 8 KB chunks (two 4 KB slabs from random places) through
a ring of `stages` slots. Needs CuPy and an sm_90 GPU. Prints time, GB/s and bytes per ns
per CTA for a few grid sizes.
"""

import statistics
import sys

import cupy as cp

SRC = r"""
extern "C" __device__ __forceinline__ unsigned sa(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
template <int STAGES, bool BULK>
__device__ void body(const char* __restrict__ src, const int* __restrict__ tab, int nchunks, float* sink) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bar[8 * 8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  unsigned char* ring = sm + warp * STAGES * 8192;
  const int* t = tab + 2 * blockIdx.x * nchunks;
  const int my = nchunks > warp ? (nchunks - warp + W - 1) / W : 0;
  if (BULK && lane == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[warp * 8 + s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncwarp();
  auto load = [&](int i) {
    const int c = warp + i * W;
    unsigned char* dst = ring + (i % STAGES) * 8192;
    const char* a = src + static_cast<long long>(t[2 * c]) * 4096;
    const char* b = src + static_cast<long long>(t[2 * c + 1]) * 4096;
    if (BULK) {
      if (lane == 0) {
        const unsigned mb = sa(&bar[warp * 8 + i % STAGES]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 8192;" :: "r"(mb));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                     :: "r"(sa(dst)), "l"(a), "r"(mb) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                     :: "r"(sa(dst + 4096)), "l"(b), "r"(mb) : "memory");
      }
    } else {
      for (int p = lane; p < 256; p += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa(dst + p * 16)), "l"(a + p * 16));
      for (int p = lane; p < 256; p += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa(dst + 4096 + p * 16)), "l"(b + p * 16));
    }
  };
  float acc = 0.f;
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my) load(i);
    if (!BULK) asm volatile("cp.async.commit_group;");
  }
  for (int i = 0; i < my; ++i) {
    if (i + STAGES - 1 < my) load(i + STAGES - 1);
    if (BULK) {
      const unsigned mb = sa(&bar[warp * 8 + i % STAGES]);
      const unsigned par = (i / STAGES) & 1;
      unsigned done = 0;
      while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(mb), "r"(par) : "memory");
    } else {
      asm volatile("cp.async.commit_group;");
      asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
      __syncwarp();
    }
    const float* f = reinterpret_cast<const float*>(ring + (i % STAGES) * 8192);
    for (int k = lane; k < 2048; k += 256) acc += f[k];
    __syncwarp();
  }
  if (acc == 1234.5f) sink[0] = acc;
}
extern "C" __global__ void ca2(const char* s, const int* t, int n, float* k) { body<2, false>(s, t, n, k); }
extern "C" __global__ void ca4(const char* s, const int* t, int n, float* k) { body<4, false>(s, t, n, k); }
extern "C" __global__ void tb2(const char* s, const int* t, int n, float* k) { body<2, true>(s, t, n, k); }
extern "C" __global__ void tb4(const char* s, const int* t, int n, float* k) { body<4, true>(s, t, n, k); }
extern "C" __global__ void tb6(const char* s, const int* t, int n, float* k) { body<6, true>(s, t, n, k); }
extern "C" __global__ void empty(const char* s, const int* t, int n, float* k) {}
"""


def main():
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90"), name_expressions=None)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    sms = dev.attributes["MultiProcessorCount"]
    pool = cp.random.random(1 << 27, dtype=cp.float64).view(cp.uint8)  # 1 GiB
    nslabs = pool.size // 4096
    flush = cp.ones(1 << 26, dtype=cp.float32)  # 256 MB, read to evict L2
    sink = cp.zeros(4, dtype=cp.float32)
    # copy bandwidth
    a = cp.empty(1 << 28, dtype=cp.uint8)
    b = cp.empty_like(a)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        ev0.record()
        b[...] = a
        ev1.record()
        ev1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(ev0, ev1))
    copy_bw = 2 * a.nbytes / (statistics.median(ts[2:]) * 1e-3) / 1e9
    print(f"gpu {name} sms {sms} copy {copy_bw:.0f} GB/s")
    del a, b
    grids = [(56, 13), (sms, 16), (128, 32), (256, 16), (3 * sms, 16)]
    for kern, stages in [("empty", 2), ("ca2", 2), ("ca4", 4), ("tb2", 2), ("tb4", 4), ("tb6", 6)]:
        f = mod.get_function(kern)
        smem = 4 * stages * 8192
        f.max_dynamic_shared_size_bytes = smem
        for grid, nch in grids:
            tab = cp.random.randint(0, nslabs, size=2 * grid * nch, dtype=cp.int32)
            ts = []
            for it in range(25):
                flush.sum()
                ev0.record()
                f((grid,), (128,), (pool, tab, cp.int32(nch), sink), shared_mem=smem)
                ev1.record()
                ev1.synchronize()
                if it >= 5:
                    ts.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3)
            us = statistics.median(ts)
            nbytes = grid * nch * 8192
            print(
                f"{kern:5s} grid {grid:4d} x {nch:2d} chunks: {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s "
                f"{100 * nbytes / us / 1e3 / copy_bw:5.1f}% {nbytes / grid / us / 1e3:6.1f} B/ns/CTA"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
