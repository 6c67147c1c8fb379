// The parameter struct of the varlen (prefill) kernels, passed by value, and the device
// checks every CTA makes on the index arrays it reads before it reads any cache memory.
//
// Dimension legend: S seqs, T query rows, H query heads, K KV heads, G = H / K, D head
// size, B block size, N blocks, M max blocks per seq.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/error_record.cuh"

namespace pagedattn::cuda_backend {

struct PrefillKernelParams {
  void* out;  // [T, H, D], query dtype
  std::int64_t o_stride_tok, o_stride_head;
  const void* query;  // [T, H, D]
  std::int64_t q_stride_tok, q_stride_head;
  const void* key_cache;    // vllm [N, K, D/x, B, x] | nhd [N, B, K, D] | hnd [N, K, B, D]
  const void* value_cache;  // vllm [N, K, D, B]      | nhd [N, B, K, D] | hnd [N, K, B, D]
  // Elements between the starts of consecutive blocks of each cache (>= one block), and,
  // for the token-major layouts (nhd and hnd share the kNHD kernels), the elements from a
  // block's start to token t, head h's row: t * tok_stride + h * head_stride.
  std::int64_t k_block_stride, v_block_stride;
  std::int64_t tok_stride, head_stride;
  // The block strides and a block's row offsets all fit 32 bits (a block of fewer than 2^31
  // elements): the Hopper kernel's token-major copies then take 32-bit products.
  bool strides32;
  const std::int32_t* block_tables;     // [S, M]
  const std::int32_t* seq_lens;         // [S]
  const std::int32_t* query_start_loc;  // [S + 1]
  const float* alibi_slopes;            // [H] or null

  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  std::int64_t num_blocks;
  int num_tokens;     // T
  int max_query_len;  // the caller's bound, or -1
  int group;          // G
  bool skip_single;   // leave sequences with one valid row to the decode kernels (mixed batches)
  bool flat_tiles;    // grid x enumerates every sequence's tiles (prefill_item_warp), z = 1
  // Persistent kernels (flat grid only): the grid has fewer CTAs than work items, and each
  // walks items of the virtual grid of `tiles` x num_kv_heads (prefill_item_index), taking
  // the next one from a device counter as it finishes one (dynamic, as the hardware deals
  // blocks). sched: {next item, CTAs done}, zero when the kernel starts and again when it
  // ends (its last CTA resets them; the launcher owns them, cuda/scratch_pool.cuh).
  bool persistent;
  int tiles;
  int* sched;

  float qk_scale_log2;  // scale * k_scale * log2(e): logits are kept in base 2
  float v_scale;        // fp8 caches: real value = stored * v_scale (1 otherwise)

  // Variants (0 / null = off): see DecodeKernelParams.
  int sliding_window;       // the row at position pos sees keys pos - W + 1 .. pos
  float soft_cap_log2;      // soft_cap * log2(e)
  float inv_soft_cap_log2;  // 1 / soft_cap_log2
  const float* sinks;       // [H] (natural units)

