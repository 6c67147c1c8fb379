// Hopper (sm_90a) varlen kernel: the online-softmax attention of prefill_mma.cuh with
// both matrix products on warpgroup MMA (wgmma) and warp-specialised loading.
//
// One CTA = (tile of kBM = 128 packed (token, group head) rows, KV head, sequence), the
// rows token-major as in prefill_mma.cuh, so the G query heads of a GQA group share every
// key and value tile. Three warpgroups:
//   - the producer (128 threads, few registers) gathers Q and the key / value tiles of
//     kBN = 128 tokens through the block table with cp.async into a ring of kStages
//     shared-memory stages; each copy's completion is tracked by an mbarrier (full[s]),
//     so the producer never waits for its own loads, only for a stage to come free
//     (empty[s]);
//   - two consumers (64 rows each, most registers) compute, each at its own pace:
//       S (64 x 128, float32, registers) = Q (shared) K^T (shared)    wgmma m64n128k16
//       online softmax on S in registers (base 2; the masks and variants of prefill_mma.cuh)
//       O (64 x D, float32, registers) += P (registers, 16-bit) V (shared)   wgmma m64nDk16
//     and the product S of tile i is issued together with P V of tile i - 1, so that the
//     softmax of tile i overlaps the latter on the tensor cores.
// On a long flat grid the kernel is persistent (PrefillKernelParams::persistent): one CTA
// per multiprocessor takes work items from a counter (prefill_item_index); the producer finds each
// item's work (prefill_item_warp), fills an invalid sequence's rows with NaN itself, and
// hands the rest to the consumers through two slots guarded by mbarriers, while the stage
// ring and Q's barriers run on across items, so the next item's loads overlap the current
// item's last products and stores. Otherwise each CTA takes the one item of its grid cell.
// The tiles land in a layout the tensor cores read, so no fragment passes through
// registers on its way to an MMA: the 128-byte swizzle for Q and the token-major layouts;
// for the vllm layout, keys unswizzled K-major (8 x 16-byte core matrices) and values in
// rows as wide as a block's dim row (up to 128 bytes) with the matching swizzle, so that
// its key pieces and value blocks ([D][B]) copy contiguously on both sides (vllm_k_off,
// vllm_v_off). V is read as MN-major (transposed) for the token-major layouts and as
// K-major for the vllm layout: each layout's tile is stored in its cache's own order.
//
// Shared memory, every region 1024-byte aligned (the swizzle atom: 8 rows of 128 bytes,
// 16-byte chunk j of row r stored at chunk j ^ (r % 8)):
//   Q  [D / 64][kBM rows][64 elements]
//   K  nhd: [D / 64][kBN tokens][64 elements]; vllm: [D / 8][kBN tokens][8]      x kStages
//   V  nhd: as K;  vllm: [kBN / (W / 2)][D dims][W / 2 tokens], W = 16 << sw      x kStages
//   the mbarriers, the two item slots, the producer's item lookups, and the block ids of
//   the tiles being loaded
#pragma once

#include "cuda/prefill_params.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace pagedattn::cuda_backend::sm90 {

// Byte offset of 16-byte chunk `chunk` (of 8 elements) of row `row` in a swizzled region
// of `rows` rows per 64-element column block.
__device__ __forceinline__ std::uint32_t swz(int rows, int row, int chunk) {
  return static_cast<std::uint32_t>(((chunk >> 3) * rows + row) * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// A shared-memory matrix descriptor: start address, leading byte offset, stride byte
// offset, layout (1: the 128-byte swizzle, 2: 64-byte, 3: 32-byte, 0: none). Swizzled
// layouts: leading offset between 64-element column blocks (MN-major; unused for K-major),
// stride offset between groups of 8 rows. Unswizzled K-major: leading offset between core
// matrices adjacent in K, stride offset between core matrices adjacent in M / N.
__device__ __forceinline__ std::uint64_t smem_desc(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo,
                                                   int layout = 1) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>(lbo >> 4) << 16) |
         (static_cast<std::uint64_t>(sbo >> 4) << 32) | (static_cast<std::uint64_t>(layout) << 62);
}

// The vllm tiles are laid out so that both sides of every copy are contiguous: keys in
// the tensor cores' unswizzled K-major layout (core matrices of 8 rows x 16 bytes, 128
// contiguous bytes; the cache's pieces of one dim chunk are consecutive tokens),
//   K [D / 8 dim chunks][kBN tokens][8 dims],
// values K-major in rows of W = 16 << sw bytes (sw = value_swizzle(lg_b)), one row per
// dim holding W / 2 consecutive tokens, as the cache's [D][B] block holds them:
//   V [kBN / (W / 2) token columns][D dims][W bytes], swizzled in 16-byte units over
//   8 rows (none for W = 16; the 32-, 64- and 128-byte swizzles otherwise),
// so a warp's value copy reads whole dim rows of a block and writes whole rows here.
// Byte offset of key token `row`, dim chunk `chunk`:
template <int BN>
__device__ __forceinline__ std::uint32_t vllm_k_off(int row, int chunk) {
  return static_cast<std::uint32_t>((chunk * BN + row) * 16);
}
// The value rows' width for pages of 1 << lg_b tokens: 16 bytes (pages of 8 or less), 32
// (16), 64 (32), 128 (64 and more); W = 16 << value_swizzle(lg_b).
__device__ __forceinline__ int value_swizzle(int lg_b) { return min(max(lg_b - 3, 0), 3); }
// Byte offset of the value of dim d, token tt, in rows of 16 << sw bytes.
template <int D>
__device__ __forceinline__ std::uint32_t vllm_v_off(int sw, int d, int tt) {
  const int lg_w = 4 + sw;
  const std::uint32_t off =
      static_cast<std::uint32_t>((((2 * tt) >> lg_w) * D + d) << lg_w) + ((2 * tt) & ((1 << lg_w) - 1));
  return off ^ (((off >> 7) & ((1u << sw) - 1)) << 4);
}

