// Tensor-core varlen kernel (f16 / bf16 queries; caches of the same dtype or fp8), in the
// FlashAttention-2 form over the paged cache.
//
// One CTA = (tile of kBM packed query rows, KV head, sequence). The rows of a sequence
// are its (query token, group head) pairs, token-major: row r is token r / G of query
// head kh * G + r % G, so the G query heads of a GQA group share every key and value
// tile the CTA reads. Four warps own 16 rows each (the M of mma.m16n8k16). The CTA walks
// the sequence's keys in tiles of kBN tokens gathered through the block table into
// shared memory (cp.async, double-buffered; fp8 caches are converted to the query's
// type on the way in), computes S = Q K^T, keeps an online softmax in float32 (base 2)
// and accumulates O += P V with P kept in registers. Key tiles wholly above the causal
// diagonal of the CTA's last row are never visited; the tiles that cross the diagonal
// are masked element by element.
//
// Shared memory: Q [kBM][D + 8] (staged once, under the ring), K [kBN][D + 8] x 2 stages, V nhd [kBN][D + 8] (read
// with ldmatrix.trans) or vllm [D][kBN + 8] (the cache's own dim-major rows, read with
// ldmatrix): the 16-byte pad makes every ldmatrix phase conflict-free.
#pragma once

#include "cuda/mma.cuh"
#include "cuda/prefill_params.cuh"

namespace pagedattn::cuda_backend {

// Compile-time knobs for tuning experiments: m-tiles (16 rows each) per warp, keys per tile.
#ifndef PAGEDATTN_PREFILL_MT
#define PAGEDATTN_PREFILL_MT 2
#endif
#ifndef PAGEDATTN_PREFILL_BN
#define PAGEDATTN_PREFILL_BN 64
#endif

template <class T, KVCacheDType F, int D, CacheLayout L>
struct PrefillMmaConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // Rows per warp: two m-tiles share every key / value fragment a warp loads (half the
  // shared-memory reads per mma), where the registers allow it.
  static constexpr int kMT = D <= 128 ? PAGEDATTN_PREFILL_MT : 1;
  static constexpr int kBM = 16 * kMT * kWarps;                      // packed query rows per CTA
  static constexpr int kBN = D <= 128 ? PAGEDATTN_PREFILL_BN : 32;   // keys per tile
  static constexpr int kLog2BN = kBN == 16 ? 4 : kBN == 32 ? 5 : kBN == 64 ? 6 : kBN == 128 ? 7 : -1;
  static constexpr int kPitch = D + 8;              // elements per row of Q, K and nhd V
  static constexpr int kVtPitch = kBN + 8;          // elements per row of vllm V ([D][kBN])
  static constexpr int kQBytes = kBM * kPitch * 2;
  static constexpr int kKBytes = kBN * kPitch * 2;
  static constexpr int kVBytes = L == CacheLayout::kVLLM ? D * kVtPitch * 2 : kBN * kPitch * 2;
  static constexpr int kRingBytes = 2 * (kKBytes + kVBytes);
  // One m-tile per warp: the Q fragments live in registers, so the Q tile is staged once
  // at the start of the ring before the first key tile is issued. Two: Q is read from
  // shared memory at every key tile (registers hold the two accumulators), after the ring.
  static constexpr bool kQInRegs = kMT == 1;
  static constexpr int kQOffset = kQInRegs ? 0 : kRingBytes;
  static constexpr int kSmemBytes = kQInRegs ? (kQBytes > kRingBytes ? kQBytes : kRingBytes) : kRingBytes + kQBytes;
  static constexpr int kE = F == KVCacheDType::kAuto ? 2 : 1;  // cache element bytes
  // CTAs per SM the registers must allow (3 x 128 threads: at most 170 registers each)
  // where the accumulators fit that; 1 otherwise.
  static constexpr int kMinBlocks = D <= 128 && kMT == 1 ? 3 : 1;
  static_assert(kLog2BN > 0, "keys per tile: 16, 32, 64 or 128");
  static_assert(D % 16 == 0, "the tensor-core prefill kernel needs a head size multiple of 16");
};

