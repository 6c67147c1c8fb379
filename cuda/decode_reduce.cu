// The reduce kernel of the partitioned decode (cuda/decode_reduce.cuh).
#include "cuda/decode_reduce.cuh"

#include "cuda/decode_common.cuh"
#include "cuda/decode_dispatch.cuh"

namespace pagedattn::cuda_backend {
namespace {

// One CTA per (sequence, query head). Warp w merges partitions w, w + 4, ... with an
// online softmax (each partition's max logit, exp-sum and output row are loaded
// together, so a warp's loads are independent of each other and of the merge); the four
// warp states are then merged through shared memory. A lane holds 4 consecutive dims of
// the row per float4 (D is a multiple of 8, rows are 16-byte aligned).
template <class T>
__global__ void __launch_bounds__(kDecodeReduceThreads)
    decode_reduce_kernel(const __grid_constant__ DecodeKernelParams p) {
  constexpr int kWarps = kDecodeReduceThreads / 32;
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
  const int row = decode_row(p, s);
  if (row < 0) return;  // a mixed batch's sequence the varlen kernel serves
  T* out = static_cast<T*>(p.out) + row * p.o_stride_seq + static_cast<std::int64_t>(h) * p.o_stride_head;
  if (len <= 0 || static_cast<std::int64_t>(len) > static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[d] = from_float<T>(len == 0 ? 0.f : NAN);
    return;
  }
  // the partitions the decode CTAs wrote: those starting before len (from the window's base)
  const int np = (len - window_base(p, len) + p.partition_size - 1) / p.partition_size;
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
  // the sink joins the denominator once, here; a row without a finite logit stays NaN
  if (p.sinks != nullptr && mx != -INFINITY) sum += exp2f(p.sinks[h] * kLog2e - mx);
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

}  // namespace

const void* decode_reduce_kernel_for(DType t) {
  const void* fn = nullptr;
  visit_dtype(t, [&](auto dc) {
    using T = typename CudaElement<decltype(dc)::value>::type;
    fn = reinterpret_cast<const void*>(&decode_reduce_kernel<T>);
  });
  if (fn == nullptr) fail<NotSupported>("paged_attention (CUDA): dtype ", dtype_name(t), " is not supported");
  return fn;
}

}  // namespace pagedattn::cuda_backend
