// Tensor-core decode kernel (f16 / bf16 queries; caches of the same dtype or fp8).
//
// One CTA = (sequence, KV head, tile of up to 16 query heads of that KV head's group,
// partition of the context). Every query head of the tile is computed from ONE read of
// the KV head: the heads are the 16 rows (M) of mma.sync.m16n8k16, tokens and head dims
// the N / K dimensions:
//   S  [16 heads x 16 tokens] = Q [16 x D] . K^T        (D/16 k-steps, 2 n-tiles)
//   O  [16 heads x D]        += P [16 x 16 tokens] . V  (1 k-step, D/8 n-tiles)
// fp8 caches with groups of up to 8 query heads run the products transposed (N8): the heads
// are the mma's N (8), tokens and dims its M, the fp8 keys and values its A operand:
//   S^T [16 tokens x 8 heads] = K . Q^T                 (D/16 k-steps, 1 n-tile)
//   O^T [D x 8 heads]        += V^T . P^T               (D/16 m-tiles, 1 k-step)
// half the MMAs, softmax values and accumulators of the untransposed tile, whose rows 8-15
// are empty for such groups (P^T: S^T's two 8 x 8 halves transposed by movmatrix).
// Each of the W warps streams its own 16-token chunks (chunk i, i+W, ...) through a
// private kStages-deep cp.async ring in shared memory and keeps its own online-softmax
// state; the warps are merged once at the end.
//
// Shared-memory layouts of one stage (all layouts of the cache map onto these):
//   K   vllm: [D*E/16 chunks][16 tokens][16 bytes], token index XOR-swizzled per chunk so
//       the fragment loads (one 16-byte load feeds 16/E/4 k-steps) are bank-conflict free;
//       nhd: [16 tokens][D*E/16 chunks][16 bytes], chunk bit 2 flipped on odd tokens (k_off).
//   V   vllm: [D][16 tokens] (the cache's own [D, B] rows);  nhd: [16 tokens][D*E] with
//       the 16-byte chunks swizzled by token, or rows padded by 16 bytes (kVSwz, v_off);
//       ldmatrix.trans reads them for 16-bit caches.
// Dimension permutation: a thread's k-slots {2c, 2c+1, 2c+8, 2c+9} of a k-step hold 4
// CONSECUTIVE head dims (and for the vllm layout the 16 tokens are ordered so that a
// thread's P / V slots are 4 consecutive tokens); Q is loaded with the same
// permutation, so the dot products are unchanged and every load is a vector load.
#pragma once

#include <type_traits>

#include "cuda/decode_common.cuh"
#include "cuda/mma.cuh"

namespace pagedattn::cuda_backend {

// Warps per CTA and cp.async ring depth per warp (16-bit and fp8 caches); compile-time
// knobs for tuning experiments (-DPAGEDATTN_MMA_WARPS=..., -DPAGEDATTN_MMA_STAGES=...,
// -DPAGEDATTN_MMA_FP8_STAGES=...). fp8 stages hold half the bytes, yet 4 of them measured
// 5-15% slower than 2 on an H100 and 3 of them 1-13% slower on an H200 (PERF_NOTES.md).
#ifndef PAGEDATTN_MMA_WARPS
#define PAGEDATTN_MMA_WARPS 4
#endif
#ifndef PAGEDATTN_MMA_STAGES
#define PAGEDATTN_MMA_STAGES 2
#endif
#ifndef PAGEDATTN_MMA_FP8_STAGES
#define PAGEDATTN_MMA_FP8_STAGES 2
#endif
// Warps per CTA of the transposed fp8 kernels (N8), the most: they run CTAs of this many
// warps or of half as many, chosen per call (planner::keep_full_width); their
// registers fit 16 warps per multiprocessor either way.
#ifndef PAGEDATTN_MMA_FP8_WARPS
#define PAGEDATTN_MMA_FP8_WARPS 8
#endif
// The planner's lone-CTA rate (bytes per us) of the 16-bit nhd / hnd kernels whose rows are
// 256 or 512 bytes (MmaDecodeConfig::kCtaBw), a knob for fitting it: 16 since their copies
// take no division per piece. On an H200, 26 (vllm's) against 13 (the rate before):
// b32 x16384 495 against 541 us and b32 x4096 132 against 135 (single pass against 5 and
// 3 partitions), but b8 x4096 44.4 against 43.4 and b8 x16384 136.3 against 134.5 (4
// partitions against 6). 16 plans each of those shapes as the faster of the two did, except
// b8 x4096 (4 partitions); the H100's plans are the same at 13 and 16.
#ifndef PAGEDATTN_NHD_ROW_CTA_BW
#define PAGEDATTN_NHD_ROW_CTA_BW 16.0e3
#endif

// The stage room the line-rounded blocks of small_page_stride() add: the most over pages
// of 2, 4 and 8 (for generic head sizes, 16 / B blocks of up to 112 bytes).
constexpr int small_page_pad(int D, int E) {
  int most = 0;
  for (int B = 2; B <= 8; B *= 2) {
    const int pad = (16 / B) * ((128 - D * B * E % 128) % 128);
    most = pad > most ? pad : most;
  }
  return most;
}

// S: the kernel of vllm pages of 2 and 4, and of 8 for 16-bit caches (small_page_stride,
// copy_small_page_values), an instantiation of its own so that the page-16 kernel's code is
// untouched by it (inlined into it, the small-page paths cost page 16 1.5-3% on an H200).
// N8: the transposed products of fp8 caches for groups of up to 8 query heads (the heads
// are the mma N, 8, instead of its M, 16; the file's header comment).
// W: wide value rows, the kernel of vllm pages of 64 and more for 16-bit caches. A warp's
// 16-token chunk is 32 bytes of each of the block's dim rows, which lie B * 2 bytes apart:
// from page 64 on, every 32 bytes was an L2 request of its own (2.5x the requests of page 16
// and 1.2x its time on an H200). Here the 4 warps' chunks of a 64-token group share one V
// stage [D][64] that each warp fills with a quarter of the dim rows, whole 128-byte rows (one
// request each); mbarriers hand the stages between the warps (full: every thread's copies
// landed; empty: every thread done reading). Keys stay in each warp's own ring.
template <class T, KVCacheDType F, int HEAD, CacheLayout L, bool S = false, bool N8 = false, bool W = false>
struct MmaDecodeConfig {
  static constexpr int kWarps = N8 ? PAGEDATTN_MMA_FP8_WARPS : PAGEDATTN_MMA_WARPS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = N8 ? 8 : 16;  // query heads per CTA (mma M, or N when transposed)
  static constexpr int kTok = 16;   // tokens per chunk (mma K of P.V)
  static constexpr int kE = F == KVCacheDType::kAuto ? static_cast<int>(sizeof(T)) : 1;  // cache element bytes
  static constexpr int kV16 = supported::kCacheChunkBytes / kE;               // elements per 16 bytes (x)
  static constexpr int kHMax = HEAD ? HEAD : supported::kCudaMaxHeadSize;    // capacity (generic: the max)
  static constexpr int kKChunks = (kHMax + kV16 - 1) / kV16;                   // 16-byte chunks per row
  static constexpr int kSPL = kV16 / 4;                                        // k-steps per 16-byte load
  static constexpr int kGroups = (kKChunks + 3) / 4;                           // 4 chunks per group
  static constexpr int kKSteps = kGroups * kSPL;
  static constexpr int kNTiles = kHMax / 8;
  static constexpr int kStages = kE == 1 ? PAGEDATTN_MMA_FP8_STAGES : PAGEDATTN_MMA_STAGES;
  static constexpr int kKBytes = kTok * kKChunks * 16;
  // nhd V rows: 16-bit caches whose row is a multiple of 128 bytes keep unpadded rows with
  // the 16-byte chunks XOR-swizzled by token (v_off), so a 128-byte line of a token row
  // lands in one 128-byte run (one L2 request per line for cp.async) and the 8 rows an
  // ldmatrix.trans reads fall on different banks; the others pad each row by 16 bytes.
  static constexpr bool kVSwz = L == CacheLayout::kNHD && kE == 2 && (kHMax * kE / 16) % 8 == 0;
  static constexpr int kVPitch = kVSwz ? kHMax * kE : kHMax * kE + 16;  // nhd row pitch (bytes)
  // nhd fp8 values of a specialised head size whose D/8 is a multiple of 4: n-tile n's
  // column g is dim g * D/8 + n (not 8n + g), so a thread's values of one token are D/8
  // consecutive bytes (one 16-byte load for d128) instead of D/8 byte loads; the output
  // dims are put back in order when the warps' results meet (the slab).
  static constexpr bool kVPerm = L == CacheLayout::kNHD && kE == 1 && HEAD != 0 && (HEAD / 8) % 4 == 0;
  // vllm pages of 2, 4 and 8 (S) keep a chunk's values as [16 / B blocks][D][B], each
  // block's [D, B] slab copied whole, the blocks small_page_stride() apart: room for the pads.
  static constexpr int kVSmallPad = S ? (HEAD ? small_page_pad(HEAD, kE) : 8 * 112) : 0;
  static constexpr int kVBytes = L == CacheLayout::kVLLM ? kHMax * kTok * kE + kVSmallPad : kTok * kVPitch;
  static constexpr int kStageBytes = kKBytes + kVBytes;
  // A warp's ring stage: its K and V (W: its K only; the V stages [D][64] after the rings)
  static constexpr int kRingStage = W ? kKBytes : kStageBytes;
  static constexpr int kGroupTok = kTok * kWarps;   // W: tokens per group (64)
  static constexpr int kVWideRow = kGroupTok * kE;  // W: bytes per V stage row (128)
  // W's copy and read addressing assume 8 lanes of 16 bytes per row (lane & 7 is the piece,
  // lane >> 3 the row) and a piece swizzle of 3 bits: 4 warps of 16-bit elements
  static_assert(!W || (kWarps == 4 && kE == 2),
                "the wide-row kernel: 4 warps, 16-bit caches (128-byte rows)");
  // Bytes per us one CTA streams when alone on its multiprocessor, for the planner's model,
  // fitted to partition sweeps: vllm copies whole [D/x, 16, x] / [D, 16] slabs (26; fp8, whose
  // stages hold half the bytes, 13); nhd copies token rows of D elements (13: ~17 alone on an
  // H100, ~13-14 at two CTAs per multiprocessor on an H200; fp8 8.5, from H100 sweeps). The
  // small-page kernel (S) keeps nhd's rates, fitted when it copied per-token keys as nhd
  // does (an H100 sweep of pages 2-8 at b8 x16384: 26 planned 2 x 8192, 300-423 us, where
  // 1024-token partitions took 200-235); not re-fitted since it copies whole key slabs.
  // The transposed fp8 kernels' rates are per 4 warps, scaled by their warps per CTA.
  // 16-bit nhd rows of 256 or 512 bytes (d128, d256) are copied from one base and a fixed
  // stride (kStridedRows), faster: PAGEDATTN_NHD_ROW_CTA_BW. So are the transposed fp8
  // kernels' d128 rows (128 bytes, 8 pieces: a lane copies 4 rows), 0.93-0.97x the time of
  // the general loop from 512 MB on an H200 (their planner rate stays 8.5: a sweep of the
  // partition counts found the plans at or within 2% of the best). Other fp8 kernels keep
  // the general loop, whose token % B is a mask for them (kShiftB).
  static constexpr bool kStridedRows =
      L != CacheLayout::kVLLM && ((kE == 2 && (HEAD == 128 || HEAD == 256)) || (N8 && HEAD == 128));
  static constexpr double kCtaBw =
      (L == CacheLayout::kVLLM && !S ? (kE == 2 ? 26.0e3 : 13.0e3)
                                     : (kE == 2 ? (kStridedRows ? PAGEDATTN_NHD_ROW_CTA_BW : 13.0e3) : 8.5e3)) *
      (N8 ? kWarps / 4.0 : 1.0);
  // The transposed kernels also run CTAs of kNarrowWarps (the launch's block size says which).
  static constexpr int kNarrowWarps = N8 ? kWarps / 2 : kWarps;
  // CTAs per multiprocessor the registers are fitted to. The transposed kernels of head
  // sizes 64, 96 and 128 fit 16 warps per multiprocessor (128 registers, no spill): a third
  // more warps than 3 CTAs of 4 to hide the fp8 loop's latency. The others spill at 128
  // (72-262 bytes) and keep no bound.
  static constexpr int kMinBlocks = N8 && kHMax <= 128 && kHMax % 32 == 0 ? 16 / kWarps : 1;
  // The warps' outputs meet in a [kWarps][kRows][kSlabPitch] float slab (over the ring);
  // the 8-float pad puts the 8 rows a warp writes at once on different banks.
  // Transposed (N8), a thread writes single floats of two heads 2c, 2c + 1 at 8 dims:
  // rows 4 floats apart keep the four c on different banks.
  static constexpr int kSlabPitch = N8 ? kHMax + 4 : kHMax + 8;
  // The ring or the slab, whichever is larger, for a CTA of nw warps (N8: nw is the
  // launch's; the others: kWarps)
  __host__ __device__ static constexpr int smem_bytes(int nw) {
    return nw * kStages * kStageBytes > nw * kRows * kSlabPitch * 4 ? nw * kStages * kStageBytes
                                                                    : nw * kRows * kSlabPitch * 4;
  }
  // The per-warp max / exp-sum of each row go after the ring: the kernel has no static
  // shared memory, so the ring starts at offset 0 of the CTA's shared memory. (A ring 16
  // bytes off a 128-byte boundary streamed 6-9% slower on an H100; see PERF_NOTES.md.)
  static constexpr int kRedFloats = kWarps * kRows;
  static constexpr int kBarBytes = W ? 2 * kStages * 8 : 0;  // W: full[kStages], empty[kStages]
  __host__ __device__ static constexpr int dyn_bytes(int nw) {
    return smem_bytes(nw) + 2 * nw * kRows * 4 + kBarBytes;
  }
  static constexpr int kDynBytes = dyn_bytes(kWarps);  // the full width's
};

// Whether a kernel has a transposed (N8) instantiation: fp8 caches of a specialised head
// size, the vllm layout or nhd with permuted value dims (kVPerm).
template <KVCacheDType F, int HEAD, CacheLayout L>
constexpr bool has_transposed_decode() {
  return F != KVCacheDType::kAuto && HEAD != 0 && (L == CacheLayout::kVLLM || (HEAD / 8) % 4 == 0);
}

// Token held in k-slot `col` (0..7) of QK n-tile `nt`: for the vllm layout ordered so a
// thread's P.V slots {2c, 2c+1, 2c+8, 2c+9} are tokens 4c..4c+3; natural for nhd.
template <CacheLayout L>
__device__ __forceinline__ int slot_token(int nt, int col) {
  if constexpr (L == CacheLayout::kVLLM) return 4 * (col >> 1) + 2 * nt + (col & 1);
  else return 8 * nt + col;
}

// Byte offset of V's 16-byte chunk j of token t inside an nhd stage.
template <class C>
__device__ __forceinline__ int v_off(int t, int j) {
  if constexpr (C::kVSwz) return t * C::kVPitch + ((j ^ (t & 7)) << 4);
  else return t * C::kVPitch + (j << 4);
}

// The N (a multiple of 4) bytes at p, as N / 4 words, with the widest loads p's alignment
// allows (p is N-byte aligned up to 16).
template <int N>
__device__ __forceinline__ void load_words(const unsigned char* p, std::uint32_t (&w)[N / 4]) {
  if constexpr (N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] = reinterpret_cast<const std::uint32_t*>(p)[i];
  }
}

