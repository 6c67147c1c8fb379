// Pieces shared by the decode kernels: checked block ids and sequence lengths, the
// cross-warp merge of online-softmax states and the final store (single pass) or
// partial store (partitioned).
#pragma once

#include "cuda/common.cuh"
#include "cuda/decode_params.cuh"

namespace pagedattn::cuda_backend {

// `id`, read from table column `col` of sequence `s`, or -1 (recorded) when out of range.
__device__ __forceinline__ int checked_block_id(const DecodeKernelParams& p, int s, int col, int id) {
  if (id < 0 || id >= p.num_blocks) {
    record_error(p.error, DecodeErrorFlag::kBlockId, s, col, id);
    return -1;
  }
  return id;
}

// Programmatic dependent launch (sm_90 and later; no-ops before): a decode kernel lets
// the reduce kernel queued behind it start launching at once, and the reduce kernel
// waits for the decode grid to complete (memory included) before it reads the partials.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Timeline tracing for kernel studies (a build with -DPAGEDATTN_TRACE only; see
// .ci/trace_decode.py): thread 0 of each CTA notes the global timer at fixed points and
// prints them once at its end. Compiled out otherwise.
#ifdef PAGEDATTN_TRACE
#define PA_TRACE_DECL unsigned long long pa_tr[12] = {}
#define PA_TRACE(i)                                                                    \
  do {                                                                                 \
    if (threadIdx.x == 0 && (i) < 12)                                                  \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(pa_tr[(i)]));                   \
  } while (0)
#define PA_TRACE_PRINT(tag, n)                                                                     \
  do {                                                                                             \
    if (threadIdx.x == 0) {                                                                        \
      unsigned smid;                                                                               \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));                                            \
      printf("%s %u %u %u %u %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", tag, \
             blockIdx.x, blockIdx.y, blockIdx.z, smid, (n), pa_tr[0], pa_tr[1], pa_tr[2], pa_tr[3], \
             pa_tr[4], pa_tr[5], pa_tr[6], pa_tr[7], pa_tr[8], pa_tr[9], pa_tr[10], pa_tr[11]);      \
    }                                                                                              \
  } while (0)
#else
#define PA_TRACE_DECL
#define PA_TRACE(i)
#define PA_TRACE_PRINT(tag, n)
#endif

// A read-only 32-bit load the compiler may not move: issued where it is written, so
// independent loads at a kernel's start overlap instead of waiting on each other.
__device__ __forceinline__ int ldg_now(const std::int32_t* ptr) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
  return v;
}

// `len` if it is a valid length of sequence s (inside [0, M * B]), else -1 (recorded).
__device__ __forceinline__ int checked_seq_len(const DecodeKernelParams& p, int s, int len) {
  if (len < 0 || static_cast<std::int64_t>(len) > static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size) {
    if (threadIdx.x == 0) record_error(p.error, DecodeErrorFlag::kSeqLen, s, -1, len);
    return -1;
  }
  return len;
}

// The query / output row of sequence s: s itself, or in a mixed varlen batch the
// sequence's one row when it has exactly one valid row, else -1 (the varlen kernel serves
// it: prefill_seq() accepts it and it has another number of rows, or rejects it).
__device__ __forceinline__ int decode_row(const DecodeKernelParams& p, int s) {
  if (p.query_start_loc == nullptr) return s;
  const int a = p.query_start_loc[s], b = p.query_start_loc[s + 1], len = p.seq_lens[s];
  const std::int64_t max_len = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
  const bool one = a >= 0 && b == a + 1 && b <= p.num_tokens && len >= 1 && len <= max_len && p.max_query_len != 0;
  return one ? a : -1;
}

// Writes `rows` heads of [D] outputs of query row `row` starting at head h0 with one
// value (0 or NaN).
template <class T>
__device__ __forceinline__ void fill_out(const DecodeKernelParams& p, int row, int h0, int rows, float v) {
  const int D = p.head_size;
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    T* o = static_cast<T*>(p.out) + row * p.o_stride_seq + static_cast<std::int64_t>(h0 + r) * p.o_stride_head;
    o[d] = from_float<T>(v);
  }
}

// Sliding window: the first key the query of a sequence of length len sees (0 without a
// window), and the first token its CTAs stream: that key rounded down to a warp chunk
// (kWindowAlign, the partition alignment), so chunks keep their block alignment. The
// partitions are laid from there; blocks before it are never read.
inline constexpr int kWindowAlign = 16;
__device__ __forceinline__ int window_first(const DecodeKernelParams& p, int len) {
  return p.sliding_window > 0 && len > p.sliding_window ? len - p.sliding_window : 0;
}
__device__ __forceinline__ int window_base(const DecodeKernelParams& p, int len) {
  return window_first(p, len) & ~(kWindowAlign - 1);
}

// Where a decode CTA works. Grid: x = partition, y = KV head x head tile, z = sequence.
// cta_task also issues the load of the sequence's length (checked by cta_seq_len), so
// the caller can issue its block-id loads before waiting on it.
struct CtaTask {
  int part, kvh, s;
  int row;        // the query / output row (decode_row), -1: not this kernel's sequence
  int rows;       // valid query heads of the tile
  int h0;         // first query head of the tile
  int tok_begin;  // first token of the partition
  const std::int32_t* table_row;  // the sequence's block-table row
  int raw_len;    // seq_lens[s], unchecked
};
__device__ __forceinline__ CtaTask cta_task(const DecodeKernelParams& p, int tile_rows) {
  CtaTask t;
  t.raw_len = ldg_now(p.seq_lens + blockIdx.z);
  t.part = static_cast<int>(blockIdx.x);
  t.kvh = static_cast<int>(blockIdx.y) / p.num_head_tiles;
  const int row0 = static_cast<int>(blockIdx.y) % p.num_head_tiles * tile_rows;  // first row inside the group
  t.s = static_cast<int>(blockIdx.z);
  t.row = decode_row(p, t.s);
  t.rows = min(tile_rows, p.group - row0);
  t.h0 = t.kvh * p.group + row0;
  t.tok_begin = t.part * p.partition_size;
  // a window lays the partitions from its base: waits for the length (windowed calls only)
  if (p.sliding_window > 0) t.tok_begin += window_base(p, t.raw_len);
  t.table_row = p.block_tables + static_cast<std::int64_t>(t.s) * p.max_blocks_per_seq;
  return t;
}

