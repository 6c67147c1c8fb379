// Host side of the decode kernel family: the one place that chooses the kernel, the
// single-pass or partitioned form, the partition size and the grid; owns the v2
// scratch pool and the device error record.
//
// Partitioned (v2) scratch, per call: [S, H, NP, D] float partial outputs plus
// [S, H, NP] max logits and exp-sums (decode_workspace_bytes). It comes from the
// caller's `workspace` when given, else from a pool kept per (device, stream) that only
// grows, outside graph capture. Inside capture a pool that is too small is an error
// (allocation would break the capture): pass `workspace`, or run the same shapes once
// eagerly on that stream first. A reduce kernel merges the partials; on sm_90 it is
// launched with programmatic dependent launch, so its launch overlaps the decode grid.
// No call synchronises the host, except with check_block_tables (which must read the
// device error record back).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/decode_common.cuh"
#include "cuda/decode_inst.cuh"
#include "cuda/launch.hpp"

namespace pagedattn::cuda_backend {

// ---------------------------------------------------------------------------------
// Device properties, capture state
// ---------------------------------------------------------------------------------
const DeviceInfo& device_info(int device) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  check_cuda(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute");
  // Peak DRAM rate = 2 transfers per memory clock (kHz) x bus width; copies measure about
  // 90% of it (H100 SXM: 3.35 TB/s peak, 3.03 measured; H200: 4.8, 4.28).
  int mem_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    cudaGetLastError();
    mem_khz = bus_bits = 0;
  }
  const double peak = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0) / 1e6;  // bytes per us
  info.mem_bw = peak > 1e5 ? 0.9 * peak : 3.0e6;                       // unknown: ~3 TB/s
  return cache.emplace(device, info).first->second;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &st), "cudaStreamIsCapturing");
  return st != cudaStreamCaptureStatusNone;
}