// Byte offset of K's 16-byte chunk j of token t inside a stage (NJ chunks per token row).
// vllm: [NJ][16 tokens], the token index XOR-swizzled per chunk (the cache's slab order).
// nhd: [16 tokens][NJ], as the cache's rows come: the 16-byte pieces of one 128-byte line
// of a token row land in one 128-byte run of shared memory, which cp.async needs to fetch
// the line with one L2 request (scattered, every piece was its own request: 4.9x the L2
// requests of the vllm layout); chunk bit 2 flipped on odd tokens so that the fragment
// loads of two adjacent tokens fall on different banks.
template <CacheLayout L, int NJ>
__device__ __forceinline__ int k_off(int j, int t) {
  if constexpr (L == CacheLayout::kVLLM) return (j * 16 + (t ^ ((2 * j) & 6))) * 16;
  else return (t * NJ + (NJ % 8 == 0 ? j ^ ((t & 1) << 2) : j)) * 16;
}

// vllm pages of 2, 4 and 8: the stage holds a chunk's values as [16 / B blocks][D][B], the
// cache's own [D, B] slab of each block, so each is copied whole in 16-byte pieces (into a
// [D][16] stage a B-token run is one piece of 2B bytes: 4.4x the page-16 time at page 2,
// 2.3x at page 4 and 1.6x at page 8 on an H200, with page-8 runs of 16 bytes). The blocks
// lie small_page_stride() bytes apart, whole 128-byte lines, so that a copy's lines meet
// whole lines of the stage (one L2 request each: blocks padded off the lines split them in
// two). The threads of a quad read tokens 4c .. 4c + 3 of a dim, in block 4c / B: so that
// they meet different banks, block b's 16-byte pieces are XOR-swizzled inside their lines
// by (b B / 2) mod 8 (small_v_off).
__device__ __forceinline__ int small_page_stride(int D, int B, int E) { return (D * B * E + 127) & ~127; }

// The XOR that swizzles block b's value pieces (bits 4-6 of a byte offset in its slab).
__device__ __forceinline__ int small_v_swz(int b, int B) { return ((b * B / 2) & 7) << 4; }

// Byte offset in a small-page stage of byte j of block b's [D, B] slab.
__device__ __forceinline__ int small_v_off(int b, int j, int B, int cs) {
  return b * cs + (j ^ small_v_swz(b, B));
}

// vllm pages of 2 and 4 keep a chunk's keys as whole blocks too: [16 / B][D/x][B][x], the
// cache's own [D/x, B, x] slab of each block, the blocks D * E * B bytes apart (their piece
// (j, t) is 16 bytes of a 32- or 64-byte run, so per-token copies were one L2 request per
// run where a slab's 512 contiguous bytes are four). Pages of 4 swap the token pairs of odd
// 8-piece runs (bit 5 of the byte offset flipped by bit 7), so that the 16-byte loads of a
// quad's four pieces j = 4q + c meet different banks (small_key_swz: byte in of a key slab).
__device__ __forceinline__ int small_key_swz(int in, int B) { return B == 4 ? in ^ ((in >> 2) & 32) : in; }

// Byte offset of token t's piece j.
__device__ __forceinline__ int small_key_off(int j, int t, int B, int row_bytes) {
  const int in = (j * B + (t & (B - 1))) * 16;
  return (t & ~(B - 1)) * row_bytes + small_key_swz(in, B);
}