  DeviceErrorRecord* error;  // the checked call's record, or null
};

// One sequence's part of a varlen call, as a CTA sees it after the checks.
struct PrefillSeq {
  int row0;   // its first query row
  int q_len;  // its query rows
  int len;    // its tokens (keys)
  bool ok;    // false: the index arrays are invalid for this sequence (outputs get NaN)
};

// What is wrong with sequence s's query range [a, b) and length len, without recording
// it: 0 nothing, 1 the range, 2 the length, 3 more rows than keys (or than max_query_len).
// prefill_seq records and acts on it; a persistent grid's skip of empty tiles asks it of
// the sequences it skips (prefill_item_warp).
__device__ __forceinline__ int prefill_seq_fault(const PrefillKernelParams& p, int a, int b, int len) {
  const std::int64_t max_len = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
  if (a < 0 || b < a || b > p.num_tokens) return 1;
  if (len < 0 || len > max_len) return 2;
  if (b - a > len || (p.max_query_len >= 0 && b - a > p.max_query_len)) return 3;
  return 0;
}

// Checks sequence s's query range [a, b) and length len (read once by the caller from
// query_start_loc and seq_lens). A bad entry is recorded (checked calls) and makes the
// sequence's rows NaN; nothing outside the arrays is ever read or written.
__device__ __forceinline__ PrefillSeq prefill_seq(const PrefillKernelParams& p, int s, int a, int b, int len) {
  PrefillSeq q;
  q.row0 = a;
  q.q_len = b - a;
  q.len = len;
  q.ok = true;
  const int fault = prefill_seq_fault(p, a, b, len);
  if (fault == 1) {
    record_error(p.error, DecodeErrorFlag::kQueryStart, s, a, b);
    q.ok = false;
    // The part of [a, b) inside the query gets NaN.
    q.row0 = a < 0 ? 0 : (a > p.num_tokens ? p.num_tokens : a);
    const int hi = b < q.row0 ? q.row0 : (b > p.num_tokens ? p.num_tokens : b);
    q.q_len = hi - q.row0;
  } else if (fault == 2) {
    record_error(p.error, DecodeErrorFlag::kSeqLen, s, -1, q.len);
    q.ok = false;
  } else if (fault == 3) {
    record_error(p.error, DecodeErrorFlag::kQueryRows, s, q.q_len, q.len);
    q.ok = false;
  }
  return q;
}

// The first key a row at position pos sees: 0, or with a sliding window pos - W + 1.
__device__ __forceinline__ int prefill_window_first(const PrefillKernelParams& p, int pos) {
  return p.sliding_window > 0 && pos >= p.sliding_window ? pos - p.sliding_window + 1 : 0;
}

// A CTA's work: which sequence and rows it computes, or that it fills rows with NaN, or
// has nothing to do.
struct PrefillItem {
  int kind;  // kItemAttend, kItemNaN (invalid index arrays: the rows get NaN), kItemSkip or kItemEnd
  int seq, row0, rows, r_lo, r_hi, r_end;  // rows [r_lo, r_hi) computed, or [r_lo, r_end) filled with NaN
  int ctx, kv_begin, kv_end;               // context before the rows; the keys the CTA reads
};
constexpr int kItemAttend = 0, kItemNaN = 1, kItemSkip = 2, kItemEnd = 3;  // kItemEnd: no more work

// The flat grid of the tensor-core kernel: CTA c (counted from the top, so the longest
// tiles start first) works on tile c - first(s) of the sequence s with the largest
// first(s) = floor(qsl[s] * G / rows_per_cta) + s <= c. Sequence s needs
// ceil(q_s * G / rows_per_cta) tiles and first(s + 1) - first(s) is at least that, so
// the ranges never overlap and ceil(T * G / rows_per_cta) + S CTAs cover every tile; CTAs
// in the gaps find no tile. Found by a search over query_start_loc, so the
// grid needs no device data on the host and no idle CTA per (sequence, tile bound). With
// an invalid query_start_loc the search still ends, on some sequence, which the CTA then
// checks like any other.
//
// One warp searches: each round, its 32 lanes read first() at 32 evenly spaced sequences
// of the remaining range and a ballot keeps the part after the last one <= c, so a batch
// of up to 32 sequences takes one round of loads, up to 1024 two. Each lane reads its
// sequence's query_start_loc pair and seq_lens entry in the same round, and the CTA's
// work is computed from the values of that one read (a caller changing the arrays during
// the call cannot make the search and the checks see different numbers).
//
// c is the tile's index in a grid of top + 1 tiles (flat: the index above; otherwise the
// tile of sequence blockIdx.z). Called by all lanes of one warp; lane 0's result is the
// CTA's work.
template <int kBM>
__device__ __forceinline__ PrefillItem prefill_item_warp(const PrefillKernelParams& p, int c, int top) {
  PrefillItem it{};
  it.kind = kItemSkip;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int G = p.group;
  int lo = p.flat_tiles ? 0 : static_cast<int>(blockIdx.z);
  int hi = p.flat_tiles ? p.num_seqs - 1 : lo;
  for (;;) {
    const int stride = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32)
    const int idx = lo + lane * stride;
    const bool in = idx <= hi;
    int a = 0, b = 0, len = 0;
    if (in) {
      a = p.query_start_loc[idx];
      b = p.query_start_loc[idx + 1];
      len = p.seq_lens[idx];
    }
    const std::int64_t first = static_cast<std::int64_t>(a) * G / kBM + idx;
    const unsigned le = __ballot_sync(0xffffffffu, in && (!p.flat_tiles || first <= c));
    if (le == 0) return it;  // no sequence starts at or before c: a gap
    const int k = 31 - __clz(le);
    if (stride > 1) {
      const int nlo = lo + k * stride;
      hi = min(hi, nlo + stride - 1);
      lo = nlo;
      continue;
    }
    // the sequence: lane k holds its values
    const int s = lo + k;
    a = __shfl_sync(0xffffffffu, a, k);
    b = __shfl_sync(0xffffffffu, b, k);
    len = __shfl_sync(0xffffffffu, len, k);
    std::int64_t tile = c;
    if (p.flat_tiles) {
      tile = c - (static_cast<std::int64_t>(a) * G / kBM + s);
      const std::int64_t q = static_cast<std::int64_t>(b) - a;
      const std::int64_t need = q > 0 ? (q * G + kBM - 1) / kBM : 0;
      if (tile >= need) return it;  // a gap after sequence s
    }
    if (lane != 0) return it;  // one lane records errors and decides
    const PrefillSeq sq = prefill_seq(p, s, a, b, len);
    if (p.skip_single && sq.ok && sq.q_len == 1) return it;  // the decode kernels serve it
    it.ctx = c;  // (a skipped item from here on: this tile alone)
    it.seq = s;
    it.row0 = sq.row0;
    it.rows = sq.q_len * G;
    // (64 bits: with an invalid query_start_loc the tile can lie far past any row)
    if (tile < 0 || tile * kBM >= it.rows) return it;
    it.r_lo = static_cast<int>(tile * kBM);
    it.r_hi = min(it.rows, it.r_lo + kBM);
    if (!sq.ok) {
      // The last tile's CTA also covers rows past the grid (a max_query_len that was too small).
      it.kind = kItemNaN;
      it.r_end = !p.flat_tiles && tile == top ? it.rows : it.r_hi;
      return it;
    }
    it.kind = kItemAttend;
    it.r_end = it.r_hi;
    it.ctx = sq.len - sq.q_len;
    it.kv_end = it.ctx + (it.r_hi - 1) / G + 1;  // keys the CTA's last row sees
    // Sliding window: the CTA's first row's window starts first (no key before it is read).
    it.kv_begin = prefill_window_first(p, it.ctx + it.r_lo / G);
    return it;
  }
}