namespace {

__device__ DeviceErrorRecord g_decode_error;

DeviceErrorRecord* error_record(int device) {
  static std::mutex mu;
  static std::map<int, DeviceErrorRecord*> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  void* ptr = nullptr;
  check_cuda(cudaGetSymbolAddress(&ptr, g_decode_error), "cudaGetSymbolAddress");
  return cache.emplace(device, static_cast<DeviceErrorRecord*>(ptr)).first->second;
}

// Per-kernel, per-device setup done once: the dynamic shared-memory limit, and the
// number of CTAs that fit on one multiprocessor.
int prepare_kernel(const DecodeKernelInfo& k, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(k.func, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (k.smem > device_info(device).max_smem_per_block)
    fail<NotSupported>("paged_attention: this kernel needs ", k.smem, " bytes of shared memory, the device allows ",
                       device_info(device).max_smem_per_block);
  check_cuda(cudaFuncSetAttribute(k.func, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem),
             "cudaFuncSetAttribute");
  int occ = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k.func, k.threads, k.smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return cache.emplace(key, std::max(occ, 1)).first->second;
}

// A scratch buffer per (device, stream) that only grows (outside capture).
void* pool_scratch(int device, cudaStream_t stream, std::size_t bytes) {
  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buffer> pools;
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = pools[std::make_pair(device, stream)];
  if (b.bytes >= bytes) return b.ptr;
  if (stream_is_capturing(stream))
    fail<InvalidArgument>("paged_attention: the partitioned kernel needs ", bytes,
                          " bytes of scratch, more than this stream's pool holds (", b.bytes,
                          "), and memory cannot be allocated during CUDA graph capture; pass workspace= (a uint8 "
                          "device array of decode_workspace_size(...) bytes) or run the same shapes once before "
                          "capturing");
  if (b.ptr) check_cuda(cudaFree(b.ptr), "cudaFree");  // synchronises: in-flight users finish first
  b.ptr = nullptr;
  b.bytes = 0;
  const std::size_t want = std::max<std::size_t>(bytes + bytes / 4, std::size_t{4} << 20);
  check_cuda(cudaMalloc(&b.ptr, want), "cudaMalloc (paged_attention scratch)");
  b.bytes = want;
  return b.ptr;
}

// One CTA per (sequence, query head). Warp w merges partitions w, w + 4, ... with an
// online softmax (each partition's max logit, exp-sum and output row are loaded
// together, so a warp's loads are independent of each other and of the merge); the four
// warp states are then merged through shared memory. A lane holds 4 consecutive dims of
// the row per float4 (D is a multiple of 8, rows are 16-byte aligned).
template <class T>
__global__ void __launch_bounds__(128) decode_reduce_kernel(const __grid_constant__ DecodeKernelParams p) {
  constexpr int kWarps = 4;
  constexpr int kMaxPieces = 2;  // float4 pieces per lane
  static_assert(32 * kMaxPieces * 4 >= supported::kCudaMaxHeadSize, "the reduce covers every CUDA head size");
  __shared__ float4 warp_out[kWarps][32 * kMaxPieces];
  __shared__ float warp_m[kWarps], warp_l[kWarps];
  const int h = blockIdx.x, s = blockIdx.y;
  const int D = p.head_size;
  PA_TRACE_DECL;
  PA_TRACE(0);
  const int len = __ldg(p.seq_lens + s);  // an input: readable before the decode grid ends
  wait_for_primary_grid();  // launched early (sm_90+): the partials are complete after this
  PA_TRACE(1);
  T* out = static_cast<T*>(p.out) + s * p.o_stride_seq + static_cast<std::int64_t>(h) * p.o_stride_head;
  if (len <= 0 || static_cast<std::int64_t>(len) > static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[d] = from_float<T>(len == 0 ? 0.f : NAN);
    return;
  }
  const int np = (len + p.partition_size - 1) / p.partition_size;
  const std::int64_t row0 = (static_cast<std::int64_t>(s) * p.num_heads + h) * p.num_partitions;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pieces = D / 4;

  float m = -INFINITY, l = 0.f;
  float4 acc[kMaxPieces];
#pragma unroll
  for (int k = 0; k < kMaxPieces; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = warp; i < np; i += kWarps) {
    const float pm = p.part_max[row0 + i];
    const float ps = p.part_sum[row0 + i];
    const float4* row = reinterpret_cast<const float4*>(p.part_out + (row0 + i) * D);
    float4 v[kMaxPieces];
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k)
      v[k] = lane + 32 * k < pieces ? row[lane + 32 * k] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float mn = fmaxf(m, pm);
    const float a = m == mn ? 1.f : exp2f(m - mn);  // also covers m == mn == -inf
    const float b = pm == mn ? 1.f : exp2f(pm - mn);
    m = mn;
    l = l * a + ps * b;
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k) {
      acc[k].x = acc[k].x * a + v[k].x * b;
      acc[k].y = acc[k].y * a + v[k].y * b;
      acc[k].z = acc[k].z * a + v[k].z * b;
      acc[k].w = acc[k].w * a + v[k].w * b;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxPieces; ++k)
    if (lane + 32 * k < pieces) warp_out[warp][lane + 32 * k] = acc[k];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_m[w]);
  float f[kWarps], sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    f[w] = warp_m[w] == -INFINITY ? 0.f : exp2f(warp_m[w] - mx);  // warps without partitions: 0
    sum += f[w] * warp_l[w];
  }
  const float inv = 1.f / sum;
  const float* flat = reinterpret_cast<const float*>(warp_out);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += f[w] * flat[w * 32 * kMaxPieces * 4 + d];  // idle warps: f = 0, acc = 0
    out[d] = from_float<T>(o * inv);
  }
  PA_TRACE(2);
  PA_TRACE_PRINT("PR", np);
}

