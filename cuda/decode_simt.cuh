// CUDA-core decode kernel for float32 queries (caches float32 or fp8), where the
// 16-bit tensor-core path would lose precision.
//
// One CTA = (sequence, KV head, tile of up to 8 query heads of the group, partition).
// Each warp takes 16-token chunks (chunk i, i+W, ...); its lanes split the head dims in
// 4-element pieces, so every KV element is read once for all heads of the tile.
// Per chunk: 16 dot products per head (lane partials, butterfly-reduced), one online
// softmax update per head, then P.V accumulated in registers.
#pragma once

#include "cuda/decode_common.cuh"

namespace pagedattn::cuda_backend {

template <KVCacheDType F, int HEAD, CacheLayout L>
struct SimtDecodeConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 8;
  static constexpr int kTok = 16;
  static constexpr int kHMax = HEAD ? HEAD : supported::kCudaMaxHeadSize;  // capacity (generic: the max)
  static constexpr int kPieces = (kHMax / 4 + 31) / 32;  // 4-dim pieces per lane
  static constexpr int kSmemBytes = kWarps * kRows * kHMax * 4;
};

// Four consecutive cache elements starting at element offset `off`, as floats.
template <KVCacheDType F>
__device__ __forceinline__ float4 load4(const void* base, std::int64_t off) {
  if constexpr (F == KVCacheDType::kAuto) {
    return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + off));
  } else {
    const std::uint32_t v = __ldg(reinterpret_cast<const unsigned int*>(static_cast<const std::uint8_t*>(base) + off));
    return make_float4(fp8_to_float<F>(v & 0xff), fp8_to_float<F>((v >> 8) & 0xff), fp8_to_float<F>((v >> 16) & 0xff),
                       fp8_to_float<F>(v >> 24));
  }
}
template <KVCacheDType F>
__device__ __forceinline__ float load1(const void* base, std::int64_t off) {
  if constexpr (F == KVCacheDType::kAuto) return __ldg(static_cast<const float*>(base) + off);
  else return fp8_to_float<F>(__ldg(static_cast<const std::uint8_t*>(base) + off));
}