// The virtual index j of item k (0, 1, ...) of a CTA, or -1 when the CTA is done; called by
// one thread (the persistent kernel's producer lane that then broadcasts it). One item per
// CTA unless persistent. A persistent CTA b takes item b first, then whatever index the
// counter hands out next (prefetched one item ahead in `next`, so the atomic's latency
// hides behind the current item): a CTA that finishes early takes more, the greedy deal of
// the hardware's block scheduler, which balances tiles of unequal length (a static deal
// of rounds left CTAs of a batch of equal prompts up to 1.2x the mean in a simulation: the
// tile lengths form a sawtooth over the sequences). The CTA that takes the last end
// resets the counters for the next launch.
__device__ __forceinline__ int prefill_item_index(const PrefillKernelParams& p, int k, int& next) {
  if (!p.persistent) return k == 0 ? 0 : -1;
  const int n = p.tiles * p.num_kv_heads;  // < 2^31: the launcher checks tiles x heads
  const int j = k == 0 ? static_cast<int>(blockIdx.x) : next;
  if (j < n) {
    next = static_cast<int>(gridDim.x) + atomicAdd(&p.sched[0], 1);
    return j;
  }
  // this CTA's end: every atomic on sched[0] of this CTA is done
  if (atomicAdd(&p.sched[1], 1) == static_cast<int>(gridDim.x) - 1) {
    atomicExch(&p.sched[0], 0);
    atomicExch(&p.sched[1], 0);
  }
  return -1;
}

// Item j's tile index c in the grid (counted from the top, so the longest tiles come first)
// and KV head: one item per grid cell, or for a persistent grid the virtual grid walked
// tile-major (all KV heads of a tile before the next).
__device__ __forceinline__ void prefill_item_tile(const PrefillKernelParams& p, int j, int& c, int& kh) {
  if (!p.persistent) {
    c = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
    kh = static_cast<int>(blockIdx.y);
    return;
  }
  c = p.tiles - 1 - j / p.num_kv_heads;
  kh = j % p.num_kv_heads;
}