DecodeKernelInfo select_kernel(const DecodeParams& p) {
  const int d = p.head_size;
  switch (p.dtype) {
    case DType::kFloat16:
      switch (p.kv_cache_dtype) {
        case KVCacheDType::kAuto: return decode_kernel<__half, Fp8::kNone>(d, p.layout);
        case KVCacheDType::kFp8E4M3: return decode_kernel<__half, Fp8::kE4M3>(d, p.layout);
        case KVCacheDType::kFp8E5M2: return decode_kernel<__half, Fp8::kE5M2>(d, p.layout);
      }
      break;
    case DType::kBFloat16:
      switch (p.kv_cache_dtype) {
        case KVCacheDType::kAuto: return decode_kernel<__nv_bfloat16, Fp8::kNone>(d, p.layout);
        case KVCacheDType::kFp8E4M3: return decode_kernel<__nv_bfloat16, Fp8::kE4M3>(d, p.layout);
        case KVCacheDType::kFp8E5M2: return decode_kernel<__nv_bfloat16, Fp8::kE5M2>(d, p.layout);
      }
      break;
    case DType::kFloat32:
      switch (p.kv_cache_dtype) {
        case KVCacheDType::kAuto: return decode_kernel<float, Fp8::kNone>(d, p.layout);
        case KVCacheDType::kFp8E4M3: return decode_kernel<float, Fp8::kE4M3>(d, p.layout);
        case KVCacheDType::kFp8E5M2: return decode_kernel<float, Fp8::kE5M2>(d, p.layout);
      }
      break;
    default: break;
  }
  fail<NotSupported>("paged_attention (CUDA): dtype ", dtype_name(p.dtype), " with kv_cache_dtype \"",
                     kv_cache_dtype_name(p.kv_cache_dtype), "\" is not supported; dtypes: ", supported::dtypes_str());
}

const void* reduce_kernel(DType t) {
  switch (t) {
    case DType::kFloat16: return reinterpret_cast<const void*>(&decode_reduce_kernel<__half>);
    case DType::kBFloat16: return reinterpret_cast<const void*>(&decode_reduce_kernel<__nv_bfloat16>);
    case DType::kFloat32: return reinterpret_cast<const void*>(&decode_reduce_kernel<float>);
    default: break;
  }
  fail<NotSupported>("paged_attention (CUDA): dtype ", dtype_name(t), " is not supported");
}

constexpr int kPartitionAlign = 16;  // tokens: one warp chunk
constexpr std::size_t kAlign = 256;
std::size_t align_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct DecodePlan {
  DecodeKernelInfo kernel;
  int tiles = 1;
  int num_partitions = 1;
  int partition_size = 0;
  bool partials = false;
  bool dependent_launch = false;  // launch the reduce with programmatic stream serialisation
  std::size_t out_bytes = 0, stat_bytes = 0;
  std::size_t workspace_bytes() const { return partials ? align_up(out_bytes) + 2 * align_up(stat_bytes) : 0; }
};

// Modelled time (us) of one decode whose grid is `ctas` CTAs, each streaming
// `cta_bytes`. Memory is shared evenly by the active multiprocessors; the busiest one
// runs c = ceil(ctas / sms) CTAs, at most `slots` at a time, and one CTA pulls at most
// ~26 bytes/ns (its warps' copies in flight over the memory latency), so a grid with
// fewer CTAs than multiprocessors does not get the whole bandwidth. When the CTAs run in
// several rounds (c > slots), the busiest multiprocessor's extra work over the average
// (c - ctas / sms) costs only slots / c of its streaming time: multiprocessors that run
// out of CTAs early leave their share of the bandwidth to the others. Fixed costs: ~1.5 us
// per CTA of the busiest multiprocessor (its start and final merge are not fully hidden)
// and ~1 us per round of resident CTAs; when CTAs run in several rounds they end at
// staggered times and the last ones drain alone (~0.2 CTA lifetimes at the per-CTA
// rate); the partitioned form pays ~3 us for the reduce plus the partials written and
// read back. The constants were fitted to partition sweeps of every benchmark shape on
// an H100 and an H200 (.ci/plan_sweep.py): the plan is within 2% of the best measured.
struct PlanModel {
  int sms, slots;
  double bw;          // bytes per us for the whole device
  double part_bytes;  // partial-result bytes one CTA writes (and the reduce reads)
  double us(std::int64_t ctas, double cta_bytes, bool partials) const {
    constexpr double kCtaBw = 26.0e3;  // bytes per us one CTA can pull
    constexpr double kCtaUs = 1.5, kRoundUs = 1.0, kTail = 0.2, kReduceUs = 3.0;
    const std::int64_t c = (ctas + sms - 1) / sms;
    const double active = static_cast<double>(std::min<std::int64_t>(ctas, sms));
    const double rate = std::min(static_cast<double>(std::min<std::int64_t>(c, slots)) * kCtaBw, bw / active);
    double streamed = static_cast<double>(c);  // CTAs' worth of bytes the busiest multiprocessor waits for
    if (c > slots) {
      const double mean = static_cast<double>(ctas) / sms;
      streamed = mean + (static_cast<double>(c) - mean) * slots / static_cast<double>(c);
    }
    double t = streamed * cta_bytes / rate + static_cast<double>(c) * kCtaUs +
               kRoundUs * static_cast<double>((c + slots - 1) / slots);
    if (c > slots) t += kTail * cta_bytes / kCtaBw;
    if (partials) t += kReduceUs + 2.0 * static_cast<double>(ctas) * part_bytes / bw;
    return t;
  }
};

