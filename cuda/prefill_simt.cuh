// CUDA-core varlen kernel: float32 queries, and head sizes without a tensor-core kernel.
//
// One warp per packed (query token, group head) row, four rows per CTA; the lanes split
// the head dimension. Keys are visited one at a time with an exact online softmax, so
// the kernel is simple rather than fast: the tensor-core kernel (prefill_mma.cuh) is the
// fast path for 16-bit queries.
#pragma once

#include "cuda/prefill_params.cuh"

namespace pagedattn::cuda_backend {

constexpr int kPrefillSimtWarps = 4;
constexpr int kPrefillSimtDims = supported::kCudaMaxHeadSize / 32;  // head dims per lane

// Cache element (token t's block `blk`, offset `off`; head dim d) as float, fp8 not yet scaled.
template <class T, KVCacheDType F, CacheLayout L, bool KEY>
__device__ __forceinline__ float prefill_cache_elem(const PrefillKernelParams& p, std::int64_t blk, int off, int kh,
                                                    int d) {
  constexpr int kE = F == KVCacheDType::kAuto ? static_cast<int>(sizeof(T)) : 1;
  constexpr int kX = supported::kCacheChunkBytes / kE;
  const int D = p.head_size, B = p.block_size;
  std::int64_t i = blk * (KEY ? p.k_block_stride : p.v_block_stride);
  if constexpr (L == CacheLayout::kNHD) {  // nhd / hnd: token rows at runtime strides
    i += off * p.tok_stride + kh * p.head_stride + d;
  } else if constexpr (KEY) {
    i += ((static_cast<std::int64_t>(kh) * (D / kX) + d / kX) * B + off) * kX + d % kX;
  } else {
    i += (static_cast<std::int64_t>(kh) * D + d) * B + off;
  }
  const void* base = KEY ? p.key_cache : p.value_cache;
  if constexpr (F == KVCacheDType::kAuto) return to_float(static_cast<const T*>(base)[i]);
  else return fp8_to_float<F>(static_cast<const std::uint8_t*>(base)[i]);
}

template <class T, KVCacheDType F, CacheLayout L>
__global__ void __launch_bounds__(kPrefillSimtWarps * 32) prefill_simt_kernel(const __grid_constant__ PrefillKernelParams p) {
  // The CTA's work, read by warp 0 alone and shared: all threads reach the block check's
  // barrier even if a caller changes the index arrays while the kernel runs.
  __shared__ PrefillItem item_slot;
  const PrefillItem w = prefill_shared_item<kPrefillSimtWarps, false>(p, &item_slot);
  if (w.kind == kItemSkip) return;
  const int s = w.seq, kh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = w.rows, r_lo = w.r_lo, r_hi = w.r_hi;
  if (w.kind == kItemNaN) {
    prefill_fill_nan<T>(p, w.row0, kh, r_lo, w.r_end);
    return;
  }
  const int ctx = w.ctx;
  if (!prefill_blocks_ok(p, s, w.kv_begin, w.kv_end)) {
    prefill_fill_nan<T>(p, w.row0, kh, r_lo, r_hi);
    return;
  }
  const int r = r_lo + warp;
  if (r >= rows) return;
  const int tok = w.row0 + r / p.group, h = kh * p.group + r % p.group;
  const int pos = ctx + r / p.group;
  const int D = p.head_size;
  const T* qrow = static_cast<const T*>(p.query) + tok * p.q_stride_tok + h * p.q_stride_head;
  float qv[kPrefillSimtDims], acc[kPrefillSimtDims];
#pragma unroll
  for (int i = 0; i < kPrefillSimtDims; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < D ? to_float(qrow[d]) : 0.0f;
    acc[i] = 0.0f;
  }
  const float slope = p.alibi_slopes ? p.alibi_slopes[h] * kLog2e : 0.0f;
  const std::int32_t* table = p.block_tables + static_cast<std::int64_t>(s) * p.max_blocks_per_seq;
  float m = -INFINITY, l = 0.0f;
  for (int t = prefill_window_first(p, pos); t <= pos; ++t) {
    const std::int64_t blk = prefill_block_id(p, table, t / p.block_size);
    const int off = t % p.block_size;
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < kPrefillSimtDims; ++i) {
      const int d = lane + 32 * i;
      if (d < D) part += qv[i] * prefill_cache_elem<T, F, L, true>(p, blk, off, kh, d);
    }
    const float x = prefill_soft_capped(p, warp_sum(part) * p.qk_scale_log2) + slope * static_cast<float>(t - pos);
    const float m_new = fmaxf(m, x);
    const float corr = exp2f(m - m_new), w = exp2f(x - m_new);
    l = l * corr + w;
#pragma unroll
    for (int i = 0; i < kPrefillSimtDims; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < D ? w * prefill_cache_elem<T, F, L, false>(p, blk, off, kh, d) : 0.0f);
    }
    m = m_new;
  }
  T* orow = static_cast<T*>(p.out) + tok * p.o_stride_tok + h * p.o_stride_head;
  const float inv = p.v_scale / (l + prefill_sink(p, h, m));
#pragma unroll
  for (int i = 0; i < kPrefillSimtDims; ++i) {
    const int d = lane + 32 * i;
    if (d < D) orow[d] = from_float<T>(acc[i] * inv);
  }
}

}  // namespace pagedattn::cuda_backend