template <class T, int D, CacheLayout L>
struct PrefillSm90Config {
  static constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
  static constexpr int kBM = 128;
  static constexpr int kBN = 128;
  static constexpr int kStages = D == 128 ? 3 : 4;
  // Registers per thread after setmaxnreg (multiples of 8). setmaxnreg only moves
  // registers within what the CTA got at launch, 384 x 168 (the cap of
  // __launch_bounds__(384, 1)): 128 x producer + 256 x consumer must stay within it, or
  // the consumers' increase waits forever. 72 / 216 is that budget exactly: the consumers
  // hold O, S and P of their 64 rows in 216 without spilling (at 200 the vllm consumers
  // spilled P in the key loop).
  static constexpr int kProducerRegs = 72;
  static constexpr int kConsumerRegs = 216;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "more registers than the CTA holds");
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKBytes = kBN * D * 2;
  static constexpr int kVBytes = kBN * D * 2;
  static constexpr int kStageBytes = kKBytes + kVBytes;
  // mbarriers: full[kStages], empty[kStages], q_full, q_empty, item_full[2], item_empty[2]
  static constexpr int kBarOffset = kQBytes + kStages * kStageBytes;
  static constexpr int kSlotOffset = kBarOffset + 8 * (2 * kStages + 6);  // 16-byte aligned
  static constexpr int kLookupOffset = kSlotOffset + 2 * 64;  // Sm90Slot[2], then Sm90Lookup[2]
  static constexpr int kIdsOffset = kLookupOffset + 2 * 64;
  static constexpr int kSmemBytes = kIdsOffset + 2 * kBN * 4 + 1024;
};