// threadIdx.x, read where it is used (a volatile read is never moved out of a loop): what
// the key-tile loop computes from it is recomputed at each tile rather than kept in
// registers across the loop, which the accumulators fill.
__device__ __forceinline__ int prefill_tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// x, hidden from the compiler's loop-invariant code motion in the same way: what a loop
// computes from the result is recomputed at each iteration.
__device__ __forceinline__ int prefill_opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Eight consecutive cache elements (16 bytes of a 16-bit cache, 8 of an fp8 one) into 16
// bytes of shared memory as T; `n` of them valid (the rest are zeros, never read).
template <class T, KVCacheDType F>
__device__ __forceinline__ void prefill_load8(void* dst, const void* src, int n) {
  if constexpr (F == KVCacheDType::kAuto) {
    cp_async16(dst, src, n * 2);
  } else {
    uint2 raw = make_uint2(0, 0);
    if (n == 8) {
      raw = *static_cast<const uint2*>(src);
    } else {
      // (two words, not an array indexed at run time, which would live in local memory)
      const auto* b = static_cast<const std::uint8_t*>(src);
      for (int i = 0; i < n; ++i) {
        const std::uint32_t byte = static_cast<std::uint32_t>(b[i]) << (8 * (i % 4));
        if (i < 4) raw.x |= byte;
        else raw.y |= byte;
      }
    }
    uint4 v;
    v.x = fp8x2_to<T, F>(raw.x);
    v.y = fp8x2_to<T, F>(raw.x >> 16);
    v.z = fp8x2_to<T, F>(raw.y);
    v.w = fp8x2_to<T, F>(raw.y >> 16);
    *static_cast<uint4*>(dst) = v;
  }
}

// Loads keys and values [t0, t0 + kBN) of KV head kh (those at or past kv_end, and those
// of blocks before kv_lo's, a window's unread blocks, as zeros).
// Consecutive threads take consecutive 8-element pieces of the cache's own memory order,
// so a warp's loads cover whole runs: nhd, a token's [D] row; vllm, a block's [D/x][B][x]
// keys and [D][B] values, each one contiguous run per block and KV head.
template <class C, class T, KVCacheDType F, int D, CacheLayout L>
__device__ __forceinline__ void prefill_load_tile(const PrefillKernelParams& p, const std::int32_t* table, int kh,
                                                  int t0, int kv_lo, int kv_end, T* ks, T* vs) {
  const int B = p.block_size;
  const auto* vc = static_cast<const std::uint8_t*>(p.value_cache);
  // B is a power of two (supported::kCudaBlockSizes; the vllm segments below rely on it
  // too), so the block arithmetic is shifts and masks. Offsets inside a block fit 32 bits
  // unsigned: a block holds K * D * B < 2^32 elements (K <= 65535, the grid's y; D and B
  // <= 256); only a block's start, id * block stride, needs 64.
  using E = std::conditional_t<C::kE == 2, std::uint16_t, std::uint8_t>;  // a cache element's bytes
  const int lb = __ffs(B) - 1;  // log2(B)
  if constexpr (L == CacheLayout::kNHD) {  // nhd / hnd: token rows at runtime strides
    constexpr int kChunks = D / 8;  // pieces of a token row
    const std::uint32_t head_off = static_cast<std::uint32_t>(kh) * static_cast<std::uint32_t>(p.head_stride);
    for (int u = prefill_tid(); u < C::kBN * kChunks; u += C::kThreads) {
      const int tt = u / kChunks, c = u % kChunks, t = t0 + tt;
      const bool live = t < kv_end && t >= kv_lo;  // kv_lo: block-aligned
      const int blk = live ? prefill_block_id(p, table, t >> lb) : 0;
      const std::uint32_t slot = static_cast<std::uint32_t>(t & (B - 1));
      const std::uint32_t i = slot * static_cast<std::uint32_t>(p.tok_stride) + head_off + c * 8;
      prefill_load8<T, F>(ks + tt * C::kPitch + c * 8,
                          static_cast<const E*>(p.key_cache) + blk * p.k_block_stride + i, live ? 8 : 0);
      prefill_load8<T, F>(vs + tt * C::kPitch + c * 8,
                          static_cast<const E*>(p.value_cache) + blk * p.v_block_stride + i, live ? 8 : 0);
    }
  } else {
    // vllm: the tile is cut into segments of bt tokens inside one block each: whole
    // blocks (B <= kBN, the tile starts on a block), or the tile's part of one block.
    constexpr int kX = 16 / C::kE;       // elements per 16-byte chunk of the key layout
    constexpr int kH = kX / 8;           // 8-element pieces per chunk
    constexpr int kD8 = D / 8;           // 8-element pieces of a token's key or value
    const int lbt = min(lb, C::kLog2BN);  // log2(bt), bt = tokens per segment
    const int bt = 1 << lbt;
    // KV head kh's part of a block: keys [D/x][B][x] and values [D][B], both D * B long.
    const std::uint32_t head_off = static_cast<std::uint32_t>(kh) * (D * B);
    for (int u = prefill_tid(); u < C::kBN * kD8; u += C::kThreads) {
      // 8-element pieces u = si * (kD8 * bt) + pc: segment si, piece pc of it
      const int si = (u >> lbt) / kD8;
      const int pc = u - ((si * kD8) << lbt);
      const int t_seg = t0 + (si << lbt), o0 = t_seg & (B - 1);  // the segment's first token, its slot
      const bool live = t_seg < kv_end && t_seg >= kv_lo;  // kv_lo: block-aligned
      const int blk = live ? prefill_block_id(p, table, t_seg >> lb) : 0;
      // keys [D/x][B][x]: piece pc = (chunk * bt + token) * kH + half
      const int tok = (pc / kH) & (bt - 1), chunk = (pc / kH) >> lbt, half = pc % kH;
      const std::uint32_t ko =
          head_off + static_cast<std::uint32_t>((chunk << lb) + o0 + tok) * kX + half * 8;
      prefill_load8<T, F>(ks + ((si << lbt) + tok) * C::kPitch + chunk * kX + half * 8,
                          static_cast<const E*>(p.key_cache) + blk * p.k_block_stride + ko,
                          live && t_seg + tok < kv_end ? 8 : 0);
      if (bt >= 8) {  // values [D][B]: piece pc = dim * (bt / 8) + group of 8 tokens
        const int vd = pc >> (lbt - 3), vt = (pc & (bt / 8 - 1)) * 8;
        const std::uint32_t vo = head_off + static_cast<std::uint32_t>((vd << lb) + o0 + vt);
        prefill_load8<T, F>(vs + vd * C::kVtPitch + (si << lbt) + vt,
                            static_cast<const E*>(p.value_cache) + blk * p.v_block_stride + vo,
                            live ? min(8, max(0, kv_end - (t_seg + vt))) : 0);
      }
    }
    if (B < 8) {
      // A block's run of one dim is shorter than an 8-element piece: values element by
      // element (zeros past kv_end), converted as prefill_load8 converts.
      for (int u = prefill_tid(); u < D * C::kBN; u += C::kThreads) {
        const int vd = u / C::kBN, tt = u % C::kBN, t = t0 + tt;
        T v = from_float<T>(0.0f);
        if (t < kv_end && t >= kv_lo) {
          const std::int64_t vi = prefill_block_id(p, table, t >> lb) * p.v_block_stride + head_off +
                                  static_cast<std::uint32_t>((vd << lb) + (t & (B - 1)));
          if constexpr (F == KVCacheDType::kAuto) v = reinterpret_cast<const T*>(vc)[vi];
          else v = from_float<T>(fp8_to_float<F>(vc[vi]));
        }
        vs[vd * C::kVtPitch + tt] = v;
      }
    }
  }
}