// The CTA's work as warp 0 alone reads it, shared through `slot` (shared memory): every
// thread takes its control flow (tile counts, ranges, early exits) from the same numbers,
// so all threads meet every barrier whatever a caller does to the index arrays while the
// kernel runs. (The sm_80 and CUDA-core kernels; the Hopper kernel reads its items in its
// producer.)
template <int kBM, bool kLongestFirst>
__device__ __forceinline__ PrefillItem prefill_shared_item(const PrefillKernelParams& p, PrefillItem* slot) {
  if (threadIdx.x < 32) {
    // kLongestFirst counts the tiles from the top of the grid: the longest start first
    const int top = static_cast<int>(gridDim.x) - 1;
    const int c = kLongestFirst ? top - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
    const PrefillItem it = prefill_item_warp<kBM>(p, c, top);
    if (threadIdx.x == 0) *slot = it;
  }
  __syncthreads();
  return *slot;
}

// A base-2 logit through the soft cap (when on: a uniform branch).
__device__ __forceinline__ float prefill_soft_capped(const PrefillKernelParams& p, float v) {
  return p.soft_cap_log2 > 0.f ? p.soft_cap_log2 * tanhf(v * p.inv_soft_cap_log2) : v;
}

// exp(sinks[h]) in the units of a row whose base-2 max logit is m: the sink's share of
// the row's denominator (0 without sinks; a row without a finite logit stays NaN).
__device__ __forceinline__ float prefill_sink(const PrefillKernelParams& p, int h, float m) {
  return p.sinks != nullptr && m != -INFINITY ? exp2f(p.sinks[h] * kLog2e - m) : 0.f;
}

// Checks the block ids of tokens [kv_begin, kv_end) of sequence s (the blocks before
// kv_begin's are not read): true when all are inside the pool (every thread gets the
// same answer; the first bad one is recorded).
__device__ __forceinline__ bool prefill_blocks_ok(const PrefillKernelParams& p, int s, int kv_begin, int kv_end) {
  const int nb = (kv_end + p.block_size - 1) / p.block_size;
  const std::int32_t* row = p.block_tables + static_cast<std::int64_t>(s) * p.max_blocks_per_seq;
  int bad = 0;
  for (int i = kv_begin / p.block_size + threadIdx.x; i < nb; i += blockDim.x) {
    const int id = row[i];
    if (id < 0 || id >= p.num_blocks) {
      record_error(p.error, DecodeErrorFlag::kBlockId, s, i, id);
      bad = 1;
    }
  }
  return __syncthreads_or(bad) == 0;
}

// Entry i of a block-table row, as the loaders read it after prefill_blocks_ok: an entry
// a caller changed since the check (racing the kernel) reads block 0, never a block
// outside the pool. (Checked calls still report the first bad id they saw.)
__device__ __forceinline__ int prefill_block_id(const PrefillKernelParams& p, const std::int32_t* row, int i) {
  const int id = row[i];
  return id >= 0 && id < p.num_blocks ? id : 0;
}

// Writes NaN to the rows [r_lo, r_hi) of packed (token, group head) rows of KV head kh of
// a sequence whose first query row is row0 (an invalid sequence's outputs).
// (threads tid of n: the CTA's by default).
template <class T>
__device__ __forceinline__ void prefill_fill_nan(const PrefillKernelParams& p, int row0, int kh, int r_lo, int r_hi,
                                                 int tid = threadIdx.x, int n = blockDim.x) {
  const int D = p.head_size;
  const T nan = from_float<T>(__int_as_float(0x7fc00000));
  for (int i = tid; i < (r_hi - r_lo) * D; i += n) {
    const int r = r_lo + i / D, d = i % D;
    const int tok = row0 + r / p.group, h = kh * p.group + r % p.group;
    static_cast<T*>(p.out)[tok * p.o_stride_tok + h * p.o_stride_head + d] = nan;
  }
}

}  // namespace pagedattn::cuda_backend