template <KVCacheDType F, int HEAD, CacheLayout L>
__global__ void __launch_bounds__(SimtDecodeConfig<F, HEAD, L>::kThreads)
    decode_simt_kernel(const __grid_constant__ DecodeKernelParams p) {
  using C = SimtDecodeConfig<F, HEAD, L>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red_m[C::kWarps * C::kRows];
  __shared__ float red_l[C::kWarps * C::kRows];

  allow_dependent_launch();
  const CtaTask task = cta_task(p, C::kRows);
  const int part = task.part, kvh = task.kvh, s = task.s, rows = task.rows, h0 = task.h0;
  const int tok_begin = task.tok_begin;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int D = HEAD ? HEAD : p.head_size;
  const int B = p.block_size;
  constexpr int x = supported::kCacheChunkBytes / (F == KVCacheDType::kAuto ? 4 : 1);  // vllm key layout's x

  // As in the tensor-core kernel: the length and the warp's first block ids together.
  const std::int32_t* table_row = task.table_row;
  int raw_a, raw_b;  // raw block ids of the warp's next chunk, loaded one chunk ahead
  early_block_ids(p, task, tok_begin + warp * C::kTok, raw_a, raw_b);
  const int len = cta_seq_len<float>(p, task);
  if (len < 0) return;
  const int tok_end = min(len, tok_begin + p.partition_size);
  const int nchunks = (tok_end - tok_begin + C::kTok - 1) / C::kTok;
  // keys [wfirst, tok_end) are visible: one unsigned compare masks both ends
  const int wfirst = window_first(p, len);
  const unsigned visible = static_cast<unsigned>(tok_end - wfirst);

  float q[C::kRows][C::kPieces][4];
  float slope[C::kRows];
  const float* qbase = static_cast<const float*>(p.query) + task.row * p.q_stride_seq;
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) {
    slope[r] = (p.alibi_slopes && r < rows) ? p.alibi_slopes[h0 + r] * kLog2e : 0.f;
#pragma unroll
    for (int k = 0; k < C::kPieces; ++k) {
      const int d = (lane + 32 * k) * 4;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        q[r][k][e] = (r < rows && d < D) ? qbase[static_cast<std::int64_t>(h0 + r) * p.q_stride_head + d + e] : 0.f;
    }
  }

  float acc[C::kRows][C::kPieces][4];
  float m_run[C::kRows], l_run[C::kRows];
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) {
    m_run[r] = -INFINITY;
    l_run[r] = 0.f;
#pragma unroll
    for (int k = 0; k < C::kPieces; ++k) acc[r][k][0] = acc[r][k][1] = acc[r][k][2] = acc[r][k][3] = 0.f;
  }
  bool bad = false;

  for (int ci = warp; ci < nchunks; ci += C::kWarps) {
    const int t0 = tok_begin + ci * C::kTok;
    // Blocks wholly before the window are never read: with B < 16 the chunk's first 8
    // tokens may lie before it, and per token (B < 8) any of the chunk's tokens may.
    const bool per_token = ids_per_token(B);  // idA: the lane's token's id (see decode_common.cuh)
    const int my_tok = t0 + (lane & 15);
    int idA, idB;
    if (per_token) {  // -1: past the end or before the window
      const bool live = my_tok < tok_end && my_tok >= wfirst;
      idA = idB = live ? checked_block_id(p, s, my_tok / B, raw_a) : -1;
      bad |= live && idA < 0;
    } else {
      const bool skip_a = B < 16 && t0 + 8 <= wfirst;
      idA = skip_a ? -1 : checked_block_id(p, s, t0 / B, raw_a);
      idB = idA;
      if (B < 16) idB = t0 + 8 < tok_end ? checked_block_id(p, s, (t0 + 8) / B, raw_b) : -1;
      bad |= (idA < 0 && !skip_a) | (B < 16 && t0 + 8 < tok_end && idB < 0);
    }
    const int tn = t0 + C::kWarps * C::kTok;  // the warp's next chunk
    if (per_token) {
      raw_a = raw_b = tn + (lane & 15) < tok_end ? __ldg(table_row + (tn + (lane & 15)) / B) : 0;
    } else if (tn < tok_end) {
      raw_a = __ldg(table_row + tn / B);
      raw_b = (B < 16 && tn + 8 < tok_end) ? __ldg(table_row + (tn + 8) / B) : raw_a;
    }
    // The block id of token t0 + t (t warp-uniform: every lane calls it).
    auto id_of = [&](int t) { return per_token ? __shfl_sync(0xffffffffu, idA, t) : (t < 8 ? idA : idB); };

    // scores: lane t keeps the scores of token t0 + t
    float my[C::kRows];
#pragma unroll
    for (int r = 0; r < C::kRows; ++r) my[r] = -INFINITY;
#pragma unroll 4
    for (int t = 0; t < C::kTok; ++t) {
      const int tok = t0 + t;
      const int id = id_of(t);
      if (static_cast<unsigned>(tok - wfirst) >= visible || id < 0) continue;  // warp-uniform
      const int off = tok % B;
      float part_dot[C::kRows];
#pragma unroll
      for (int r = 0; r < C::kRows; ++r) part_dot[r] = 0.f;
#pragma unroll
      for (int k = 0; k < C::kPieces; ++k) {
        const int j = lane + 32 * k;  // piece: dims 4j .. 4j+3
        if (4 * j >= D) break;
        std::int64_t e;
        if constexpr (L == CacheLayout::kVLLM)
          e = static_cast<std::int64_t>(id) * p.k_block_stride +
              ((static_cast<std::int64_t>(kvh) * (D / x) + (4 * j) / x) * B + off) * x + (4 * j) % x;
        else  // nhd / hnd: token rows at runtime strides
          e = static_cast<std::int64_t>(id) * p.k_block_stride + off * p.tok_stride + kvh * p.head_stride + 4 * j;
        const float4 kv = load4<F>(p.key_cache, e);
#pragma unroll
        for (int r = 0; r < C::kRows; ++r)
          part_dot[r] += q[r][k][0] * kv.x + q[r][k][1] * kv.y + q[r][k][2] * kv.z + q[r][k][3] * kv.w;
      }
      float v[C::kRows];
#pragma unroll
      for (int r = 0; r < C::kRows; ++r) v[r] = warp_sum(part_dot[r]) * p.qk_scale_log2;
      if (p.soft_cap_log2 > 0.f) {  // a uniform branch around a loop of its own: free when off
#pragma unroll
        for (int r = 0; r < C::kRows; ++r) v[r] = p.soft_cap_log2 * tanhf(v[r] * p.inv_soft_cap_log2);
      }
#pragma unroll
      for (int r = 0; r < C::kRows; ++r) {
        const float x = v[r] + slope[r] * static_cast<float>(tok - len + 1);
        if (lane == t) my[r] = x;
      }
    }
    // online softmax over the chunk
    float corr[C::kRows];
#pragma unroll
    for (int r = 0; r < C::kRows; ++r) {
      const float m_new = fmaxf(m_run[r], warp_max(my[r]));
      corr[r] = exp2f(m_run[r] - m_new);
      m_run[r] = m_new;
      my[r] = exp2f(my[r] - m_new);  // p of token t0 + lane (0 for lanes >= 16 / masked)
      l_run[r] = l_run[r] * corr[r] + my[r];
#pragma unroll
      for (int k = 0; k < C::kPieces; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][k][e] *= corr[r];
    }
#pragma unroll 4
    for (int t = 0; t < C::kTok; ++t) {
      const int tok = t0 + t;
      const int id = id_of(t);
      if (static_cast<unsigned>(tok - wfirst) >= visible || id < 0) continue;
      const int off = tok % B;
      float pt[C::kRows];
#pragma unroll
      for (int r = 0; r < C::kRows; ++r) pt[r] = __shfl_sync(0xffffffffu, my[r], t);
#pragma unroll
      for (int k = 0; k < C::kPieces; ++k) {
        const int j = lane + 32 * k;
        if (4 * j >= D) break;
        float4 v;
        if constexpr (L == CacheLayout::kVLLM) {
          const std::int64_t e =
              static_cast<std::int64_t>(id) * p.v_block_stride + (static_cast<std::int64_t>(kvh) * D + 4 * j) * B + off;
          v = make_float4(load1<F>(p.value_cache, e), load1<F>(p.value_cache, e + B),
                          load1<F>(p.value_cache, e + 2 * B), load1<F>(p.value_cache, e + 3 * B));
        } else {
          v = load4<F>(p.value_cache,
                       static_cast<std::int64_t>(id) * p.v_block_stride + off * p.tok_stride + kvh * p.head_stride + 4 * j);
        }
#pragma unroll
        for (int r = 0; r < C::kRows; ++r) {
          acc[r][k][0] += pt[r] * v.x;
          acc[r][k][1] += pt[r] * v.y;
          acc[r][k][2] += pt[r] * v.z;
          acc[r][k][3] += pt[r] * v.w;
        }
      }
    }
  }

  // merge the warps
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) l_run[r] = warp_sum(l_run[r]);
  const bool any_bad = __syncthreads_or(bad);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < C::kRows; ++r) {
      red_m[warp * C::kRows + r] = m_run[r];
      red_l[warp * C::kRows + r] = l_run[r];
    }
  }
  __syncthreads();
  float* slab = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) mx = fmaxf(mx, red_m[w * C::kRows + r]);
    const float f = m_run[r] == -INFINITY ? 0.f : exp2f(m_run[r] - mx);
#pragma unroll
    for (int k = 0; k < C::kPieces; ++k) {
      const int d = (lane + 32 * k) * 4;
      if (d >= D) break;
      *reinterpret_cast<float4*>(slab + (warp * C::kRows + r) * C::kHMax + d) =
          make_float4(acc[r][k][0] * f, acc[r][k][1] * f, acc[r][k][2] * f, acc[r][k][3] * f);
    }
  }
  __syncthreads();
  store_rows<float, C::kWarps, C::kRows, C::kHMax, HEAD>(p, red_m, red_l, slab, s, task.row, h0, rows, part,
                                                         C::kWarps, any_bad);
}

}  // namespace pagedattn::cuda_backend