DecodePlan make_plan(const DecodeParams& p) {
  DecodePlan plan;
  plan.kernel = select_kernel(p);
  // PAGEDATTN_NO_PDL=1 turns programmatic dependent launch off (for A/B measurements).
  static const bool pdl_off = [] {
    const char* e = std::getenv("PAGEDATTN_NO_PDL");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  plan.dependent_launch = !pdl_off && device_info(p.device_id).cc_major >= 9;
  const int slots_per_sm = prepare_kernel(plan.kernel, p.device_id);
  const int G = p.num_heads / p.num_kv_heads;
  plan.tiles = (G + plan.kernel.rows - 1) / plan.kernel.rows;
  const std::int64_t base = static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads * plan.tiles;
  const std::int64_t ctx = std::max<std::int64_t>(static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size, 1);
  auto round_up = [](std::int64_t v) { return (v + kPartitionAlign - 1) / kPartitionAlign * kPartitionAlign; };

  if (p.partition_size != 0 && p.partition_size % kPartitionAlign != 0)
    fail<InvalidArgument>("partition_size: the CUDA kernels need a multiple of ", kPartitionAlign, ", got ",
                          p.partition_size);
  std::int64_t psize = 0;
  if (p.version == 1) {
    psize = round_up(ctx);
  } else if (p.partition_size != 0) {
    psize = p.partition_size;
    plan.partials = p.version == 2 || psize < ctx;
  } else {
    const double bytes_per_token =
        2.0 * p.head_size * static_cast<double>(cache_elem_size(p.dtype, p.kv_cache_dtype));
    const DeviceInfo& dev = device_info(p.device_id);
    const PlanModel model{dev.num_sms, slots_per_sm, dev.mem_bw,
                          4.0 * std::min(G, plan.kernel.rows) * (p.head_size + 2)};
    const int min_np = p.version == 2 && ctx > kPartitionAlign ? 2 : 1;
    const int max_np = static_cast<int>(std::max<std::int64_t>(min_np, std::min<std::int64_t>(ctx / 64, 512)));
    double best = INFINITY;
    psize = round_up(ctx);
    // every warp of a CTA gets at least one chunk of its partition
    const std::int64_t min_ps = static_cast<std::int64_t>(kPartitionAlign) * (plan.kernel.threads / 32);
    // Short contexts (at most 4 chunks per warp) run single pass: writing and merging
    // partials costs more than the parallelism gains (OPT-125m 5 x 196 and OPT-30B 1 x 204
    // on an H100: 10.4 vs 11.3 us and 11.6 vs 13.4 us).
    const int np_limit = ctx <= 4 * min_ps ? min_np : max_np;
    for (int np = min_np; np <= np_limit; ++np) {
      const std::int64_t ps = std::max(min_ps, round_up((ctx + np - 1) / np));
      const std::int64_t np_eff = (ctx + ps - 1) / ps;
      if (np_eff < min_np) continue;
      const double t = model.us(base * np_eff, static_cast<double>(std::min(ps, ctx)) * bytes_per_token, np_eff > 1);
      if (t < best * 0.995) {  // prefer fewer partitions on near ties
        best = t;
        psize = ps;
      }
    }
    plan.partials = p.version == 2 || psize < ctx;
  }
  if (psize > std::numeric_limits<int>::max() / 2) psize = std::numeric_limits<int>::max() / 2;
  plan.partition_size = static_cast<int>(psize);
  plan.num_partitions = static_cast<int>((ctx + psize - 1) / psize);
  if (plan.partials) {
    const auto rows = static_cast<std::size_t>(p.num_seqs) * static_cast<std::size_t>(p.num_heads) *
                      static_cast<std::size_t>(plan.num_partitions);
    plan.out_bytes = rows * static_cast<std::size_t>(p.head_size) * sizeof(float);
    plan.stat_bytes = rows * sizeof(float);
  }
  return plan;
}

// The inputs of make_plan: everything host-known that the plan depends on.
struct PlanKey {
  int device, head_size, num_seqs, num_heads, num_kv_heads, max_blocks_per_seq, block_size, version, partition_size;
  DType dtype;
  KVCacheDType kv_cache_dtype;
  CacheLayout layout;
  bool operator==(const PlanKey& o) const {
    return device == o.device && head_size == o.head_size && num_seqs == o.num_seqs && num_heads == o.num_heads &&
           num_kv_heads == o.num_kv_heads && max_blocks_per_seq == o.max_blocks_per_seq &&
           block_size == o.block_size && version == o.version && partition_size == o.partition_size &&
           dtype == o.dtype && kv_cache_dtype == o.kv_cache_dtype && layout == o.layout;
  }
};

// make_plan costs a few microseconds (the partition search, the per-kernel lookups);
// a serving loop repeats the same few shapes, so each thread keeps its last plans.
const DecodePlan& cached_plan(const DecodeParams& p) {
  constexpr int kSlots = 8;
  struct Entry {
    PlanKey key;
    DecodePlan plan;
    bool used = false;
  };
  thread_local Entry entries[kSlots];
  thread_local int next = 0;
  const PlanKey key{p.device_id,  p.head_size,  p.num_seqs,       p.num_heads,     p.num_kv_heads, p.max_blocks_per_seq,
                    p.block_size, p.version,    p.partition_size, p.dtype,         p.kv_cache_dtype, p.layout};
  for (Entry& e : entries)
    if (e.used && e.key == key) return e.plan;
  Entry& e = entries[next];
  e.plan = make_plan(p);  // may throw: the slot stays as it was
  e.key = key;
  e.used = true;
  next = (next + 1) % kSlots;
  return e.plan;
}

}  // namespace

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