// Block sizes below 8 put several blocks in 8 tokens of a 16-token chunk: the decode
// kernels then keep in each lane the block id of the chunk's token t0 + (lane & 15) (the
// lane's token) instead of the ids of tokens t0 and t0 + 8, and take a token's id from
// its lane with a shuffle. Every page size is a power of two (supported::kCudaBlockSizes).
__device__ __forceinline__ bool ids_per_token(int block_size) { return block_size < 8; }

// The raw block ids of tokens t0 and t0 + 8 (one block when B >= 16), or with
// ids_per_token(B) of the lane's token, read without knowing the sequence length: any
// column in [0, M) may be read; 0 outside it. t0 comes from the unchecked length when a
// window lays the partitions (cta_task): a length near 2^31 makes it wrap negative, so
// the columns are compared unsigned.
__device__ __forceinline__ void early_block_ids(const DecodeKernelParams& p, const CtaTask& t, int t0, int& a,
                                                int& b) {
  const int B = p.block_size;
  const auto in_table = [&](int col) {
    return static_cast<unsigned>(col) < static_cast<unsigned>(p.max_blocks_per_seq);
  };
  if (ids_per_token(B)) {
    const int col = (t0 + static_cast<int>(threadIdx.x & 15)) / B;
    a = b = in_table(col) ? ldg_now(t.table_row + col) : 0;
    return;
  }
  a = in_table(t0 / B) ? ldg_now(t.table_row + t0 / B) : 0;
  b = a;
  if (B < 16 && in_table((t0 + 8) / B)) b = ldg_now(t.table_row + (t0 + 8) / B);
}

// The CTA's checked sequence length, or -1 when the CTA has nothing to do; the output
// it owns (single pass) is then written: NaN for an invalid length (the reduce also
// turns an invalid length into NaN), zeros for length 0.
template <class T>
__device__ __forceinline__ int cta_seq_len(const DecodeKernelParams& p, const CtaTask& t) {
  if (t.row < 0) return -1;
  const int len = checked_seq_len(p, t.s, t.raw_len);
  if (len < 0 || t.tok_begin >= len) {
    if (p.part_out == nullptr) fill_out<T>(p, t.row, t.h0, t.rows, len < 0 ? NAN : 0.f);
    return -1;
  }
  return len;
}

// Final step of a decode CTA. Inputs in shared memory, written by nw <= W warps:
//   wm, wl   [W][R]      per-warp max logit (base 2) and exp-sum of each row
//   slab     [W][R][DP]  per-warp unnormalised output of each row, already scaled by
//                        exp2(wm - row max) (the caller does that); DP is a multiple of
//                        4 floats and the slab 16-byte aligned
// Writes out (NP == 1) or the partition's partial results. A thread takes 4 dims of a
// row at a time (head sizes are multiples of 8), so a GQA group's rows take one pass.
template <class T, int W, int R, int DP, int HEAD>
__device__ __forceinline__ void store_rows(const DecodeKernelParams& p, const float* wm, const float* wl,
                                           const float* slab, int s, int row_out, int h0, int rows, int part,
                                           int nw, bool bad) {
  const int D = HEAD ? HEAD : p.head_size;
  const int q4 = D / 4;
  const bool single = p.part_out == nullptr;
  for (int i = threadIdx.x; i < rows * q4; i += blockDim.x) {
    const int r = i / q4, d = (i - r * q4) * 4;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (w < nw) mx = fmaxf(mx, wm[w * R + r]);
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      if (w >= nw) break;
      const float m = wm[w * R + r];
      if (m != -INFINITY) l += wl[w * R + r] * exp2f(m - mx);
      const float4 v = *reinterpret_cast<const float4*>(slab + (w * R + r) * DP + d);
      o.x += v.x;
      o.y += v.y;
      o.z += v.z;
      o.w += v.w;
    }
    const float sc = bad ? NAN : p.v_scale;
    o.x *= sc;
    o.y *= sc;
    o.z *= sc;
    o.w *= sc;
    const int h = h0 + r;
    if (single) {
      // out may be strided by single elements: element stores
      T* out =
          static_cast<T*>(p.out) + row_out * p.o_stride_seq + static_cast<std::int64_t>(h) * p.o_stride_head + d;
      // the sink joins the denominator (partitioned calls: once, in the reduce); a row
      // without a finite logit stays NaN
      if (p.sinks != nullptr && mx != -INFINITY) l += exp2f(p.sinks[h] * kLog2e - mx);
      const float inv = 1.f / l;
      out[0] = from_float<T>(o.x * inv);
      out[1] = from_float<T>(o.y * inv);
      out[2] = from_float<T>(o.z * inv);
      out[3] = from_float<T>(o.w * inv);
    } else {
      const std::int64_t row = (static_cast<std::int64_t>(s) * p.num_heads + h) * p.num_partitions + part;
      *reinterpret_cast<float4*>(p.part_out + row * D + d) = o;
      if (d == 0) {
        p.part_max[row] = mx;
        p.part_sum[row] = bad ? NAN : l;
      }
    }
  }
}

}  // namespace pagedattn::cuda_backend