// Copies the value slabs of a chunk's 16 / B blocks into the stage (vs), blocks cs bytes
// apart; for pages of 2 and 4 also their key slabs into ks (small_key_off). Block b's id:
// with per-token ids (B < 8) that of its last live token, shuffled from the lane holding it
// (idA: the lane's token's checked id); for B = 8, idA / idB (the chunk's halves). -1 when
// the block lies wholly before the window (never read), past the sequence, or its id is bad
// (flagged by the caller): its slab is then zeros. A block read whole may hold slots past
// the sequence or before the window: their values are zeroed before use
// (zero_small_page_values). B is a compile-time constant (a loop over a run-time page size
// cost 109 instructions per block at page 2, 8 blocks a chunk: twice the instructions of page
// 16 in all).
template <int E, int B, int HEAD>
__device__ __forceinline__ void copy_small_page_values(unsigned char* vs, const char* vc,
                                                       std::int64_t v_block_bytes, unsigned char* ks,
                                                       const char* kc, std::int64_t k_block_bytes, int kvh,
                                                       int D, int t0, int tok_end, int idA, int idB) {
  const int lane = threadIdx.x & 31;
  const int slab = D * B * E, cs = small_page_stride(D, B, E);
  const char* head = vc + static_cast<std::int64_t>(kvh) * slab;
  const char* khead = kc + static_cast<std::int64_t>(kvh) * slab;  // a key slab: D / x pieces of B tokens
  // The id of the chunk's block b (every lane calls it together: a shuffle); ok: it is read
  auto block_id = [&](int b, bool& ok) {
    const int nvalid = min(B, max(0, tok_end - (t0 + b * B)));
    int id;
    if constexpr (B == 8)
      id = b ? idB : idA;
    else
      id = __shfl_sync(0xffffffffu, idA, (b * B + max(nvalid, 1) - 1) & 15);
    ok = nvalid > 0 && id >= 0;
    return id;
  };
  if constexpr (HEAD != 0 && HEAD * 2 * E % 128 == 0) {
    // Slabs of whole 128-byte lines (the head sizes in use): the chunk's 16 / B blocks hold
    // kK x 4 lines, and lanes 8G .. 8G + 7 copy line 4k + G of them at instruction k, blocks
    // fastest: block (4k + G) mod nb, its line (4k + G) / nb. So a lane meets one block (two
    // at page 2: G and G + 4), whose id and bases it takes once, and every copy is a base plus
    // a constant: no loop over blocks (an unrolled one measured as fast and was 2.5x the code;
    // a rolled one 1.2x slower at page 2 on an H200).
    constexpr int kNb = 16 / B, kSlab = HEAD * B * E, kK = kNb * kSlab / 128 / 4, kH = kNb == 8 ? 2 : 1;
    const int G = lane >> 3, p16 = (lane & 7) * 16;
    const int lb = kNb == 2 ? (G >> 1) * 128 : 0;  // page 8: lanes G >= 2 start on a block's line 1
    const char* vsrc[kH];
    const char* ksrc[kH];
    int vdst[kH], kdst[kH];
    bool ok[kH];
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      const int b = kNb == 8 ? G + 4 * h : G % kNb;
      const int id = block_id(b, ok[h]);
      vsrc[h] = head + (ok[h] ? id * v_block_bytes : 0) + lb + p16;
      ksrc[h] = khead + (ok[h] ? id * k_block_bytes : 0) + lb + p16;
      vdst[h] = b * kSlab + lb + (p16 ^ small_v_swz(b, B));  // small_v_off, lb + p16 in the first line
      kdst[h] = b * kSlab + lb + p16;
    }
    // small_key_swz of a key piece: p16 on a block's even lines, p16 ^ 32 on its odd ones at page 4
    const int kflip = (p16 ^ 32) - p16;
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int h = kNb == 8 ? (k & 1) : 0;
      const int line = kNb == 8 ? k >> 1 : (kNb == 4 ? k : 2 * k);  // (+ lb, in the bases)
      cp_async16(vs + vdst[h] + line * 128, ok[h] ? vsrc[h] + line * 128 : vc, ok[h] ? 16 : 0);
      if constexpr (B < 8)
        cp_async16(ks + kdst[h] + line * 128 + (B == 4 && (line & 1) ? kflip : 0),
                   ok[h] ? ksrc[h] + line * 128 : kc, ok[h] ? 16 : 0);
    }
    return;
  }
  const int rounds = (slab + 511) >> 9;  // 512 bytes a warp per round
#pragma unroll 1
  for (int b = 0; b < 16 / B; ++b) {
    bool ok;
    const int id = block_id(b, ok);
    const char* src = ok ? head + id * v_block_bytes : vc;
    const char* ksrc = ok ? khead + id * k_block_bytes : kc;
#pragma unroll 4
    for (int r = 0; r < rounds; ++r) {
      const int j = r * 512 + lane * 16;
      if (j < slab) {
        cp_async16(vs + small_v_off(b, j, B, cs), ok ? src + j : vc, ok ? 16 : 0);
        if constexpr (B < 8) cp_async16(ks + b * slab + small_key_swz(j, B), ok ? ksrc + j : kc, ok ? 16 : 0);
      }
    }
  }
}

// Zeroes the values of tokens [lo, hi) of a small-page stage (copy_small_page_values): one warp.
template <int E>
__device__ __forceinline__ void zero_small_page_values(unsigned char* vs, int lo, int hi, int D, int B, int cs) {
  const int n = hi - lo;
  for (int i = threadIdx.x & 31; i < D * n; i += 32) {
    const int d = i / n, t = lo + i % n;
    unsigned char* e = vs + (B < 16 ? small_v_off(t / B, (d * B + t % B) * E, B, cs) : (d * B + t % B) * E);
#pragma unroll
    for (int k = 0; k < E; ++k) e[k] = 0;
  }
}