std::size_t decode_workspace_bytes(const DecodeParams& p) {
  DeviceGuard guard(p.device_id);
  return make_plan(p).workspace_bytes();
}

DecodePlanInfo decode_plan_info(const DecodeParams& p) {
  DeviceGuard guard(p.device_id);
  const DecodePlan plan = make_plan(p);
  DecodePlanInfo info;
  info.num_partitions = plan.num_partitions;
  info.partition_size = plan.partition_size;
  info.reduce_kernel = plan.partials;
  info.head_tiles = plan.tiles;
  info.ctas = static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads * plan.tiles * plan.num_partitions;
  info.workspace_bytes = plan.workspace_bytes();
  return info;
}

void paged_attention(const DecodeParams& p, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  for (const void* ptr : {p.key_cache, p.value_cache})
    if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0)
      fail<InvalidArgument>("paged_attention (CUDA): key_cache and value_cache must start on a 16-byte boundary");
  if (p.num_seqs == 0) return;
  if (p.num_seqs > 65535)
    fail<NotSupported>("paged_attention (CUDA): at most 65535 sequences per call, got ", p.num_seqs);
  // Only the checking mode (and a pool that must grow, see pool_scratch) cares about
  // capture; the capture query is skipped otherwise, to keep the host cost of a call low.
  if (p.check_block_tables && stream_is_capturing(stream))
    fail<InvalidArgument>("check_block_tables=True needs a host synchronisation and cannot run during CUDA graph "
                          "capture");

  const DecodePlan plan = cached_plan(p);
  DecodeKernelParams k{};
  k.out = p.out;
  k.o_stride_seq = p.o_stride_seq;
  k.o_stride_head = p.o_stride_head;
  k.query = p.query;
  k.q_stride_seq = p.q_stride_seq;
  k.q_stride_head = p.q_stride_head;
  k.key_cache = p.key_cache;
  k.value_cache = p.value_cache;
  k.block_tables = p.block_tables;
  k.seq_lens = p.seq_lens;
  k.alibi_slopes = p.alibi_slopes;
  k.num_seqs = p.num_seqs;
  k.num_heads = p.num_heads;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.block_size = p.block_size;
  k.max_blocks_per_seq = p.max_blocks_per_seq;
  k.num_blocks = p.num_blocks;
  k.group = p.num_heads / p.num_kv_heads;
  k.rows_per_cta = plan.kernel.rows;
  k.num_head_tiles = plan.tiles;
  const float k_scale = p.kv_cache_dtype == KVCacheDType::kAuto ? 1.0f : p.k_scale;
  k.qk_scale_log2 = p.scale * k_scale * kLog2e;
  k.v_scale = p.kv_cache_dtype == KVCacheDType::kAuto ? 1.0f : p.v_scale;
  k.partition_size = plan.partition_size;
  k.num_partitions = plan.num_partitions;
  k.error = error_record(p.device_id);

  if (plan.partials) {
    const std::size_t need = plan.workspace_bytes();
    char* ws = nullptr;
    if (p.workspace) {
      if (p.workspace_bytes < need)
        fail<InvalidArgument>("workspace: the partitioned kernel needs ", need, " bytes for these shapes, got ",
                              p.workspace_bytes, " (see decode_workspace_size)");
      if (reinterpret_cast<std::uintptr_t>(p.workspace) % 16 != 0)
        fail<InvalidArgument>("workspace: must start on a 16-byte boundary");
      ws = static_cast<char*>(p.workspace);
    } else {
      ws = static_cast<char*>(pool_scratch(p.device_id, stream, need));
    }
    k.part_out = reinterpret_cast<float*>(ws);
    k.part_max = reinterpret_cast<float*>(ws + align_up(plan.out_bytes));
    k.part_sum = reinterpret_cast<float*>(ws + align_up(plan.out_bytes) + align_up(plan.stat_bytes));
  }

  if (p.check_block_tables)
    check_cuda(cudaMemsetAsync(k.error, 0, sizeof(DeviceErrorRecord), stream), "cudaMemsetAsync");

  void* args[] = {&k};
  const dim3 grid(static_cast<unsigned>(plan.num_partitions), static_cast<unsigned>(p.num_kv_heads * plan.tiles),
                  static_cast<unsigned>(p.num_seqs));
  check_cuda(cudaLaunchKernel(plan.kernel.func, grid, dim3(plan.kernel.threads), args,
                              static_cast<std::size_t>(plan.kernel.smem), stream),
             "paged_attention: decode kernel launch");
  check_launch("paged_attention: decode kernel");
  if (plan.partials) {
    const void* red = reduce_kernel(p.dtype);
    // Programmatic dependent launch where the device has it: the reduce kernel is set up
    // while the decode grid runs and waits for it on the device (no launch gap).
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.num_seqs));
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = plan.dependent_launch ? 1 : 0;
    check_cuda(cudaLaunchKernelExC(&cfg, red, args), "paged_attention: reduce kernel launch");
    check_launch("paged_attention: reduce kernel");
  }

  if (p.check_block_tables) {
    DeviceErrorRecord rec{};
    check_cuda(cudaMemcpyAsync(&rec, k.error, sizeof rec, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (rec.flag == 1)
      fail<OutOfRange>("block_tables[", rec.seq, ", ", rec.index, "] = ", rec.value, " is outside [0, num_blocks = ",
                       p.num_blocks, ") (the affected outputs were set to NaN)");
    if (rec.flag == 2)
      fail<OutOfRange>("seq_lens[", rec.seq, "] = ", rec.value, " is outside [0, max_blocks_per_seq * block_size = ",
                       static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size,
                       "] (the affected outputs were set to NaN)");
  }
}

}  // namespace pagedattn::cuda_backend