// 2^x in one MUFU instruction (results below 2^-126 flush to zero: weights that small
// vanish beside the row's maximum, whose weight is 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The producer's copies of one key / value tile (128 threads), with shifts and masks for
// the page size (a power of two on CUDA, 1 << lg_b) and the block ids of the tile's
// tokens read from shared memory (ids). Keys and values before kv_begin (a window's first
// tile) are never read: zero-filled by the copy, or, for a vllm value piece of 8 tokens
// that straddles kv_begin, loaded, cleared below kv_begin and stored by this thread
// (returns true then: the caller must wait for its copies and fence before it arrives).
template <class C, class T, int D, CacheLayout L>
__device__ __forceinline__ bool produce_kv_tile(const PrefillKernelParams& p, const std::int32_t* ids, int kh,
                                                int t0, int kv_begin, int kv_end, unsigned char* ks,
                                                unsigned char* vs, int ptid, int lg_b) {
  const int B = 1 << lg_b;
  const auto* kc = static_cast<const T*>(p.key_cache);
  const auto* vc = static_cast<const T*>(p.value_cache);
  constexpr int kChunks = D / 8;
  constexpr int kLgChunks = D == 128 ? 4 : 3;
  bool stored = false;
  if constexpr (L == CacheLayout::kNHD) {
    // Eight threads per 128-byte half row (whole lines per warp instruction), 16 tokens
    // per pass: one address per token and thread for its D / 64 halves of K and V.
    // Strides that fit 32 bits (PrefillKernelParams::strides32; every cache short of a
    // block of 2^31 elements) make a token's source one 32 x 32 -> 64-bit multiply-add per
    // operand instead of 64-bit products: the producer's instructions take the issue slots
    // of the consumers' softmax (PERF_NOTES.md, "the producer's share of the issue slots").
    // A tile wholly inside [kv_begin, kv_end) (all but a sequence's last and a window's
    // first) copies with no per-token check.
    const int c8 = ptid & 7, r16 = ptid >> 3;
    auto copy_tile = [&](auto wide_c) {
      constexpr bool kWide = decltype(wide_c)::value;
      auto copy_token = [&](int k, bool live) {
        const int tt = r16 + 16 * k;
        const int blk = live ? ids[tt] : 0;
        const T* ksrc;
        const T* vsrc;
        if constexpr (kWide) {
          const std::int64_t row = ((t0 + tt) & (B - 1)) * p.tok_stride + kh * p.head_stride + c8 * 8;
          ksrc = kc + (blk * p.k_block_stride + row);
          vsrc = vc + (blk * p.v_block_stride + row);
        } else {
          const int row = ((t0 + tt) & (B - 1)) * static_cast<int>(p.tok_stride) +
                          kh * static_cast<int>(p.head_stride) + c8 * 8;
          ksrc = kc + (static_cast<std::int64_t>(blk) * static_cast<int>(p.k_block_stride) + row);
          vsrc = vc + (static_cast<std::int64_t>(blk) * static_cast<int>(p.v_block_stride) + row);
        }
        const int n = live ? 16 : 0;
#pragma unroll
        for (int h = 0; h < D / 64; ++h) {
          const std::uint32_t o = swz(C::kBN, tt, h * 8 + c8);
          cp_async16(ks + o, ksrc + h * 64, n);
          cp_async16(vs + o, vsrc + h * 64, n);
        }
      };
      if (t0 >= kv_begin && t0 + C::kBN <= kv_end) {
#pragma unroll 4
        for (int k = 0; k < C::kBN / 16; ++k) copy_token(k, true);
      } else {
#pragma unroll 2
        for (int k = 0; k < C::kBN / 16; ++k) {
          const int t = t0 + r16 + 16 * k;
          copy_token(k, t < kv_end && t >= kv_begin);
        }
      }
    };
    if (p.strides32)
      copy_tile(std::false_type{});
    else
      copy_tile(std::true_type{});
  } else if (t0 >= kv_begin) {
    // vllm, a tile without window-excluded tokens (every tile but a window's first): one
    // address per thread and operand, the rest constant strides; tokens from kv_end on
    // (a sequence's last tile) are zero-filled by the copies' source sizes (their ids
    // read as 0: an address inside the pool, no byte read).
    // Keys [D/8][B][8]: thread = token, its D / 8 pieces one block row (B pieces) apart;
    // a warp's instruction reads whole runs of B consecutive pieces.
    {
      const int tt = ptid, t = t0 + tt;
      const int nk = t < kv_end ? 16 : 0;  // 16 on every tile but the last
      const T* src = kc + static_cast<std::int64_t>(ids[tt]) * p.k_block_stride +
                     ((static_cast<std::int64_t>(kh * kChunks) << lg_b) + (t & (B - 1))) * 8;
      // (a pointer stepped by a 32-bit stride: an index times a 64-bit stride costs a wide
      // multiply per copy, which the producer's issue slots, shared with the consumers,
      // cannot afford)
      const int row = 8 << lg_b;  // elements between a token's pieces
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        cp_async16(ks + vllm_k_off<C::kBN>(tt, c), src, nk);
        src += row;
      }
    }
    // Values [D][B] (vllm_v_off's rows):
    if (lg_b < 3) {
      // Pages of 2 and 4: a block's run of a dim row (B elements, 4 or 8 bytes) is one copy
      // each; consecutive threads take consecutive dims of one block (its [D, B] slab is
      // contiguous), written at their tokens' place in the stage's 16-byte units.
#pragma unroll 4
      for (int u = ptid; u < (C::kBN * D) >> lg_b; u += 128) {
        const int vd = u & (D - 1), tt = (u >> (kLgChunks + 3)) << lg_b;
        const T* src = vc + static_cast<std::int64_t>(ids[tt]) * p.v_block_stride +
                       (static_cast<std::int64_t>(kh * D + vd) << lg_b);
        unsigned char* dst = vs + vllm_v_off<D>(0, vd, tt);
        const int nb = 2 * min(B, max(0, kv_end - (t0 + tt)));
        if (lg_b == 2)
          cp_async8(dst, src, nb);
        else
          cp_async4(dst, src, nb);
      }
    } else {
      // Pages of 8 and more: 1 << sw lanes take one dim row of W = 16 << sw bytes (W / 2
      // tokens of one block), so a warp instruction reads and writes 512 contiguous bytes
      // (pages of 8 to 64) or 128-byte lines (larger pages), whole sectors on both sides.
      // A thread's pieces: rows r0 + k * (128 >> sw) of the [token column][dim] rows.
      // (kTail: the sequence's last tile, pieces clipped at kv_end; the other tiles copy
      // whole pieces, with no size computed)
      auto copy_rows = [&](auto sw_c, auto tail_c) {
        constexpr int sw = decltype(sw_c)::value, kStep = 128 >> sw;  // rows between a thread's pieces
        constexpr bool kTail = decltype(tail_c)::value;
        auto piece_bytes = [&](int tt) { return kTail ? 2 * min(8, max(0, kv_end - (t0 + tt))) : 16; };
        constexpr int kCols = (2 * C::kBN) >> (4 + sw);  // token columns of the tile
        const int q = ptid & ((1 << sw) - 1), r0 = ptid >> sw;
        // Consecutive pieces of a thread lie kStep rows = 2048 bytes apart (a multiple of
        // the swizzle's 1024-byte period): one offset, then immediates.
        static_assert(kStep * (16 << sw) == 2048, "2048 bytes between a thread's value pieces");
        unsigned char* dst = vs + vllm_v_off<D>(sw, r0 & (D - 1), (r0 / D) * (8 << sw) + q * 8);
        if constexpr (kStep >= D) {  // every piece at dim r0 % D, token columns r0 / D + k * kStep / D
          const int d = r0 & (D - 1);
#pragma unroll 4
          for (int k = 0; k < kCols * D / kStep; ++k) {
            const int tt = (r0 / D + k * (kStep / D)) * (8 << sw) + q * 8;
            const T* src = vc + static_cast<std::int64_t>(ids[tt]) * p.v_block_stride +
                           (static_cast<std::int64_t>(kh * D + d) << lg_b) + ((t0 + tt) & (B - 1));
            cp_async16(dst + 2048 * k, src, piece_bytes(tt));
          }
        } else {  // dims r0 + i * kStep of every token column
#pragma unroll 2
          for (int col = 0; col < kCols; ++col) {
            const int tt = col * (8 << sw) + q * 8;
            const T* src = vc + static_cast<std::int64_t>(ids[tt]) * p.v_block_stride +
                           (static_cast<std::int64_t>(kh * D + r0) << lg_b) + ((t0 + tt) & (B - 1));
            const int nv = piece_bytes(tt);
#pragma unroll
            for (int i = 0; i < D / kStep; ++i)
              cp_async16(dst + 2048 * (col * (D / kStep) + i),
                         src + (static_cast<std::int64_t>(i * kStep) << lg_b), nv);
          }
        }
      };
      auto copy_sw = [&](auto tail_c) {
        switch (value_swizzle(lg_b)) {
          case 0:
            copy_rows(std::integral_constant<int, 0>{}, tail_c);
            break;
          case 1:
            copy_rows(std::integral_constant<int, 1>{}, tail_c);
            break;
          case 2:
            copy_rows(std::integral_constant<int, 2>{}, tail_c);
            break;
          default:
            copy_rows(std::integral_constant<int, 3>{}, tail_c);
            break;
        }
      };
      if (t0 + C::kBN <= kv_end)
        copy_sw(std::false_type{});
      else
        copy_sw(std::true_type{});
    }
  } else {
    // vllm, a window's first tile (tokens before kv_begin): segments of bt tokens inside one
    // block each (whole blocks, or the tile's part of one); consecutive threads take
    // consecutive 16-byte pieces of the cache.
    const int lg_bt = min(lg_b, 7), bt = 1 << lg_bt;
    auto seg_block = [&](int si, int t_seg) -> std::int64_t {
      return ids[si * bt + (t_seg < kv_begin ? kv_begin - t_seg : 0)];
    };
    // keys [D/8][B][8]: piece u = (segment, chunk, token)
#pragma unroll 4
    for (int u = ptid; u < C::kBN * kChunks; u += 128) {
      const int si = u >> (lg_bt + kLgChunks), chunk = (u >> lg_bt) & (kChunks - 1), tok = u & (bt - 1);
      const int t_seg = t0 + si * bt, tk = t_seg + tok;
      const bool seg_live = t_seg < kv_end && t_seg + bt > kv_begin;
      const std::int64_t blk = seg_live ? seg_block(si, t_seg) : 0;
      const std::int64_t ki = blk * p.k_block_stride +
                              ((static_cast<std::int64_t>(kh * kChunks + chunk) << lg_b) + (t_seg & (B - 1)) + tok) * 8;
      cp_async16(ks + vllm_k_off<C::kBN>(si * bt + tok, chunk), kc + ki,
                 seg_live && tk < kv_end && tk >= kv_begin ? 16 : 0);
    }
    if (lg_b < 3) {
      // values of pages of 2 and 4: piece u = (segment, dim), the block's run of the dim row
      // (B elements), zero-filled past kv_end; a run straddling kv_begin goes through
      // registers with its elements before it cleared
#pragma unroll 4
      for (int u = ptid; u < (C::kBN * D) >> lg_b; u += 128) {
        const int vd = u & (D - 1), tt = (u >> (kLgChunks + 3)) << lg_b, tv = t0 + tt;
        const bool seg_live = tv < kv_end && tv + B > kv_begin;
        const std::int64_t blk = seg_live ? seg_block(tt >> lg_b, tv) : 0;
        const T* src = vc + blk * p.v_block_stride + (static_cast<std::int64_t>(kh * D + vd) << lg_b);
        unsigned char* dst = vs + vllm_v_off<D>(0, vd, tt);
        if (seg_live && tv < kv_begin) {
          std::uint16_t e[4];
          if (lg_b == 2)
            *reinterpret_cast<uint2*>(e) = *reinterpret_cast<const uint2*>(src);
          else
            *reinterpret_cast<std::uint32_t*>(e) = *reinterpret_cast<const std::uint32_t*>(src);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (tv + k < kv_begin || tv + k >= kv_end) e[k] = 0;
          if (lg_b == 2)
            *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(e);
          else
            *reinterpret_cast<std::uint32_t*>(dst) = *reinterpret_cast<const std::uint32_t*>(e);
          stored = true;
        } else {
          const int nb = seg_live ? 2 * min(B, kv_end - tv) : 0;
          if (lg_b == 2)
            cp_async8(dst, src, nb);
          else
            cp_async4(dst, src, nb);
        }
      }
      return stored;
    }
    // values [D][B]: piece u = (segment, dim, 8 tokens)
    const int lg_vp = lg_bt - 3;  // pieces per dim row of a segment
#pragma unroll 4
    for (int u = ptid; u < C::kBN * D / 8; u += 128) {
      const int si = u >> (lg_vp + kLgChunks + 3), vd = (u >> lg_vp) & (D - 1), vt = (u & ((1 << lg_vp) - 1)) * 8;
      const int t_seg = t0 + si * bt, tv = t_seg + vt;  // the piece's first token
      const bool seg_live = t_seg < kv_end && t_seg + bt > kv_begin;
      const std::int64_t blk = seg_live ? seg_block(si, t_seg) : 0;
      const std::int64_t vi =
          blk * p.v_block_stride + (static_cast<std::int64_t>(kh * D + vd) << lg_b) + (t_seg & (B - 1)) + vt;
      unsigned char* dst = vs + vllm_v_off<D>(value_swizzle(lg_b), vd, si * bt + vt);
      if (seg_live && tv < kv_begin && tv + 8 > kv_begin) {
        // straddles the window start: the elements before it become zeros
        uint4 raw = *reinterpret_cast<const uint4*>(vc + vi);
        auto* e = reinterpret_cast<std::uint16_t*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (tv + k < kv_begin || tv + k >= kv_end) e[k] = 0;
        *reinterpret_cast<uint4*>(dst) = raw;
        stored = true;
      } else {
        cp_async16(dst, vc + vi, seg_live && tv >= kv_begin ? 2 * min(8, max(0, kv_end - tv)) : 0);
      }
    }
  }
  return stored;
}