// Zeroes the values of the first n (< 16) tokens of a stage's V (vs): one warp.
template <class C, CacheLayout L>
__device__ __forceinline__ void zero_values(unsigned char* vs, int n, int D, int nck) {
  const int lane = threadIdx.x & 31;
  if constexpr (L == CacheLayout::kVLLM) {  // [D][16 tokens]: one slab of 16
    zero_small_page_values<C::kE>(vs, 0, n, D, 16, 0);
  } else {  // [16 tokens] rows of nck 16-byte chunks
    for (int i = lane; i < n * nck; i += 32)
      *reinterpret_cast<uint4*>(vs + v_off<C>(i / nck, i % nck)) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Moves a row's running maximum (base 2) to cover mx, the chunk's maximum over the row's
// lanes; returns the factor that rescales what was summed against the old one.
__device__ __forceinline__ float advance_max(float& m_run, float mx) {
  const float m_new = fmaxf(m_run, mx);
  const float corr = exp2f(m_run - m_new);
  m_run = m_new;
  return corr;
}

// The kernel's body; decode_mma_kernel below is its entry point.
template <class T, KVCacheDType F, int HEAD, CacheLayout L, bool S, bool N8, bool W>
__device__ __forceinline__ void decode_mma_body(const DecodeKernelParams& p) {
  static_assert(!S || L == CacheLayout::kVLLM, "the small-page kernel serves the vllm layout");
  static_assert(!N8 || (has_transposed_decode<F, HEAD, L>() && !S),
                "the transposed kernel: fp8, specialised head sizes, pages of 8 and more");
  static_assert(!W || (L == CacheLayout::kVLLM && F == KVCacheDType::kAuto && HEAD != 0 && !S && !N8),
                "the wide-row kernel: vllm pages of 64 and more, 16-bit caches, specialised head sizes");
  using C = MmaDecodeConfig<T, F, HEAD, L, S, N8, W>;
  // Warps of this CTA: the transposed kernels run kWarps or kNarrowWarps (the launch's
  // choice); the others always kWarps, a constant.
  const int nw = N8 ? static_cast<int>(blockDim.x >> 5) : C::kWarps;
  extern __shared__ __align__(128) unsigned char smem[];
  float* red_m = reinterpret_cast<float*>(smem + C::smem_bytes(nw));  // [nw][kRows]
  float* red_l = red_m + nw * C::kRows;

  PA_TRACE_DECL;
  PA_TRACE(0);
  allow_dependent_launch();
  CtaTask task = cta_task(p, C::kRows);
  const int part = task.part, kvh = task.kvh, s = task.s, rows = task.rows, h0 = task.h0;
  int tok_begin = task.tok_begin;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int D = HEAD ? HEAD : p.head_size;
  const int B = p.block_size;
  // B is a power of two (supported::kCudaBlockSizes): the fp8 nhd kernels take token / B and
  // token % B as a shift and a mask (a division by a run-time B is ~25 instructions per
  // chunk; nhd fp8 1-3% faster on an H100). The others keep the division: with the shift the
  // vllm fp8 kernel spills at its 128 registers and ran 1.5-3% slower, and the 16-bit ones
  // measured both faster and slower by 3-4% on different shapes.
  constexpr bool kShiftB = (C::kE == 1 && L == CacheLayout::kNHD) || W || S;
  const int lgB = __ffs(B) - 1;
  auto div_b = [&](int t) { return kShiftB ? t >> lgB : t / B; };
  auto mod_b = [&](int t) { return kShiftB ? t & (B - 1) : t % B; };

  // The sequence length (issued by cta_task) and the block ids of the warp's first
  // kStages chunks are loaded together: the ids do not depend on the length, so a CTA
  // starts streaming after one memory latency instead of two.
  // W: a lane's value pieces (piece lane % 8 of a group's dim rows: tokens 8 (lane % 8) ..)
  // belong to chunk (lane % 8) / 2 of the group: that chunk's block id.
  const std::int32_t* table_row = task.table_row;
  [[maybe_unused]] const int wq = W ? (lane & 7) >> 1 : warp;  // the chunk of a group whose id the lane holds
  int first_a[C::kStages], first_b[C::kStages];
#pragma unroll
  for (int i = 0; i < C::kStages; ++i)
    early_block_ids(p, task, tok_begin + (wq + i * nw) * C::kTok, first_a[i], first_b[i]);
  [[maybe_unused]] const std::uint32_t bar_full = smem_addr(red_l + C::kRedFloats);  // W: full[s] at + 8 s
  [[maybe_unused]] const std::uint32_t bar_empty = bar_full + 8 * C::kStages;
  if constexpr (W) {
    // The mbarriers count every thread of the CTA, so its threads must agree on its work:
    // each read seq_lens (and query_start_loc) itself, and a caller changing them during
    // the call could give threads different lengths, and loops of different trip counts (a
    // hang). Thread 0's reading is the CTA's. (The other kernels meet only at the end,
    // where a thread that returned early does not hold the barrier.)
    int* shared_task = reinterpret_cast<int*>(red_m);  // free until the warps merge
    if (threadIdx.x == 0) {
      shared_task[0] = task.raw_len;
      shared_task[1] = task.row;
#pragma unroll
      for (int st = 0; st < C::kStages; ++st) {
        mbar_init(bar_full + 8 * st, C::kThreads);   // every thread's copies of the group
        mbar_init(bar_empty + 8 * st, C::kThreads);  // every thread done reading the stage
      }
    }
    __syncthreads();
    task.raw_len = shared_task[0];
    task.row = shared_task[1];
    if (p.sliding_window > 0)
      tok_begin = task.tok_begin = part * p.partition_size + window_base(p, task.raw_len);
  }
  const int len = cta_seq_len<T>(p, task);
  if (len < 0) return;
  PA_TRACE(1);
  const int tok_end = min(len, tok_begin + p.partition_size);
  const int nchunks = (tok_end - tok_begin + C::kTok - 1) / C::kTok;
  const int my_chunks = nchunks > warp ? (nchunks - warp + nw - 1) / nw : 0;
  // W: every warp runs every group (it copies a quarter of each group's values), its own
  // chunk of the last group may be missing
  const int my_iters = W ? (nchunks + C::kWarps - 1) / C::kWarps : my_chunks;
  const int nck = (D * C::kE + 15) / 16;  // 16-byte chunks per K row actually present
  const int row_bytes = D * C::kE;
  // keys [wfirst, tok_end) are visible: one unsigned compare masks both ends
  const int wfirst = window_first(p, len);
  const unsigned visible = static_cast<unsigned>(tok_end - wfirst);

  // ---- Q fragments (A operand), permuted dims, zero for rows >= `rows` / dims >= D
  // M: the MMA operand type. fp8 caches decode to f16 in one instruction (to bf16 in four),
  // so bf16 queries over fp8 caches multiply in f16: each query row is scaled by a power of
  // two that puts its largest |element| in [2^14, 2^15), which keeps every bf16 value exact in
  // f16 down to 2^-28 of that largest one (smaller ones lose bits only where they cannot move
  // the dot product at bf16 precision), and its logits are scaled back by the inverse power
  // (qk_row). P and V are f16 too (P in [0, 1] keeps more bits than in bf16).
  using M = std::conditional_t<F == KVCacheDType::kAuto, T, __half>;
  constexpr bool kQToHalf = !std::is_same_v<T, M>;
  float qk_row[2] = {p.qk_scale_log2, p.qk_scale_log2};  // per row half (g, g + 8)
  std::uint32_t qa[C::kKSteps][4];
  auto load_q = [&]() {
    const T* q0 = static_cast<const T*>(p.query) + task.row * p.q_stride_seq;
#pragma unroll
    for (int st = 0; st < C::kKSteps; ++st) {
      const int d0 = (4 * (st / C::kSPL) + c) * C::kV16 + (st % C::kSPL) * 4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // rows g, g + 8
        const int r = g + 8 * half;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[e] = 0.f;
          if (r < rows && d0 + e < D)
            v[e] = to_float(q0[static_cast<std::int64_t>(h0 + r) * p.q_stride_head + d0 + e]);
        }
        qa[st][half] = pack2<T>(v[0], v[1]);
        qa[st][2 + half] = pack2<T>(v[2], v[3]);
      }
    }
    if constexpr (kQToHalf) {
#pragma unroll
      for (int half = 0; half < (N8 ? 1 : 2); ++half) {  // N8: row g only
        // the row's largest |element| as bf16 bits (a non-negative float's bits order it)
        unsigned mb = 0;
#pragma unroll
        for (int st = 0; st < C::kKSteps; ++st)
#pragma unroll
          for (int j = half; j < 4; j += 2) mb = max(mb, max(qa[st][j] & 0x7fffu, (qa[st][j] >> 16) & 0x7fffu));
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
        const int k = min(125, max(-125, 14 - (static_cast<int>(mb >> 7) - 127)));
        const float scale = __uint_as_float(static_cast<unsigned>(127 + k) << 23);  // 2^k
        qk_row[half] = p.qk_scale_log2 * __uint_as_float(static_cast<unsigned>(127 - k) << 23);
#pragma unroll
        for (int st = 0; st < C::kKSteps; ++st)
#pragma unroll
          for (int j = half; j < 4; j += 2)
            qa[st][j] = pack2<M>(__uint_as_float(qa[st][j] << 16) * scale, __uint_as_float(qa[st][j] & 0xffff0000u) * scale);
      }
    }
  };
  // slope (and qk_row after load_q) of rows g, g + 8; transposed (N8), of heads 2c, 2c + 1
  float slope[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = N8 ? 2 * c + half : g + 8 * half;
    slope[half] = (p.alibi_slopes && r < rows) ? p.alibi_slopes[h0 + r] * kLog2e : 0.f;
  }

  unsigned char* my_ring = smem + warp * C::kStages * C::kRingStage;
  [[maybe_unused]] unsigned char* wide_v = smem + C::kWarps * C::kStages * C::kKBytes;  // W: V stages [D][64]
  const char* kc = static_cast<const char*>(p.key_cache);
  const char* vc = static_cast<const char*>(p.value_cache);
  // Byte strides of the caches: between blocks, and (nhd / hnd) between a block's token
  // rows and between its heads' rows.
  const std::int64_t k_block_bytes = p.k_block_stride * C::kE, v_block_bytes = p.v_block_stride * C::kE;
  const std::int64_t tok_bytes = p.tok_stride * C::kE, head_bytes = p.head_stride * C::kE;
  bool bad = false;
  [[maybe_unused]] const int small_cs = S ? small_page_stride(D, B, C::kE) : 0;  // S: the blocks' stride

  // ---- issue the cp.async copies of this warp's i-th chunk into its stage
  // Raw block ids of tokens t0 and t0 + 8 of the warp's i-th chunk (one block when
  // B >= 16), loaded one iteration before use so the load latency stays hidden.
  // With ids_per_token(B) (see decode_common.cuh) a is the id of the lane's token instead.
  const bool per_token = ids_per_token(B);
  // b is only read for 8 <= B < 16. fp8 kernels leave it 0 otherwise: a copy of a is an
  // instruction that waits for a's load right after issuing it (the vllm fp8 kernel's largest
  // stall, 18% of its samples on an H100; without it vllm fp8 2-4% faster). The 16-bit
  // kernels keep the copy: without it, on an H100, vllm bf16 b8 / b16 x16384 ran 3% faster
  // but b64 x4096 4% slower, and the decode benchmark stays as it was.
  auto raw_ids = [&](int i, int& a, int& b) {
    const int t0 = tok_begin + (wq + i * nw) * C::kTok;
    a = b = 0;
    if constexpr (W) {
      if (i < my_iters && t0 < tok_end) a = __ldg(table_row + div_b(t0));
      return;
    }
    if (i < my_chunks) {
      if (per_token) {
        const int tok = t0 + (lane & 15);
        a = tok < tok_end ? __ldg(table_row + div_b(tok)) : 0;
        if (C::kE == 2) b = a;
      } else {
        a = __ldg(table_row + div_b(t0));
        if (C::kE == 2) b = a;
        if (B < 16 && t0 + 8 < tok_end) b = __ldg(table_row + div_b(t0 + 8));
      }
    }
  };
  auto load_chunk = [&](int i, int rawA, int rawB) {
    const int t0 = tok_begin + (warp + i * nw) * C::kTok;
    unsigned char* ks = my_ring + (i % C::kStages) * C::kStageBytes;
    unsigned char* vs = ks + C::kKBytes;
    // Blocks wholly before the window are never read: with B < 16 the chunk's first 8
    // tokens may lie before it, and per token (B < 8) any of the chunk's tokens may.
    int idA, idB;
    if (per_token) {  // idA: the lane's token's id (-1: past the end or before the window)
      const int tok = t0 + (lane & 15);
      const bool live = tok < tok_end && tok >= wfirst;
      idA = idB = live ? checked_block_id(p, s, div_b(tok), rawA) : -1;
      bad |= live && idA < 0;
    } else {
      const bool skip_a = B < 16 && t0 + 8 <= wfirst;
      idA = skip_a ? -1 : checked_block_id(p, s, div_b(t0), rawA);
      idB = idA;
      if (B < 16) idB = t0 + 8 < tok_end ? checked_block_id(p, s, div_b(t0 + 8), rawB) : -1;
      bad |= (idA < 0 && !skip_a) | (B < 16 && t0 + 8 < tok_end && idB < 0);
    }
    // The block id of the chunk's token t; a shuffle with ids_per_token(B): every lane of
    // the warp calls it together.
    [[maybe_unused]] auto id_of = [&](int t) {
      return per_token ? __shfl_sync(0xffffffffu, idA, t & 15) : (t < 8 ? idA : idB);
    };
    if constexpr (L == CacheLayout::kVLLM) {
      if (!S && HEAD != 0 && B >= 16) {
        // A chunk lies in one block (chunks start on multiples of 16; B is a power of two).
        // Its keys are nck runs of 16 tokens x 16 bytes (B * 16 bytes apart; for B = 16 the
        // whole [D/x, 16, x] slab) and its values D runs of 16 tokens (B * E bytes apart; for
        // B = 16 the whole [D, 16] slab), copied into the stage's order (K swizzled on the
        // way). A lane's token (K) and token piece (V) are the same for all its pieces, so
        // the masks, sizes and bases are computed once per chunk: no division in the loops.
        // Page 16 is compiled with its block size known (the pieces' offsets immediates:
        // 7-10% faster fp8 copies on an H100 than with a run-time stride).
        auto copy_runs = [&](auto block_size) {
          constexpr int kB = decltype(block_size)::value;  // 16, or 0: B at run time
          const int Bs = kB ? kB : B;
          const std::int64_t blk = idA >= 0 ? idA : 0;
          const int tb = t0 & (Bs - 1);  // the chunk's first token in its block
          const std::int64_t koff = blk * k_block_bytes + (static_cast<std::int64_t>(kvh) * nck * Bs + tb) * 16;
          const std::int64_t voff = blk * v_block_bytes + (static_cast<std::int64_t>(kvh) * D * Bs + tb) * C::kE;
          const int t = lane & 15;
          const bool okk = idA >= 0 && t0 + t < tok_end;
          const char* ksrc = okk ? kc + koff + t * 16 : kc;
          // unrolled for page 16 only: the run-time page size stays a short loop (code size)
          constexpr int kUnroll = kB ? 16 : 1;
#pragma unroll kUnroll
          for (int pi = lane; pi < nck * 16; pi += 32)
            cp_async16(ks + k_off<L, C::kKChunks>(pi >> 4, t), okk ? ksrc + (pi >> 4) * (Bs * 16) : kc, okk ? 16 : 0);
          constexpr int kPt16 = C::kV16;       // tokens per 16-byte V piece
          constexpr int kPieces = 16 / kPt16;  // V pieces per dim row
          const int q = lane % kPieces;        // the lane's piece of every dim row
          const int nvalid = idA >= 0 ? min(kPt16, max(0, tok_end - (t0 + q * kPt16))) : 0;
          const char* vsrc = nvalid > 0 ? vc + voff + q * kPt16 * C::kE : vc;
#pragma unroll kUnroll
          for (int pi = lane; pi < D * kPieces; pi += 32)
            cp_async16(vs + pi * 16, nvalid > 0 ? vsrc + (pi / kPieces) * (Bs * C::kE) : vc, nvalid * C::kE);
        };
        if (B == 16)
          copy_runs(std::integral_constant<int, 16>{});
        else
          copy_runs(std::integral_constant<int, 0>{});
        return;
      }
      if constexpr (S) {
        if (B < 8) {  // keys and values as whole slabs (small_key_off)
          if (B == 2)
            copy_small_page_values<C::kE, 2, HEAD>(vs, vc, v_block_bytes, ks, kc, k_block_bytes, kvh, D, t0,
                                                   tok_end, idA, idB);
          else
            copy_small_page_values<C::kE, 4, HEAD>(vs, vc, v_block_bytes, ks, kc, k_block_bytes, kvh, D, t0,
                                                   tok_end, idA, idB);
          return;
        }
      }
      // K: [N, K, D/x, B, x] -> piece (chunk j, token t) is 16 contiguous bytes.
      const int t = lane & 15;
      const int tok = t0 + t;
      const int id = per_token || t < 8 ? idA : idB;  // per token: idA is token t's own
      const bool ok = tok < tok_end && id >= 0;
      const char* base = kc + static_cast<std::int64_t>(ok ? id : 0) * k_block_bytes +
                         (static_cast<std::int64_t>(kvh) * nck) * (B * 16) +
                         static_cast<std::int64_t>(mod_b(tok)) * 16;
      for (int j = lane >> 4; j < nck; j += 2)
        cp_async16(ks + k_off<L, C::kKChunks>(j, t), ok ? base + static_cast<std::int64_t>(j) * B * 16 : kc,
                   ok ? 16 : 0);
      // V: [N, K, D, B] -> per dim, pieces of `pt` tokens (16 or 8 bytes).
      constexpr int kPt16 = C::kV16;  // tokens per 16-byte piece
      if constexpr (S) {              // page 8 (fp8 pages of 8 run the other kernel)
        if constexpr (C::kE == 2)
          copy_small_page_values<C::kE, 8, HEAD>(vs, vc, v_block_bytes, ks, kc, k_block_bytes, kvh, D, t0,
                                                 tok_end, idA, idB);
        return;
      }
      // Here B >= 8 (pages of 1 run the nhd kernels, pages of 2 and 4 the small-page one).
      if (C::kE == 1 && B == 8) {  // fp8, 8-token blocks: 8-byte pieces
        for (int pi = lane; pi < D * 2; pi += 32) {
          const int d = pi >> 1, q = pi & 1;
          const int tk = t0 + q * 8;
          const int idq = q ? idB : idA;
          const int nvalid = min(8, max(0, tok_end - tk));
          const bool okv = nvalid > 0 && idq >= 0;
          const char* src = kc;
          if (okv) src = vc + idq * v_block_bytes + (static_cast<std::int64_t>(kvh) * D + d) * B;
          cp_async8(vs + d * 16 + q * 8, okv ? src : vc, okv ? nvalid : 0);
        }
      } else {
        constexpr int kPieces = 16 / kPt16;  // pieces per dim row of the chunk
        for (int pi = lane; pi < D * kPieces; pi += 32) {
          const int d = pi / kPieces, q = pi % kPieces;
          const int tk = t0 + q * kPt16;
          const int idq = (B < 16 && q * kPt16 >= 8) ? idB : idA;
          const int nvalid = min(kPt16, max(0, tok_end - tk));
          const bool okv = nvalid > 0 && idq >= 0;
          const char* src = vc;
          if (okv)
            src =
                vc + idq * v_block_bytes + ((static_cast<std::int64_t>(kvh) * D + d) * B + mod_b(tk)) * C::kE;
          cp_async16(vs + (d * 16 + q * kPt16) * C::kE, src, okv ? nvalid * C::kE : 0);
        }
      }
    } else {
      // nhd [N, B, K, D] / hnd [N, K, B, D] for both; a token row of one head is D*E
      // contiguous bytes at tok_bytes * (token in block) + head_bytes * kvh in its block.
      if (C::kE == 1 && (row_bytes & 15)) {  // fp8 rows only 8-byte aligned: 8-byte pieces
        const int n8 = (nck * 16) / 8;          // includes the zero-filled tail of the last chunk
        for (int p0 = 0; p0 < 16 * n8; p0 += 32) {  // warp-uniform trip count: id_of shuffles
          const int pi = p0 + lane;
          const int t = min(pi / n8, 15), j8 = pi % n8;
          const int id = id_of(t);
          if (pi >= 16 * n8) continue;
          const int tok = t0 + t;
          const bool ok = tok < tok_end && id >= 0 && j8 * 8 < row_bytes;
          const std::int64_t blk = ok ? id : 0;
          const std::int64_t row = mod_b(tok) * tok_bytes + kvh * head_bytes + j8 * 8;
          cp_async8(ks + k_off<L, C::kKChunks>(j8 >> 1, t) + (j8 & 1) * 8, ok ? kc + blk * k_block_bytes + row : kc,
                    ok ? 8 : 0);
          cp_async8(vs + t * C::kVPitch + j8 * 8, ok ? vc + blk * v_block_bytes + row : vc,
                    ok ? 8 : 0);  // fp8: unswizzled rows
        }
        return;
      }
      const char* kh_base = kc + kvh * head_bytes;  // the KV head's rows in block 0
      const char* vh_base = vc + kvh * head_bytes;
      if constexpr (C::kStridedRows) {
        if (B >= 16) {
          // A chunk (16 tokens from a multiple of 16) lies in one block, its token t at row
          // mod_b(t0) + t, and with nck (8, 16 or 32) dividing 32 a lane copies the same piece
          // j of rows 32 / nck apart: one base address and a fixed stride, no division by B
          // per piece (with one per piece, the nhd kernel issued 1.6x the vllm kernel's
          // instructions per unit of time and took 1.1x its time: an H200, b32 x4096). The
          // 16-bit d64 kernels (128-byte rows) keep the loop below (this one took them from 122
          // to 158 registers, a CTA less per multiprocessor), and so do the fp8 kernels other
          // than the transposed d128 ones (kStridedRows).
          constexpr int kNck = HEAD * C::kE / 16, kRowStep = 32 / kNck;
          const int j = lane % kNck, t_lane = lane / kNck;
          const int live = idA >= 0 ? tok_end - t0 : 0;  // the chunk's tokens that exist
          const std::int64_t blk = idA >= 0 ? idA : 0;
          const std::int64_t off = static_cast<std::int64_t>(mod_b(t0) + t_lane) * tok_bytes + j * 16;
          const char* ksrc = kh_base + blk * k_block_bytes + off;
          const char* vsrc = vh_base + blk * v_block_bytes + off;
          const std::int64_t step = kRowStep * tok_bytes;
#pragma unroll
          for (int it = 0; it < 16 / kRowStep; ++it, ksrc += step, vsrc += step) {
            const int t = t_lane + it * kRowStep;
            const bool ok = t < live;
            cp_async16(ks + k_off<L, C::kKChunks>(j, t), ok ? ksrc : kc, ok ? 16 : 0);
            cp_async16(vs + v_off<C>(t, j), ok ? vsrc : vc, ok ? 16 : 0);
          }
          return;
        }
      }
      if (!per_token) {
        // One block id per half chunk: its block offsets computed once, each lane's pieces
        // a plain strided loop (no shuffles: this loop is the kernel's copy issue rate).
        const std::int64_t kA = static_cast<std::int64_t>(idA >= 0 ? idA : 0) * k_block_bytes;
        const std::int64_t vA = static_cast<std::int64_t>(idA >= 0 ? idA : 0) * v_block_bytes;
        const std::int64_t kB = static_cast<std::int64_t>(idB >= 0 ? idB : 0) * k_block_bytes;
        const std::int64_t vB = static_cast<std::int64_t>(idB >= 0 ? idB : 0) * v_block_bytes;
        for (int pi = lane; pi < 16 * nck; pi += 32) {
          const int t = pi / nck, j = pi % nck;
          const int tok = t0 + t;
          const bool ok = tok < tok_end && (t < 8 ? idA : idB) >= 0;
          const std::int64_t row = mod_b(tok) * tok_bytes + j * 16;
          const int nb = ok ? min(16, row_bytes - j * 16) : 0;
          cp_async16(ks + k_off<L, C::kKChunks>(j, t), ok ? kh_base + (t < 8 ? kA : kB) + row : kc, nb);
          cp_async16(vs + v_off<C>(t, j), ok ? vh_base + (t < 8 ? vA : vB) + row : vc, nb);
        }
        return;
      }
      for (int p0 = 0; p0 < 16 * nck; p0 += 32) {  // warp-uniform trip count: id_of shuffles
        const int pi = p0 + lane;
        const int t = min(pi / nck, 15), j = pi % nck;
        const int id = id_of(t);
        if (pi >= 16 * nck) continue;
        const int tok = t0 + t;
        const bool ok = tok < tok_end && id >= 0;
        const std::int64_t blk = ok ? id : 0;
        const std::int64_t row = mod_b(tok) * tok_bytes + j * 16;
        const int nb = ok ? min(16, row_bytes - j * 16) : 0;
        cp_async16(ks + k_off<L, C::kKChunks>(j, t), ok ? kh_base + blk * k_block_bytes + row : kc, nb);
        cp_async16(vs + v_off<C>(t, j), ok ? vh_base + blk * v_block_bytes + row : vc, nb);
      }
    }
  };

  // ---- W: issue the copies of group i: the group's values (this warp's quarter of the dim
  // rows, 128 bytes each) into the shared V stage, this warp's chunk's keys into its ring.
  // rawA: the raw block id of the lane's value chunk (wq). A V row's 16-byte pieces are
  // XOR-swizzled by the row (piece j at j ^ (d & 7)), so that the P V reads of a warp's 16
  // columns (8 rows, 4 threads each) fall on different banks; a row stays one 128-byte run.
  [[maybe_unused]] auto load_group = [&](int i, int rawA) {
    const int tg = tok_begin + i * C::kGroupTok;
    const int tq = tg + wq * C::kTok;  // the lane's value chunk
    const int idq = tq < tok_end ? checked_block_id(p, s, div_b(tq), rawA) : -1;
    bad |= tq < tok_end && idq < 0;
    const int j = lane & 7;  // the lane's piece of every row: tokens tg + 8j ..
    const int tj = tg + j * 8;
    const int nvalid = idq >= 0 ? min(8, max(0, tok_end - tj)) : 0;
    const int d0 = warp * (D / C::kWarps) + (lane >> 3);  // rows d0 + 4k
    const char* vsrc = vc + static_cast<std::int64_t>(idq >= 0 ? idq : 0) * v_block_bytes +
                       ((static_cast<std::int64_t>(kvh) * D + d0) * B + mod_b(tj)) * C::kE;
    unsigned char* vst = wide_v + (i % C::kStages) * (C::kHMax * C::kVWideRow);
#pragma unroll
    for (int k = 0; k < HEAD / 16; ++k) {  // D / 4 rows of 8 pieces over 32 lanes
      const int d = d0 + 4 * k;
      cp_async16(vst + d * C::kVWideRow + ((j ^ (d & 7)) << 4),
                 nvalid > 0 ? vsrc + static_cast<std::int64_t>(4 * k) * B * C::kE : vc, nvalid * C::kE);
    }
    // the warp's own chunk's keys: its block id is held by lane 2 * warp (wq == warp)
    const int idk = __shfl_sync(0xffffffffu, idq, 2 * warp);
    const int t0 = tg + warp * C::kTok;
    if (t0 < tok_end) {
      const int t = lane & 15;
      const bool okk = idk >= 0 && t0 + t < tok_end;
      const char* ksrc = kc + static_cast<std::int64_t>(okk ? idk : 0) * k_block_bytes +
                         (static_cast<std::int64_t>(kvh) * nck * B + mod_b(t0) + t) * 16;
      unsigned char* ks = my_ring + (i % C::kStages) * C::kRingStage;
#pragma unroll 4
      for (int pi = lane; pi < nck * 16; pi += 32)
        cp_async16(ks + k_off<L, C::kKChunks>(pi >> 4, t), okk ? ksrc + (pi >> 4) * (B * 16) : kc,
                   okk ? 16 : 0);
    }
    mbar_arrive_cp_async(bar_full + 8 * (i % C::kStages));
  };

  // ---- per-warp online softmax state
  // acc: O's n-tiles [heads g, g + 8][dims]; transposed (N8), O^T's m-tiles [dims][heads 2c, 2c + 1]
  constexpr int kAcc = N8 ? C::kHMax / 16 : C::kNTiles;
  float acc[kAcc][4];
#pragma unroll
  for (int n = 0; n < kAcc; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

#pragma unroll
  for (int i = 0; i < C::kStages - 1; ++i) {
    if constexpr (W) {  // tracked by the full mbarriers alone (no cp.async groups)
      if (i < my_iters) load_group(i, first_a[i]);
    } else {
      if (i < my_chunks) load_chunk(i, first_a[i], first_b[i]);
      cp_async_commit();
    }
  }
  int next_a = first_a[C::kStages - 1], next_b = first_b[C::kStages - 1];
  load_q();  // overlaps the first copies
  if constexpr (N8) {  // the scales of heads 2c, 2c + 1, from the lanes of rows g = 2c, 2c + 1
    const float s0 = qk_row[0];
    qk_row[0] = __shfl_sync(0xffffffffu, s0, 8 * c);
    qk_row[1] = __shfl_sync(0xffffffffu, s0, 8 * c + 4);
  }

  for (int i = 0; i < my_iters; ++i) {
    if constexpr (W) {
      if (i + C::kStages - 1 < my_iters) {
        // group i + kStages - 1 takes the stage of group i - 1: every warp must be done with it
        if (i > 0) mbar_wait(bar_empty + 8 * ((i - 1) % C::kStages), ((i - 1) / C::kStages) & 1);
        load_group(i + C::kStages - 1, next_a);
      }
      raw_ids(i + C::kStages, next_a, next_b);
      mbar_wait(bar_full + 8 * (i % C::kStages), (i / C::kStages) & 1);  // every warp's copies of group i
    } else {
      if (i + C::kStages - 1 < my_chunks) load_chunk(i + C::kStages - 1, next_a, next_b);
      raw_ids(i + C::kStages, next_a, next_b);
      cp_async_commit();
      cp_async_wait<C::kStages - 1>();
      __syncwarp();
    }
    if (i < 6) PA_TRACE(2 + i);

    const unsigned char* ks = my_ring + (i % C::kStages) * C::kRingStage;
    unsigned char* vs_w = W ? wide_v + (i % C::kStages) * (C::kHMax * C::kVWideRow) : nullptr;
    const unsigned char* vs = W ? vs_w : ks + C::kKBytes;
    const int t0 = tok_begin + (warp + i * nw) * C::kTok;
    if constexpr (W) {
      if (t0 >= tok_end) {  // no chunk of this warp in the last group
        mbar_arrive(bar_empty + 8 * (i % C::kStages));
        continue;
      }
    }
    // The window's first chunk: the slots before the window that its block holds came in
    // with the copies; their values are zeroed, so they never meet a product (their
    // logits are masked below). K needs nothing: a key only reaches its own column.
    if constexpr (S) {
      // Small pages read whole blocks: also the slots past the sequence in its last one.
      unsigned char* vz = my_ring + (i % C::kStages) * C::kStageBytes + C::kKBytes;
      const int lo = min(16, max(0, wfirst - t0)), hi = max(0, tok_end - t0);
      if (lo > 0) zero_small_page_values<C::kE>(vz, 0, lo, D, B, small_cs);
      if (hi < 16) zero_small_page_values<C::kE>(vz, max(hi, lo), min(16, (hi + B - 1) / B * B), D, B, small_cs);
      if (lo > 0 || hi < 16) __syncwarp();
    }
    if (!S && t0 < wfirst) {
      if constexpr (W) {  // the warp's 16 columns of the shared stage (no other warp reads them)
        const int n = wfirst - t0;
        for (int e = lane; e < D * n; e += 32) {
          const int d = e / n, col = warp * C::kTok + e % n;
          *reinterpret_cast<std::uint16_t*>(vs_w + d * C::kVWideRow + (((col >> 3) ^ (d & 7)) << 4) +
                                            (col & 7) * 2) = 0;
        }
      } else {
        zero_values<C, L>(my_ring + (i % C::kStages) * C::kStageBytes + C::kKBytes, wfirst - t0, D, nck);
      }
      __syncwarp();
    }

    if constexpr (N8) {
      // ---- transposed (fp8, groups of up to 8): S^T [16 tokens x 8 heads] = K . Q^T, the
      // keys the A operand (rows g, g + 8: the k-loads of the untransposed kernel's two
      // n-tiles), the query the B one; two chains of dependent MMAs, as there
      const int tr0 = slot_token<L>(0, g), tr1 = slot_token<L>(1, g);
      float st[4] = {0.f, 0.f, 0.f, 0.f}, st2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < C::kGroups; ++q) {
        const int j = 4 * q + c;
        uint4 k0 = make_uint4(0u, 0u, 0u, 0u), k1 = k0;
        if (j < nck) {
          k0 = *reinterpret_cast<const uint4*>(ks + k_off<L, C::kKChunks>(j, tr0));
          k1 = *reinterpret_cast<const uint4*>(ks + k_off<L, C::kKChunks>(j, tr1));
        }
        const std::uint32_t w0[4] = {k0.x, k0.y, k0.z, k0.w}, w1[4] = {k1.x, k1.y, k1.z, k1.w};
#pragma unroll
        for (int sub = 0; sub < C::kSPL; ++sub) {
          const std::uint32_t a[4] = {fp8x2_to<M, F>(w0[sub]), fp8x2_to<M, F>(w1[sub]),
                                      fp8x2_to<M, F>(w0[sub] >> 16), fp8x2_to<M, F>(w1[sub] >> 16)};
          mma16816<M>((sub & 1) ? st2 : st, a, qa[q * C::kSPL + sub][0], qa[q * C::kSPL + sub][2]);
        }
      }
      // st[e]: token row g + 8 (e >> 1), head 2c + (e & 1)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[e] += st2[e];
      if (p.soft_cap_log2 > 0.f) {
        with_soft_cap_form(p.soft_cap_log2, [&](auto fast) {
          constexpr bool kFast = decltype(fast)::value;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            st[e] = soft_cap_logit<kFast>(st[e] * qk_row[e & 1], p.soft_cap_log2, p.inv_soft_cap_log2);
        });
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[e] *= qk_row[e & 1];
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = t0 + (e < 2 ? tr0 : tr1);
        float v = st[e] + slope[e & 1] * static_cast<float>(tok - len + 1);
        if (static_cast<unsigned>(tok - wfirst) >= visible) v = -INFINITY;
        st[e] = v;
        mx[e & 1] = fmaxf(mx[e & 1], v);
      }
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // a head's 16 tokens lie on the 8 lanes of one c
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
        corr[h] = advance_max(m_run[h], mx[h]);
      }
      float ps[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        st[e] = exp2f(st[e] - m_run[e & 1]);
        ps[e & 1] += st[e];
      }
      l_run[0] = l_run[0] * corr[0] + ps[0];
      l_run[1] = l_run[1] * corr[1] + ps[1];
      // P^T, the B operand of O^T += V^T P^T: each 8-token half of S^T transposed in place
      // (k-slot r of P^T is token row r of S^T, so the tokens stay matched)
      const std::uint32_t pb0 = movmatrix_trans(pack2<M>(st[0], st[1]));
      const std::uint32_t pb1 = movmatrix_trans(pack2<M>(st[2], st[3]));
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int m = 0; m < kAcc; ++m) {
          acc[m][0] *= corr[0];
          acc[m][1] *= corr[1];
          acc[m][2] *= corr[0];
          acc[m][3] *= corr[1];
        }
      }
      // O^T [D x 8 heads] += V^T [D x 16 tokens] . P^T: m-tile m's rows g, g + 8 are dims
      // (vllm) 16m + g, 16m + 8 + g; (nhd, permuted) g D/8 + m, g D/8 + D/16 + m. A thread's
      // k-slots {2c, 2c+1, 2c+8, 2c+9}: tokens 4c .. 4c+3 (vllm), 2c, 2c+1, 2c+8, 2c+9 (nhd).
      if constexpr (L == CacheLayout::kVLLM) {
        // the [D][16] stage: word of dim d = the 4 value bytes of tokens 4c .. 4c+3
        auto word = [&](int d) { return *reinterpret_cast<const std::uint32_t*>(vs + d * 16 + 4 * c); };
#pragma unroll
        for (int m = 0; m < kAcc; ++m) {
          const std::uint32_t x0 = word(16 * m + g), x1 = word(16 * m + 8 + g);
          const std::uint32_t a[4] = {fp8x2_to<M, F>(x0), fp8x2_to<M, F>(x1), fp8x2_to<M, F>(x0 >> 16),
                                      fp8x2_to<M, F>(x1 >> 16)};
          mma16816<M>(acc[m], a, pb0, pb1);
        }
      } else {
        constexpr int kRun = C::kNTiles;  // D/8 value bytes per thread per token row
        std::uint32_t w[4][kRun / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int tok = 2 * c + (r & 1) + 8 * (r >> 1);
          load_words<kRun>(vs + tok * C::kVPitch + g * kRun, w[r]);
        }
        // byte b of the run as the f16 pair of tokens (2c, 2c+1) (hi = 0) or (2c+8, 2c+9)
        auto pair = [&](int b, int hi) -> std::uint32_t {
          const std::uint32_t x =
              __byte_perm(w[2 * hi][b / 4], w[2 * hi + 1][b / 4], (b & 2) ? 0x7362 : 0x5140);
          return fp8x2_to<M, F>((b & 1) ? x >> 16 : x);
        };
#pragma unroll
        for (int m = 0; m < kAcc; ++m) {
          const std::uint32_t a[4] = {pair(m, 0), pair(kAcc + m, 0), pair(m, 1), pair(kAcc + m, 1)};
          mma16816<M>(acc[m], a, pb0, pb1);
        }
      }
    } else {
      // S = Q K^T. fp8 caches accumulate odd k-steps apart (sc2) and add at the end: two
      // chains of dependent MMAs instead of one twice as long, to hide their latency behind
      // each other (the fp8 loop is bound by its dependency chain, PERF_NOTES.md)
      constexpr bool kSplitK = C::kE == 1;
      float sc[2][4], sc2[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
        sc2[nt][0] = sc2[nt][1] = sc2[nt][2] = sc2[nt][3] = 0.f;
        const int trow = slot_token<L>(nt, g);
        // S: small_key_off(4q + c, trow) for pages of 2 and 4, k_off for pages of 8 (both a
        // base plus q times 4 pieces' step: the swizzles depend on c only)
        [[maybe_unused]] int k_base_small = 0, k_step_small = 0;
        if constexpr (S) {
          k_base_small = B < 8 ? small_key_off(c, trow, B, nck * 16) : k_off<L, C::kKChunks>(c, trow);
          k_step_small = B < 8 ? 64 * B : 1024;
        }
#pragma unroll
        for (int q = 0; q < C::kGroups; ++q) {
          if (HEAD == 0 && q * 4 * C::kV16 >= D) break;
          const int j = 4 * q + c;
          uint4 kv = make_uint4(0u, 0u, 0u, 0u);
          if (j < nck) {
            if constexpr (S)  // pieces 4q + c: a base per (token, c) and a step per q
              kv = *reinterpret_cast<const uint4*>(ks + k_base_small + q * k_step_small);
            else
              kv = *reinterpret_cast<const uint4*>(ks + k_off<L, C::kKChunks>(j, trow));
          }
          const std::uint32_t w[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
          for (int sub = 0; sub < C::kSPL; ++sub) {
            std::uint32_t b0, b1;
            if constexpr (F == KVCacheDType::kAuto) {
              b0 = w[2 * sub];
              b1 = w[2 * sub + 1];
            } else {
              b0 = fp8x2_to<M, F>(w[sub]);
              b1 = fp8x2_to<M, F>(w[sub] >> 16);
            }
            mma16816<M>(kSplitK && (sub & 1) ? sc2[nt] : sc[nt], qa[q * C::kSPL + sub], b0, b1);
          }
        }
        if constexpr (kSplitK) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[nt][e] += sc2[nt][e];
        }
      }

      // the scores as base-2 logits, soft-capped when on: a uniform branch around a loop of
      // its own, so the plain call runs the same instructions as without the option
      if (p.soft_cap_log2 > 0.f) {
        // Rows g + 8 (e >= 2) hold query heads only in a tile of more than 8; in the others
        // (GQA groups up to 8) they are zero rows, whose logits (0) the cap would leave at 0:
        // they skip it (a uniform branch), which halves the cap's cost there.
        with_soft_cap_form(p.soft_cap_log2, [&](auto fast) {
          constexpr bool kFast = decltype(fast)::value;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              sc[nt][e] = soft_cap_logit<kFast>(sc[nt][e] * qk_row[0], p.soft_cap_log2, p.inv_soft_cap_log2);
          if (rows > 8) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
              for (int e = 2; e < 4; ++e)
                sc[nt][e] =
                    soft_cap_logit<kFast>(sc[nt][e] * qk_row[1], p.soft_cap_log2, p.inv_soft_cap_log2);
          } else {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) sc[nt][2] = sc[nt][3] = 0.f;
          }
        });
      } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[nt][e] *= qk_row[e >> 1];
      }

      // online softmax (base 2), masking tokens outside [wfirst, tok_end)
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = t0 + slot_token<L>(nt, 2 * c + (e & 1));
          const int half = e >> 1;
          float v = sc[nt][e] + slope[half] * static_cast<float>(tok - len + 1);
          if (static_cast<unsigned>(tok - wfirst) >= visible) v = -INFINITY;
          sc[nt][e] = v;
          mx[half] = fmaxf(mx[half], v);
        }
      float corr[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
        corr[half] = advance_max(m_run[half], mx[half]);
      }
      float ps[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = exp2f(sc[nt][e] - m_run[e >> 1]);
          sc[nt][e] = pv;
          ps[e >> 1] += pv;
        }
      l_run[0] = l_run[0] * corr[0] + ps[0];
      l_run[1] = l_run[1] * corr[1] + ps[1];
      const std::uint32_t pa[4] = {pack2<M>(sc[0][0], sc[0][1]), pack2<M>(sc[0][2], sc[0][3]),
                                   pack2<M>(sc[1][0], sc[1][1]), pack2<M>(sc[1][2], sc[1][3])};

      // O += P V. fp8 caches: once the running maxima settle, every corr is 1 and the
      // rescale is skipped (a warp-uniform branch; multiplying by 1 would change nothing);
      // 16-bit caches, which stream at the copy rate, keep the straight-line rescale.
      if (C::kE == 2 || __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n) {
          acc[n][0] *= corr[0];
          acc[n][1] *= corr[0];
          acc[n][2] *= corr[1];
          acc[n][3] *= corr[1];
        }
      }
      if constexpr (L == CacheLayout::kVLLM) {
        // The stage as [16 / kB][D][kB] (S: kB = B, blocks small_cs apart; else kB = 16, the
        // [D][16] stage): tokens 4c, 4c + 1 and 4c + 2, 4c + 3 of dim d lie in blocks
        // (4c + 2h) / kB, at token (4c + 2h) % kB of each
        auto pv_blocks = [&](auto block_size) {
          constexpr int kB = decltype(block_size)::value;
          // S: block b's pieces swizzled by x = ((b kB / 2) mod 8) << 4 (small_v_off); the
          // offsets inside a piece (tokens 4c % kB ..) are under 16 bytes, out of x's reach
          const int blk0 = (4 * c) / kB, blk1 = (4 * c + 2) / kB;
          const int x0 = S ? small_v_swz(blk0, kB) : 0, x1 = S ? small_v_swz(blk1, kB) : 0;
          const int cs = S ? small_page_stride(D, kB, C::kE) : 0;
          const unsigned char* v0 = vs + blk0 * cs + (4 * c) % kB * C::kE;
          const unsigned char* v1 = vs + blk1 * cs + (4 * c + 2) % kB * C::kE;
#pragma unroll
          for (int n = 0; n < C::kNTiles; ++n) {
            if (HEAD == 0 && n * 8 >= D) break;
            const int d = n * 8 + g;
            std::uint32_t b0, b1;
            if constexpr (F == KVCacheDType::kAuto) {
              if constexpr (kB >= 4) {  // the 4 tokens adjacent in one block
                const uint2 v = *reinterpret_cast<const uint2*>(v0 + ((d * (kB * 2)) ^ x0));
                b0 = v.x;
                b1 = v.y;
              } else {
                b0 = *reinterpret_cast<const std::uint32_t*>(v0 + ((d * 4) ^ x0));
                b1 = *reinterpret_cast<const std::uint32_t*>(v1 + ((d * 4) ^ x1));
              }
            } else {
              std::uint32_t v;
              if constexpr (kB >= 4)
                v = *reinterpret_cast<const std::uint32_t*>(v0 + ((d * kB) ^ x0));
              else
                v = *reinterpret_cast<const std::uint16_t*>(v0 + ((d * 2) ^ x0)) |
                    (static_cast<std::uint32_t>(*reinterpret_cast<const std::uint16_t*>(v1 + ((d * 2) ^ x1)))
                     << 16);
              b0 = fp8x2_to<M, F>(v);
              b1 = fp8x2_to<M, F>(v >> 16);
            }
            mma16816<M>(acc[n], pa, b0, b1);
          }
        };
        if constexpr (S) {
          if (B == 2)
            pv_blocks(std::integral_constant<int, 2>{});
          else if (B == 4)
            pv_blocks(std::integral_constant<int, 4>{});
          else if constexpr (C::kE == 2)  // fp8 pages of 8 keep the other kernel
            pv_blocks(std::integral_constant<int, 8>{});
        } else if constexpr (W) {
          // the shared [D][64] stage: tokens 4c .. 4c + 3 of the warp's columns are 8 bytes of
          // piece 2 warp + c / 2 of row d = 8n + g, swizzled to (2 warp + c / 2) ^ g
          const unsigned char* v0 = vs + g * C::kVWideRow + (((2 * warp + (c >> 1)) ^ g) << 4) + (c & 1) * 8;
#pragma unroll
          for (int n = 0; n < C::kNTiles; ++n) {
            const uint2 v = *reinterpret_cast<const uint2*>(v0 + n * 8 * C::kVWideRow);
            mma16816<M>(acc[n], pa, v.x, v.y);
          }
        } else {
          pv_blocks(std::integral_constant<int, 16>{});  // [D][16]: one block of 16 as one run
        }
      } else if constexpr (F == KVCacheDType::kAuto) {
        const int mi = lane >> 3, r = lane & 7;
#pragma unroll
        for (int n = 0; n < C::kNTiles; n += 2) {
          if (HEAD == 0 && n * 8 >= D) break;
          if (n + 1 < C::kNTiles && (HEAD != 0 || (n + 1) * 8 < D)) {
            std::uint32_t b[4];
            ldmatrix_x4_trans(b, vs + v_off<C>((mi & 1) * 8 + r, n + (mi >> 1)));
            mma16816<M>(acc[n], pa, b[0], b[1]);
            mma16816<M>(acc[n + 1], pa, b[2], b[3]);
          } else {
            std::uint32_t b[2];
            ldmatrix_x2_trans(b, vs + v_off<C>((mi & 1) * 8 + r, n));
            mma16816<M>(acc[n], pa, b[0], b[1]);
          }
        }
      } else if constexpr (C::kVPerm) {
        // nhd fp8, permuted dims: the thread's D/8 value bytes of tokens 2c, 2c+1, 2c+8,
        // 2c+9 (dims g * D/8 ..), then byte pairs of two tokens per n-tile by byte permutes
        constexpr int kRun = C::kNTiles;  // bytes per thread per token row
        std::uint32_t w[4][kRun / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int tok = 2 * c + (r & 1) + 8 * (r >> 1);
          load_words<kRun>(vs + tok * C::kVPitch + g * kRun, w[r]);
        }
#pragma unroll
        for (int k = 0; k < kRun / 4; ++k) {
          // [t0 byte b, t1 byte b, t0 byte b+1, t1 byte b+1] for b = 0 and b = 2
          const std::uint32_t lo01 = __byte_perm(w[0][k], w[1][k], 0x5140),
                              lo23 = __byte_perm(w[0][k], w[1][k], 0x7362);
          const std::uint32_t hi01 = __byte_perm(w[2][k], w[3][k], 0x5140),
                              hi23 = __byte_perm(w[2][k], w[3][k], 0x7362);
          mma16816<M>(acc[4 * k], pa, fp8x2_to<M, F>(lo01), fp8x2_to<M, F>(hi01));
          mma16816<M>(acc[4 * k + 1], pa, fp8x2_to<M, F>(lo01 >> 16), fp8x2_to<M, F>(hi01 >> 16));
          mma16816<M>(acc[4 * k + 2], pa, fp8x2_to<M, F>(lo23), fp8x2_to<M, F>(hi23));
          mma16816<M>(acc[4 * k + 3], pa, fp8x2_to<M, F>(lo23 >> 16), fp8x2_to<M, F>(hi23 >> 16));
        }
      } else {  // nhd fp8, other head sizes: byte loads of tokens 2c, 2c+1, 2c+8, 2c+9 at dim 8n + g
        static_assert(!C::kVSwz, "fp8 nhd values are staged and read with the padded row pitch, unswizzled");
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n) {
          if (HEAD == 0 && n * 8 >= D) break;
          const unsigned char* col = vs + n * 8 + g;
          const std::uint32_t lo = col[(2 * c) * C::kVPitch] | (col[(2 * c + 1) * C::kVPitch] << 8);
          const std::uint32_t hi = col[(2 * c + 8) * C::kVPitch] | (col[(2 * c + 9) * C::kVPitch] << 8);
          mma16816<M>(acc[n], pa, fp8x2_to<M, F>(lo), fp8x2_to<M, F>(hi));
        }
      }
    }  // N8
    __syncwarp();
    if constexpr (W) mbar_arrive(bar_empty + 8 * (i % C::kStages));  // this thread is done reading group i
  }
  cp_async_wait<0>();
  PA_TRACE(8);

  // ---- merge the warps
  // a row's exp-sums are spread over the lanes of its g (over c when transposed)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if constexpr (N8) {
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 4);
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 8);
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 16);
    } else {
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 1);
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 2);
    }
  }
  const bool any_bad = __syncthreads_or(bad);  // also: every warp is done with its ring
  PA_TRACE(9);
  if constexpr (N8) {
    if (g == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        red_m[warp * C::kRows + 2 * c + h] = m_run[h];
        red_l[warp * C::kRows + 2 * c + h] = l_run[h];
      }
    }
  } else if (c == 0) {
    red_m[warp * C::kRows + g] = m_run[0];
    red_m[warp * C::kRows + g + 8] = m_run[1];
    red_l[warp * C::kRows + g] = l_run[0];
    red_l[warp * C::kRows + g + 8] = l_run[1];
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = N8 ? 2 * c + half : g + 8 * half;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w)
      if (w < nw) mx = fmaxf(mx, red_m[w * C::kRows + r]);
    f[half] = m_run[half] == -INFINITY ? 0.f : exp2f(m_run[half] - mx);
  }
  float* slab = reinterpret_cast<float*>(smem);
  float* r0 = slab + (warp * C::kRows + g) * C::kSlabPitch + 2 * c;
  float* r1 = r0 + 8 * C::kSlabPitch;
  // only the group's rows: the padding rows of the mma tile are never stored
  if constexpr (N8) {  // acc[m][e]: head 2c + (e & 1), m-tile m's row g + 8 (e >> 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (2 * c + h >= rows) continue;
      float* o = slab + (warp * C::kRows + 2 * c + h) * C::kSlabPitch;
#pragma unroll
      for (int m = 0; m < kAcc; ++m)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int d = L == CacheLayout::kVLLM ? 16 * m + 8 * hi + g : g * (D / 8) + hi * (D / 16) + m;
          o[d] = acc[m][2 * hi + h] * f[h];
        }
    }
  } else if constexpr (C::kVPerm) {  // columns 2c, 2c+1 of n-tile n are dims 2c * D/8 + n, (2c + 1) * D/8 + n
    float* o0 = r0 - 2 * c + 2 * c * C::kNTiles;
    float* o1 = o0 + 8 * C::kSlabPitch;
#pragma unroll
    for (int n = 0; n < C::kNTiles; ++n) {
      if (g < rows) {
        o0[n] = acc[n][0] * f[0];
        o0[n + C::kNTiles] = acc[n][1] * f[0];
      }
      if (g + 8 < rows) {
        o1[n] = acc[n][2] * f[1];
        o1[n + C::kNTiles] = acc[n][3] * f[1];
      }
    }
  } else {
    if (g < rows) {
#pragma unroll
      for (int n = 0; n < C::kNTiles; ++n)
        if (HEAD != 0 || n * 8 < D)
          *reinterpret_cast<float2*>(r0 + n * 8) = make_float2(acc[n][0] * f[0], acc[n][1] * f[0]);
    }
    if (g + 8 < rows) {
#pragma unroll
      for (int n = 0; n < C::kNTiles; ++n)
        if (HEAD != 0 || n * 8 < D)
          *reinterpret_cast<float2*>(r1 + n * 8) = make_float2(acc[n][2] * f[1], acc[n][3] * f[1]);
    }
  }
  __syncthreads();
  PA_TRACE(10);
  store_rows<T, C::kWarps, C::kRows, C::kSlabPitch, HEAD>(p, red_m, red_l, slab, s, task.row, h0, rows, part,
                                                          nw, any_bad);
  PA_TRACE(11);
  PA_TRACE_PRINT("PT", my_chunks);
}

// Two entry points: the transposed kernels bound to kMinBlocks CTAs per multiprocessor, the
// others with no such bound (a bound of 1 is not the same to ptxas: it took the bf16 nhd d128
// kernel from 168 to 192 registers, 3 to 2 CTAs per multiprocessor).
template <class T, KVCacheDType F, int HEAD, CacheLayout L, bool S = false, bool N8 = false, bool W = false>
__global__ void __launch_bounds__(MmaDecodeConfig<T, F, HEAD, L, S, N8, W>::kThreads)
    decode_mma_kernel(const __grid_constant__ DecodeKernelParams p) {
  decode_mma_body<T, F, HEAD, L, S, N8, W>(p);
}
template <class T, KVCacheDType F, int HEAD, CacheLayout L, bool S>
__global__ void __launch_bounds__(MmaDecodeConfig<T, F, HEAD, L, S, true>::kThreads,
                                  MmaDecodeConfig<T, F, HEAD, L, S, true>::kMinBlocks)
    decode_mma_kernel_n8(const __grid_constant__ DecodeKernelParams p) {
  decode_mma_body<T, F, HEAD, L, S, true, false>(p);
}

}  // namespace pagedattn::cuda_backend