template <class T, KVCacheDType F, int D, CacheLayout L>
__global__ void __launch_bounds__(PrefillMmaConfig<T, F, D, L>::kThreads, PrefillMmaConfig<T, F, D, L>::kMinBlocks)
    prefill_mma_kernel(const __grid_constant__ PrefillKernelParams p) {
  using C = PrefillMmaConfig<T, F, D, L>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + C::kQOffset);
  T* ks_base = reinterpret_cast<T*>(smem);
  T* vs_base = reinterpret_cast<T*>(smem + 2 * C::kKBytes);

  // The CTA's work, read by warp 0 alone and shared: every thread counts the same key
  // tiles, so all meet each tile's barriers even if a caller changes the index arrays
  // while the kernel runs.
  __shared__ PrefillItem item_slot;
  const PrefillItem w = prefill_shared_item<C::kBM, true>(p, &item_slot);
  if (w.kind == kItemSkip) return;
  const int kh = blockIdx.y, s = w.seq;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = p.group;
  const int rows = w.rows, r_lo = w.r_lo, r_hi = w.r_hi;
  if (w.kind == kItemNaN) {
    prefill_fill_nan<T>(p, w.row0, kh, r_lo, w.r_end);
    return;
  }
  const int ctx = w.ctx, kv_end = w.kv_end;
  // Sliding window: the key tiles start at the tile holding the first row's window start
  // and the blocks before its block are never read.
  const int kv_begin = w.kv_begin;
  const int kv_lo = kv_begin / p.block_size * p.block_size;
  if (!prefill_blocks_ok(p, s, kv_begin, kv_end)) {
    prefill_fill_nan<T>(p, w.row0, kh, r_lo, r_hi);
    return;
  }
  const std::int32_t* table = p.block_tables + static_cast<std::int64_t>(s) * p.max_blocks_per_seq;
  // The key tile starting at t0 (a multiple of kBN) lives in ring stage t0 / kBN % 2; the
  // tiles run from the one holding kv_begin to the one holding kv_end - 1. Only the first
  // may hold keys before kv_begin: the later ones load with no lower bound (kv_lo = 0).
  const int t_first = kv_begin / C::kBN * C::kBN;
  const int stage_first = t_first / C::kBN & 1;

  if constexpr (!C::kQInRegs) {  // Q has room of its own: the first key tile loads meanwhile
    prefill_load_tile<C, T, F, D, L>(p, table, kh, t_first, kv_lo, kv_end,
                                     ks_base + stage_first * (C::kKBytes / 2),
                                     vs_base + stage_first * (C::kVBytes / 2));
    cp_async_commit();
  }
  // Q tile (rows past the sequence's are zeros), element by element: the query may be
  // strided without 16-byte alignment.
  for (int i = threadIdx.x; i < C::kBM * D; i += C::kThreads) {
    const int rr = i / D, d = i % D, r = r_lo + rr;
    T v = from_float<T>(0.0f);
    if (r < rows) {
      const int tok = w.row0 + r / G, h = kh * G + r % G;
      v = static_cast<const T*>(p.query)[tok * p.q_stride_tok + h * p.q_stride_head + d];
    }
    qs[rr * C::kPitch + d] = v;
  }
  __syncthreads();
  constexpr int MT = C::kMT;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile
  // A fragment of m-tile mt, k-step kk, from the staged Q tile.
  auto q_frag = [&](std::uint32_t (&a)[4], int mt, int kk) {
    const int m = lane / 8;
    ldmatrix_x4(a, qs + (wrow + mt * 16 + (m % 2) * 8 + lane % 8) * C::kPitch + kk * 16 + (m / 2) * 8);
  };
  std::uint32_t qf[C::kQInRegs ? D / 16 : 1][4];
  if constexpr (C::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) q_frag(qf[kk], 0, kk);
    __syncthreads();  // the ring's first stage overwrites the staged Q tile
    prefill_load_tile<C, T, F, D, L>(p, table, kh, t_first, kv_lo, kv_end,
                                     ks_base + stage_first * (C::kKBytes / 2),
                                     vs_base + stage_first * (C::kVBytes / 2));
    cp_async_commit();
  }

  // This thread's rows: C fragment rows lane / 4 and lane / 4 + 8 of each m-tile.
  int pos[MT][2];
  float slope[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r_lo + wrow + mt * 16 + lane / 4 + hr * 8;
      pos[mt][hr] = r < rows ? ctx + r / G : -1;  // -1: a padding row, every key masked
      slope[mt][hr] = (p.alibi_slopes && r < rows) ? p.alibi_slopes[kh * G + r % G] * kLog2e : 0.0f;
    }
  }
  const int min_pos = ctx + r_lo / G;  // the CTA's first row
  // keys pos - t in [0, wlim) are visible to the row at pos (one unsigned compare; padding
  // rows, pos = -1, see none); with a window, tiles before the last row's window start
  // are masked element by element too
  const unsigned wlim = p.sliding_window > 0 ? static_cast<unsigned>(p.sliding_window) : 0x80000000u;
  const int max_first = prefill_window_first(p, ctx + (r_hi - 1) / G);

  float o[MT][D / 8][4] = {};
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.0f;
  }
  for (int t0 = t_first; t0 < kv_end; t0 += C::kBN) {
    const int stage = t0 / C::kBN & 1;
    if (t0 + C::kBN < kv_end) {
      const int nxt = stage ^ 1;
      // the block table's row again from s (one register across the loop, not a pointer's two)
      const std::int32_t* row =
          p.block_tables + static_cast<std::int64_t>(prefill_opaque(s)) * p.max_blocks_per_seq;
      prefill_load_tile<C, T, F, D, L>(p, row, kh, t0 + C::kBN, 0, kv_end,
                                       ks_base + nxt * (C::kKBytes / 2), vs_base + nxt * (C::kVBytes / 2));
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = ks_base + stage * (C::kKBytes / 2);
    const T* vs = vs_base + stage * (C::kVBytes / 2);
    if (t0 < kv_begin) {
      // The window's first tile: the values of its block's slots before the window came in
      // with the copies and are zeroed, so they never meet a product (their logits are
      // masked below; a key only reaches its own column).
      T* v = vs_base + stage * (C::kVBytes / 2);
      const int n = kv_begin - t0;
      // (counted down from n * D, so that nothing of it is computed before the loop and
      // kept live across it)
      for (int i = n * D - 1 - static_cast<int>(threadIdx.x); i >= 0; i -= C::kThreads) {
        const int tt = i / D, d = i % D;
        v[L == CacheLayout::kVLLM ? d * C::kVtPitch + tt : tt * C::kPitch + d] = from_float<T>(0.0f);
      }
      __syncthreads();
    }

    float sc[MT][C::kBN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (C::kQInRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[kk][i];
        } else {
          q_frag(a[mt], mt, kk);
        }
      }
#pragma unroll
      for (int np = 0; np < C::kBN / 16; ++np) {
        const int m = lane / 8;
        std::uint32_t b[4];
        ldmatrix_x4(b, ks + (np * 16 + (m / 2) * 8 + lane % 8) * C::kPitch + kk * 16 + (m % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(sc[mt][2 * np], a[mt], b[0], b[1]);
          mma16816<T>(sc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // the scores as base-2 logits, soft-capped when on: a uniform branch around a loop of
    // its own, so the plain call runs the same instructions as without the option
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < C::kBN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][n][e] *= p.qk_scale_log2;
    if (p.soft_cap_log2 > 0.f) {  // one form only: two unrolled loops of the tile spilled
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < C::kBN / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sc[mt][n][e] = soft_cap_logit<false>(sc[mt][n][e], p.soft_cap_log2, p.inv_soft_cap_log2);
    }

    const bool masked = t0 + C::kBN - 1 > min_pos || t0 < max_first;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < C::kBN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hr = e / 2;
          const int t = t0 + n * 8 + 2 * (lane % 4) + (e & 1);
          float x = sc[mt][n][e];
          if (p.alibi_slopes) x += slope[mt][hr] * static_cast<float>(t - pos[mt][hr]);
          if (masked && static_cast<unsigned>(pos[mt][hr] - t) >= wlim) x = -INFINITY;
          sc[mt][n][e] = x;
          mx[hr] = fmaxf(mx[hr], x);
        }
      }
      float corr[2], m_use[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        const float m_new = fmaxf(m_run[mt][hr], mx[hr]);
        m_use[hr] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no visible key yet
        corr[hr] = exp2f(m_run[mt][hr] - m_use[hr]);
        m_run[mt][hr] = m_new;
        l_run[mt][hr] *= corr[hr];
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[mt][n][0] *= corr[0];
        o[mt][n][1] *= corr[0];
        o[mt][n][2] *= corr[1];
        o[mt][n][3] *= corr[1];
      }
#pragma unroll
      for (int n = 0; n < C::kBN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float w = exp2f(sc[mt][n][e] - m_use[e / 2]);
          sc[mt][n][e] = w;
          l_run[mt][e / 2] += w;
        }
      }
    }

#pragma unroll
    for (int ks16 = 0; ks16 < C::kBN / 16; ++ks16) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<T>(sc[mt][2 * ks16][0], sc[mt][2 * ks16][1]);
        a[mt][1] = pack2<T>(sc[mt][2 * ks16][2], sc[mt][2 * ks16][3]);
        a[mt][2] = pack2<T>(sc[mt][2 * ks16 + 1][0], sc[mt][2 * ks16 + 1][1]);
        a[mt][3] = pack2<T>(sc[mt][2 * ks16 + 1][2], sc[mt][2 * ks16 + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        const int m = lane / 8;
        std::uint32_t b[4];
        if constexpr (L == CacheLayout::kVLLM) {
          ldmatrix_x4(b, vs + (dn * 16 + (m / 2) * 8 + lane % 8) * C::kVtPitch + ks16 * 16 + (m % 2) * 8);
        } else {
          ldmatrix_x4_trans(b, vs + (ks16 * 16 + (m % 2) * 8 + lane % 8) * C::kPitch + dn * 16 + (m / 2) * 8);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * dn], a[mt], b[0], b[1]);
          mma16816<T>(o[mt][2 * dn + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration's loads
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = l_run[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int r = r_lo + wrow + mt * 16 + lane / 4 + hr * 8;
      if (r >= rows) continue;
      const int tok = w.row0 + r / G, h = kh * G + r % G;
      T* orow = static_cast<T*>(p.out) + tok * p.o_stride_tok + h * p.o_stride_head;
      const float inv = p.v_scale / (l + prefill_sink(p, h, m_run[mt][hr]));
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int d = n * 8 + 2 * (lane % 4);
        orow[d] = from_float<T>(o[mt][n][2 * hr] * inv);
        orow[d + 1] = from_float<T>(o[mt][n][2 * hr + 1] * inv);
      }
    }
  }
}

}  // namespace pagedattn::cuda_backend