// The producer warp's reading of an item, shared with its warpgroup.
struct Sm90Lookup {
  PrefillItem item;
  int kh;
};
static_assert(sizeof(Sm90Lookup) <= 64, "a lookup is 64 bytes of shared memory");

// An item handed from the producer to the consumers (two slots, in turn).
struct Sm90Slot {
  PrefillItem item;
  int kh;
  int bad;  // set by the producer when it read a block id outside the pool for this item
};
static_assert(sizeof(Sm90Slot) <= 64, "a slot is 64 bytes of shared memory");

template <class T, int D, CacheLayout L>
__global__ void __launch_bounds__(384, 1) prefill_sm90_kernel(const __grid_constant__ PrefillKernelParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = PrefillSm90Config<T, D, L>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const std::uint32_t raw_addr = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  unsigned char* qs = smem;
  unsigned char* kv_base = smem + C::kQBytes;
  const std::uint32_t bar = smem_addr(smem + C::kBarOffset);
  auto full_bar = [&](int s) { return bar + 8 * s; };
  auto empty_bar = [&](int s) { return bar + 8 * (C::kStages + s); };
  const std::uint32_t q_full = bar + 16 * C::kStages, q_empty = q_full + 8;
  auto item_full = [&](int s) { return q_full + 16 + 8 * s; };
  auto item_empty = [&](int s) { return q_full + 32 + 8 * s; };
  Sm90Slot* slots = reinterpret_cast<Sm90Slot*>(smem + C::kSlotOffset);
  const int G = p.group;

  if (threadIdx.x == 0) {
    for (int i = 0; i < C::kStages; ++i) {
      mbar_init(full_bar(i), 128);   // every producer thread, once its copies landed
      mbar_init(empty_bar(i), 256);  // every consumer thread, once done with the stage
    }
    mbar_init(q_full, 128);
    mbar_init(q_empty, 256);
    for (int i = 0; i < 2; ++i) {
      mbar_init(item_full(i), 1);     // the producer's thread 0, once the slot is written
      mbar_init(item_empty(i), 256);  // every consumer thread, once done with the item
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The CTA walks its items (prefill_item_index: one, or with a persistent grid
  // several): the producer finds each item's work (one warp reads it from the index
  // arrays, prefill_item_warp; every thread takes its control flow from that one read,
  // so the warpgroups agree on every barrier whatever a caller does to the arrays during
  // the call), fills an invalid sequence's rows with NaN itself, and hands the others to
  // the consumers through the item slots while it loads their Q and key / value tiles.
  // The stages' and Q's barriers run on across items, so the loads of the next item
  // overlap the last products and the stores of the current one.
  if (threadIdx.x < 128) {
    // ---- producer ----
    setmaxnreg_dec<C::kProducerRegs>();
    const int ptid = threadIdx.x;
    const T* qg = static_cast<const T*>(p.query);
    const bool q_vec = (reinterpret_cast<std::uintptr_t>(qg) & 15) == 0 && p.q_stride_tok % 8 == 0 &&
                       p.q_stride_head % 8 == 0;
    // The block id of each token of a tile goes through shared memory (one table read
    // per thread per tile, issued a tile ahead) instead of one read per copy.
    std::int32_t* ids_s = reinterpret_cast<std::int32_t*>(smem + C::kIdsOffset);  // [2][kBN]
    Sm90Lookup* lookup = reinterpret_cast<Sm90Lookup*>(smem + C::kLookupOffset);  // [2]
    const int lg_b = __ffs(p.block_size) - 1;  // page sizes are powers of two
    int g = 0;  // key tiles produced, over all items
    int n = 0;  // items handed to the consumers
    int next = 0;  // lane 0 of warp 0: the item index prefetched from the counter
    for (int k = 0;; ++k) {
      // Warp 0 takes the item's index (lane 0) and finds its work; the warpgroup reads both
      // from shared memory (double-buffered: the next item's lookup may start before every
      // thread has read this one's).
      if (ptid < 32) {
        int j = ptid == 0 ? prefill_item_index(p, k, next) : 0;
        j = __shfl_sync(0xffffffffu, j, 0);
        PrefillItem it{};
        it.kind = kItemEnd;
        int c = 0, kh = 0;
        if (j >= 0) {
          prefill_item_tile(p, j, c, kh);
          it = prefill_item_warp<C::kBM>(p, c, p.persistent ? p.tiles - 1 : gridDim.x - 1);
        }
        if (ptid == 0) {
          lookup[k & 1].item = it;
          lookup[k & 1].kh = kh;
        }
      }
      asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warpgroup alone
      const PrefillItem w = lookup[k & 1].item;
      const int kh = lookup[k & 1].kh;
      if (w.kind == kItemSkip) continue;
      if (w.kind == kItemNaN) {
        prefill_fill_nan<T>(p, w.row0, kh, w.r_lo, w.r_end, ptid, 128);
        continue;
      }
      // Hand the item over (or the end): its slot is free once the consumers are done
      // with the item two before.
      const int slot = n & 1;
      if (n >= 2) mbar_wait(item_empty(slot), ((n - 2) >> 1) & 1);
      if (ptid == 0) {
        slots[slot].item = w;
        slots[slot].kh = kh;
        slots[slot].bad = 0;
        mbar_arrive(item_full(slot));
      }
      if (w.kind == kItemEnd) break;
      const int s = w.seq, rows = w.rows, r_lo = w.r_lo;
      const int kv_end = w.kv_end, kv_begin = w.kv_begin;
      const std::int32_t* table = p.block_tables + static_cast<std::int64_t>(s) * p.max_blocks_per_seq;
      const int kt_first = kv_begin / C::kBN;
      const int n_tiles = (kv_end + C::kBN - 1) / C::kBN - kt_first;

      // Q, once the consumers' products with the previous item's Q are done.
      if (n >= 1) mbar_wait(q_empty, (n - 1) & 1);
      ++n;
      if (q_vec) {
        for (int u = ptid; u < C::kBM * (D / 8); u += 128) {
          const int rr = u / (D / 8), ch = u % (D / 8), r = r_lo + rr;
          const T* src = qg;
          if (r < rows) src = qg + static_cast<std::int64_t>(w.row0 + r / G) * p.q_stride_tok +
                              static_cast<std::int64_t>(kh * G + r % G) * p.q_stride_head + ch * 8;
          cp_async16(qs + swz(C::kBM, rr, ch), src, r < rows ? 16 : 0);
        }
        mbar_arrive_cp_async(q_full);
      } else {
        for (int i = ptid; i < C::kBM * D; i += 128) {
          const int rr = i / D, d = i % D, r = r_lo + rr;
          T v = from_float<T>(0.0f);
          if (r < rows) {
            const int tok = w.row0 + r / G, h = kh * G + r % G;
            v = qg[static_cast<std::int64_t>(tok) * p.q_stride_tok + static_cast<std::int64_t>(h) * p.q_stride_head +
                   d];
          }
          *reinterpret_cast<T*>(qs + swz(C::kBM, rr, d / 8) + (d % 8) * 2) = v;
        }
        fence_proxy_async();
        mbar_arrive(q_full);
      }
      // The block ids are checked as they are read (no check ahead of the loads): a bad
      // one is recorded, read as block 0, and turns the item's rows into NaN at the end.
      int bad = 0;
      auto token_id = [&](int i) {
        const int t = (kt_first + i) * C::kBN + ptid;
        if (t < kv_begin || t >= kv_end) return 0;
        const int id = table[t >> lg_b];
        if (id >= 0 && id < p.num_blocks) return id;
        if (!bad) record_error(p.error, DecodeErrorFlag::kBlockId, s, t >> lg_b, id);
        bad = 1;
        return 0;
      };
      std::int32_t id_next = token_id(0);
      for (int i = 0; i < n_tiles; ++i, ++g) {
        const int st = g % C::kStages;
        if (g >= C::kStages) mbar_wait(empty_bar(st), (g / C::kStages - 1) & 1);
        std::int32_t* ids = ids_s + (g & 1) * C::kBN;
        ids[ptid] = id_next;
        asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warpgroup alone
        if (i + 1 < n_tiles) id_next = token_id(i + 1);
        unsigned char* ks = kv_base + st * C::kStageBytes;
        const bool stored = produce_kv_tile<C, T, D, L>(p, ids, kh, (kt_first + i) * C::kBN, kv_begin, kv_end, ks,
                                                        ks + C::kKBytes, ptid, lg_b);
        // A bad id seen: the flag is set before this thread's last arrival for the item, a
        // releasing one (the consumers read the flag once they have waited for that tile).
        const bool flag = bad && i + 1 == n_tiles;
        if (flag) reinterpret_cast<volatile int*>(&slots[slot].bad)[0] = 1;
        if (stored || flag) {
          asm volatile("cp.async.wait_all;\n" ::: "memory");  // every copy of this thread, committed or not
          fence_proxy_async();
          mbar_arrive(full_bar(st));
        } else {
          mbar_arrive_cp_async(full_bar(st));
        }
      }
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<C::kConsumerRegs>();
    const int wg = threadIdx.x / 128 - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int wrow = wg * 64 + warp * 16;
    const std::uint32_t q_addr = smem_addr(qs) + wg * 64 * 128;
    const std::uint32_t kv_addr = smem_addr(kv_base);
    // Descriptors: one base per operand, the k-steps and stages as constant offsets of
    // the start-address field (addresses >> 4; shared memory stays far below its 14 bits).
    constexpr bool kVllm = L == CacheLayout::kVLLM;
    const std::uint64_t q_desc = smem_desc(q_addr, 16, 1024);
    // vllm (vllm_k_off / vllm_v_off): K unswizzled K-major, core matrices adjacent in K a
    // dim chunk apart, adjacent in N 128 bytes apart; V K-major in rows of 16 << vsw
    // bytes, 8 rows a swizzle atom (unswizzled: core matrices adjacent in K a token
    // column apart), layouts 0, 3, 2, 1 for vsw = 0 .. 3
    const int vsw = kVllm ? value_swizzle(__ffs(p.block_size) - 1) : 0;
    const int vmask = (1 << max(vsw - 1, 0)) - 1;  // see issue_pv
    const std::uint64_t k_desc =
        kVllm ? smem_desc(kv_addr, C::kBN * 16, 128, 0) : smem_desc(kv_addr, 16, 1024);
    const std::uint64_t v_desc = kVllm ? smem_desc(kv_addr + C::kKBytes, D * 16, 128 << vsw, (4 - vsw) & 3)
                                       : smem_desc(kv_addr + C::kKBytes, C::kBN * 128, 1024);
    float o[D / 2];
    float sc[C::kBN / 2];
    std::uint32_t pa[C::kBN / 16][4];
    auto issue_s = [&](int st) {
      const std::uint64_t kd = k_desc + static_cast<std::uint64_t>(st * (C::kStageBytes >> 4));
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        constexpr int kQStep = C::kBM * 128 >> 4, kKStep = C::kBN * 128 >> 4;
        // vllm: a k-step is two dim chunks of kBN tokens x 16 bytes
        const std::uint64_t kk_off = kVllm ? kk * (2 * C::kBN * 16 >> 4) : (kk / 4) * kKStep + (kk % 4) * 2;
        wgmma_ss<C::kBN, T>(sc, q_desc + (kk / 4) * kQStep + (kk % 4) * 2, kd + kk_off, kk > 0 ? 1 : 0);
      }
    };
    auto issue_pv = [&](int st) {
      const std::uint64_t vd = v_desc + static_cast<std::uint64_t>(st * (C::kStageBytes >> 4));
      if constexpr (kVllm) {
        // V [token columns][D][16 << sw bytes], K-major: k-step j (tokens 16 j ..) starts
        // in column 2 j >> sw, 32 j bytes into its rows modulo their width, which in 16-byte
        // units is 2 j D - (j & vmask) (2 D - 2), vmask = 0, 0, 1, 3 for sw = 0 .. 3 (one
        // sequence of products: branches around them make the compiler fence each one)
#pragma unroll
        for (int j = 0; j < C::kBN / 16; ++j)
          wgmma_rs<D, T, 0>(o, pa[j], vd + (2 * j * D - (j & vmask) * (2 * D - 2)), 1);
      } else {  // V [D/64][kBN][64 dims]: MN-major
#pragma unroll
        for (int j = 0; j < C::kBN / 16; ++j) wgmma_rs<D, T, 1>(o, pa[j], vd + j * (16 * 128 >> 4), 1);
      }
    };
    const unsigned wlim = p.sliding_window > 0 ? static_cast<unsigned>(p.sliding_window) : 0x80000000u;
    int g = 0;  // key tiles consumed, over all items
    for (int n = 0;; ++n) {
      const int slot = n & 1;
      mbar_wait(item_full(slot), (n >> 1) & 1);
      const PrefillItem w = slots[slot].item;
      if (w.kind == kItemEnd) break;
      const int kh = slots[slot].kh;
      const int rows = w.rows, r_lo = w.r_lo, r_hi = w.r_hi, ctx = w.ctx;
      const int kv_end = w.kv_end, kv_begin = w.kv_begin;
      const int kt_first = kv_begin / C::kBN;
      const int n_tiles = (kv_end + C::kBN - 1) / C::kBN - kt_first;
      int pos[2];
      float slope[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = r_lo + wrow + lane / 4 + hr * 8;
        pos[hr] = r < rows ? ctx + r / G : -1;
        slope[hr] = (p.alibi_slopes && r < rows) ? p.alibi_slopes[kh * G + r % G] * kLog2e : 0.0f;
      }
      const int min_pos = ctx + r_lo / G;
      const int max_first = prefill_window_first(p, ctx + (r_hi - 1) / G);
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
      float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

      // Plain scores (no soft cap, no ALiBi, a positive scale): the maximum is taken on the
      // raw products and the scale folds into the exponent's FMA.
      const bool plain = p.soft_cap_log2 <= 0.f && p.alibi_slopes == nullptr && p.qk_scale_log2 > 0.f;
      // Softmax of the S of tile i (in sc): masks, running max and sum; leaves the weights
      // in sc and returns whether O must be rescaled (then by corr). Each option is a
      // uniform branch around a loop of its own, so the plain tile runs none of their
      // instructions.
      // The reference maximum m_run moves only when a row's tile maximum exceeds it by more
      // than kSlack (base 2), and then for all rows of the warp: until then the weights are
      // taken against the old reference (at most 2^kSlack, exact in float32 and of the
      // same relative precision in 16 bits), and O and l need no rescale. The result is
      // the same quotient: O and l share the reference, and the sinks take it too.
      constexpr float kSlack = 8.0f;
      auto softmax = [&](int i, float (&corr)[2]) -> bool {
        const int t0 = (kt_first + i) * C::kBN;
        if (!plain) {
#pragma unroll
          for (int k = 0; k < C::kBN / 2; ++k) sc[k] *= p.qk_scale_log2;
          if (p.soft_cap_log2 > 0.f) {
            // one form only (the exact-near-zero one): two unrolled loops of the tile's logits
            // spilled the consumers (0 -> 124 bytes at d128 nhd)
  #pragma unroll
            for (int k = 0; k < C::kBN / 2; ++k)
              sc[k] = soft_cap_logit<false>(sc[k], p.soft_cap_log2, p.inv_soft_cap_log2);
          }
          if (p.alibi_slopes != nullptr) {
  #pragma unroll
            for (int k = 0; k < C::kBN / 2; ++k) {
              const int hr = (k % 4) / 2, t = t0 + (k / 4) * 8 + 2 * (lane % 4) + (k & 1);
              sc[k] += slope[hr] * static_cast<float>(t - pos[hr]);
            }
          }
        }
        if (t0 + C::kBN - 1 > min_pos || t0 < max_first) {  // the diagonal, or a window's edge
  #pragma unroll
          for (int k = 0; k < C::kBN / 2; ++k) {
            const int hr = (k % 4) / 2, t = t0 + (k / 4) * 8 + 2 * (lane % 4) + (k & 1);
            if (static_cast<unsigned>(pos[hr] - t) >= wlim) sc[k] = -INFINITY;
          }
        }
        float mx[2] = {-INFINITY, -INFINITY};
  #pragma unroll
        for (int k = 0; k < C::kBN / 2; ++k) mx[(k % 4) / 2] = fmaxf(mx[(k % 4) / 2], sc[k]);
        const float unit = plain ? p.qk_scale_log2 : 1.0f;  // base-2 logits per unit of sc
        float m_new[2];
        bool up = false;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
          mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
          m_new[hr] = fmaxf(m_run[hr], mx[hr] * unit);
          up |= m_new[hr] > m_run[hr] + kSlack;  // a first finite maximum too (-inf + kSlack)
        }
        const bool rescale = __any_sync(0xffffffffu, up);
        float m_use[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          if (rescale) {
            const float m_ref = m_new[hr] == -INFINITY ? 0.0f : m_new[hr];
            corr[hr] = fast_exp2(m_run[hr] - m_ref);
            m_run[hr] = m_new[hr];
            l_run[hr] *= corr[hr];
          }
          m_use[hr] = m_run[hr] == -INFINITY ? 0.0f : m_run[hr];
        }
#pragma unroll
        for (int k = 0; k < C::kBN / 2; ++k) {
          const float w = fast_exp2(fmaf(sc[k], unit, -m_use[(k % 4) / 2]));
          sc[k] = w;
          l_run[(k % 4) / 2] += w;
        }
        return rescale;
      };
      auto to_p = [&]() {
  #pragma unroll
        for (int j = 0; j < C::kBN / 16; ++j) {
          pa[j][0] = pack2<T>(sc[8 * j + 0], sc[8 * j + 1]);
          pa[j][1] = pack2<T>(sc[8 * j + 2], sc[8 * j + 3]);
          pa[j][2] = pack2<T>(sc[8 * j + 4], sc[8 * j + 5]);
          pa[j][3] = pack2<T>(sc[8 * j + 6], sc[8 * j + 7]);
        }
      };
      auto rescale_o = [&](const float (&corr)[2]) {
  #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[n * 4 + 0] *= corr[0];
          o[n * 4 + 1] *= corr[0];
          o[n * 4 + 2] *= corr[1];
          o[n * 4 + 3] *= corr[1];
        }
      };

      mbar_wait(q_full, n & 1);
      fence_proxy_async();
      // tile 0 (global tile g)
      mbar_wait(full_bar(g % C::kStages), (g / C::kStages) & 1);
      fence_proxy_async();
      wgmma_fence();
      issue_s(g % C::kStages);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      if (n_tiles == 1) mbar_arrive(q_empty);  // the item's last product with Q is done
      {
        float corr[2];
        softmax(0, corr);  // O is zero: no rescale
      }
      to_p();
      for (int i = 1; i < n_tiles; ++i) {
        const int gi = g + i, st = gi % C::kStages, prev = (gi - 1) % C::kStages;
        mbar_wait(full_bar(st), (gi / C::kStages) & 1);
        fence_proxy_async();
        fence_regs(o);
        wgmma_fence();
        issue_s(st);
        wgmma_commit();
        issue_pv(prev);
        wgmma_commit();
        wgmma_wait<1>();  // S of tile i
        fence_regs(sc);
        if (i + 1 == n_tiles) mbar_arrive(q_empty);  // the producer may load the next item's Q
        float corr[2];
        const bool rescale = softmax(i, corr);
        wgmma_wait<0>();  // P V of tile i - 1
        fence_regs(o);
        mbar_arrive(empty_bar(prev));
        if (rescale) rescale_o(corr);
        to_p();
      }
      {
        const int last = (g + n_tiles - 1) % C::kStages;
        fence_regs(o);
        wgmma_fence();
        issue_pv(last);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(empty_bar(last));
      }
      g += n_tiles;

      // Epilogue: O / l straight from registers (two elements per store), NaN when the
      // producer read a bad block id for the item; then the slot goes back.
      const bool bad_ids = reinterpret_cast<volatile int*>(&slots[slot].bad)[0] != 0;
      mbar_arrive(item_empty(slot));
      T* og = static_cast<T*>(p.out);
      const bool o_pair = (reinterpret_cast<std::uintptr_t>(og) & 3) == 0 && p.o_stride_tok % 2 == 0 &&
                          p.o_stride_head % 2 == 0;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float l = l_run[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = r_lo + wrow + lane / 4 + hr * 8;
        if (r >= rows) continue;
        const int h = kh * G + r % G;
        T* orow = og + static_cast<std::int64_t>(w.row0 + r / G) * p.o_stride_tok +
                  static_cast<std::int64_t>(h) * p.o_stride_head;
        const float inv = bad_ids ? __int_as_float(0x7fc00000) : p.v_scale / (l + prefill_sink(p, h, m_run[hr]));
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
          const int d = nn * 8 + 2 * (lane % 4);
          const float a = o[nn * 4 + 2 * hr] * inv, b = o[nn * 4 + 2 * hr + 1] * inv;
          if (o_pair) {
            *reinterpret_cast<std::uint32_t*>(orow + d) = pack2<T>(a, b);
          } else {
            orow[d] = from_float<T>(a);
            orow[d + 1] = from_float<T>(b);
          }
        }
      }
    }
  }
#else
  (void)p;
#endif
}

}  // namespace pagedattn::cuda_backend::sm90
